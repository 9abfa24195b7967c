"""The OpenAI wire protocol: typed requests, typed replies, one converter.

Requests are attrs classes structured from the JSON body by `parse_request`, which
keeps OpenAI's strictness (`true` is not an integer, NaN is not a number, null counts
as absent) and turns the first problem into a `RequestError` whose `param` is the JSON
path (`messages[1].content`).

Every field of OpenAI's and vLLM's request schemas is known here, in one of three ways:
- a typed attribute: implemented (or accepted and ignored when it means nothing here:
  `user`, `metadata`, `service_tier`, ...);
- listed in the class's `_not_implemented`: a 400 that names the field, when it is
  present with a value other than its harmless default;
- anything else gets OpenAI's answer: `Unrecognized request argument supplied: NAME`.

Replies are attrs classes too, unstructured by the same converter. A field defaulting to
`ABSENT` is left out of the JSON (OpenAI omits some keys rather than sending null).
"""
from __future__ import annotations

import math
import types
import typing
from typing import Any, Callable, ClassVar, TypeVar, Union

import attrs
import cattrs
from gpu.interface import Constraint
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override


class RequestError(Exception):
    """An error the client caused (or the server refused); rendered as OpenAI JSON."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code

    def to_dict(self) -> dict[str, Any]:
        return converter.unstructure(ErrorBody(ErrorInfo(self.message, self.type, self.param,
                                                         self.code)))


@attrs.frozen
class ErrorInfo:
    message: str
    type: str
    param: str | None = None
    code: str | None = None


@attrs.frozen
class ErrorBody:
    error: ErrorInfo


def server_error(message: str | None) -> ErrorBody:
    return ErrorBody(ErrorInfo(message or "The engine failed while generating.", "server_error"))


# -- strict JSON types -------------------------------------------------------------------

class _Invalid(Exception):
    """A leaf validation failure; `parse_request` prefixes the JSON path."""

    def __init__(self, what: str, field: str | None = None) -> None:
        super().__init__(what)
        self.what = what          # e.g. "must be an integer, got a string."
        self.field = field        # set by attribute validators (they run outside cattrs' notes)


def json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _mismatch(what: str, value: object) -> _Invalid:
    return _Invalid(f"must be {what}, got {json_type(value)}.")


def _int(value: object, _: type) -> int:
    if type(value) is not int:
        raise _mismatch("an integer", value)
    return value


def _float(value: object, _: type) -> float:
    if type(value) not in (int, float):
        raise _mismatch("a number", value)
    if not math.isfinite(value):
        raise _Invalid(f"must be a finite number, got {value}.")
    return float(value)


def _bool(value: object, _: type) -> bool:
    if type(value) is not bool:
        raise _mismatch("a boolean", value)
    return value


def _str(value: object, _: type) -> str:
    if type(value) is not str:
        raise _mismatch("a string", value)
    return value


def _object(value: object, _: type) -> dict:
    if type(value) is not dict:
        raise _mismatch("an object", value)
    return value


def _array(value: object) -> list:
    if type(value) is not list:
        raise _mismatch("an array", value)
    return value


class _Absent:
    """The default of a reply field that is left out of the JSON rather than sent as null."""
    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT: Any = _Absent()

converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
converter.register_structure_hook(int, _int)
converter.register_structure_hook(float, _float)
converter.register_structure_hook(bool, _bool)
converter.register_structure_hook(str, _str)
converter.register_structure_hook(dict, _object)
converter.register_structure_hook_func(lambda t: getattr(t, "__origin__", None) is dict, _object)
converter.register_structure_hook(Any, lambda v, _: v)


def _is_optional(t: Any) -> bool:
    return typing.get_origin(t) in (Union, types.UnionType) and type(None) in typing.get_args(t)


def _optional(value: object, t: Any) -> Any:
    if value is None:
        return None
    rest = tuple(a for a in typing.get_args(t) if a is not type(None))
    return converter.structure(value, rest[0] if len(rest) == 1 else Union[rest])


converter.register_structure_hook_func(_is_optional, _optional)


def _hook(t: Any, fn) -> None:
    """A structure hook for exactly type `t` (generic aliases included)."""
    converter.register_structure_hook_func(lambda other: other == t, fn)




class _ItemError(Exception):
    """Element `index` of an array failed with `error`."""

    def __init__(self, index: int, error: BaseException) -> None:
        super().__init__(f"index {index}: {error}")
        self.index = index
        self.error = error


def _structure_list(value: object, t: Any) -> list:
    item = t.__args__[0]
    out = []
    for i, v in enumerate(_array(value)):
        try:
            out.append(converter.structure(v, item))
        except Exception as exc:
            raise _ItemError(i, exc) from None
    return out


converter.register_structure_hook_func(lambda t: getattr(t, "__origin__", None) is list,
                                       _structure_list)


def _one_of(*options: str):
    def check(_, attribute, value) -> None:
        if value is not None and value not in options:
            raise _Invalid(f"must be one of {', '.join(options)}, got {value!r}.",
                           attribute.name)
    return check


def _between(lo: float, hi: float, *, lo_open: bool = False):
    def check(_, attribute, value) -> None:
        if value is None:
            return
        low_ok = value > lo if lo_open else value >= lo
        if not (low_ok and value <= hi):
            bounds = f"in ({lo:g}, {hi:g}]" if lo_open else f"between {lo:g} and {hi:g}"
            raise _Invalid(f"must be {bounds}, got {value:g}.", attribute.name)
    return check


def _at_least(lo: int):
    def check(_, attribute, value) -> None:
        if value is not None and value < lo:
            raise _Invalid(f"must be at least {lo}, got {value}.", attribute.name)
    return check


def _is_token_id(key: str) -> bool:
    """A logit_bias key: a token id written as a decimal string, as OpenAI sends them."""
    return key.isascii() and key.strip().isdigit()


def _opt(validator=None, default=None, **kw):
    return attrs.field(default=default, validator=validator, kw_only=True, **kw)


_INT64 = 2 ** 63


def _seed_range(_, attribute, value) -> None:
    if value is not None and not -_INT64 <= value < _INT64:
        raise _Invalid("must fit in a signed 64-bit integer.", attribute.name)


# -- request pieces ----------------------------------------------------------------------

def _stop(value: object, _: type) -> tuple[str, ...]:
    if type(value) is str:
        value = [value]
    if type(value) is not list or not all(type(s) is str for s in value):
        raise _Invalid("must be a string or an array of strings.")
    if any(s == "" for s in value):
        raise _Invalid("cannot contain an empty string.")
    return tuple(value)


Stop = Union[str, list[str]]
_hook(Stop, _stop)


def _stop_token_ids(value: object, _: type) -> tuple[int, ...]:
    if type(value) is not list or not all(type(i) is int and i >= 0 for i in value):
        raise _Invalid("must be an array of non-negative integers.")
    return tuple(value)


StopTokenIds = tuple[int, ...]
_hook(StopTokenIds, _stop_token_ids)


@attrs.frozen
class ContentPart:
    """One part of a message's content; only text parts are rendered. The media keys are
    kept so that a part carrying one is refused even when it says it is text."""
    type: str
    text: str | None = None
    image_url: Any = None
    input_audio: Any = None
    video_url: Any = None
    audio_url: Any = None
    image: Any = None
    file: Any = None

    MEDIA_KEYS: ClassVar[tuple[str, ...]] = ("image_url", "input_audio", "video_url",
                                              "audio_url", "image", "file")

    @property
    def media_key(self) -> str | None:
        return next((k for k in self.MEDIA_KEYS if getattr(self, k) is not None), None)


def _content(value: object, _: type) -> str | tuple[ContentPart, ...] | None:
    if value is None or type(value) is str:
        return value
    if type(value) is not list:
        raise _mismatch("a string or an array of content parts", value)
    return tuple(_structure_list(value, list[ContentPart]))


Content = Union[str, tuple[ContentPart, ...], None]
_hook(Content, _content)


@attrs.frozen
class ChatMessage:
    role: str
    content: Content = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning: str | None = None            # vLLM's name for an assistant turn's reasoning
    reasoning_content: str | None = None    # the older name


@attrs.frozen
class StreamOptions:
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


@attrs.frozen
class JsonSchemaFormat:
    name: str | None = None
    schema: Any = None             # a JSON schema object (or boolean)
    strict: bool | None = None
    description: str | None = None


@attrs.frozen
class ResponseFormat:
    type: str
    json_schema: JsonSchemaFormat | None = None


@attrs.frozen
class StructuredOutputs:
    """vLLM's `structured_outputs`: exactly one of the constraint fields."""
    json: Any = None               # a JSON schema (object or JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False             # ignored: one backend
    disable_any_whitespace: bool = False       # compact JSON (no free whitespace)
    disable_additional_properties: bool = False  # ignored
    whitespace_pattern: str | None = None      # ignored


@attrs.frozen
class InputItem:
    """A Responses API input item (only messages are rendered)."""
    type: str = "message"
    role: str | None = None
    content: Content = None
    id: str | None = None
    status: str | None = None
    # function_call (an earlier call of the model) and function_call_output (its result)
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: Content = None


@attrs.frozen
class Reasoning:
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


@attrs.frozen
class TextFormat:
    type: str = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


@attrs.frozen
class TextConfig:
    format: TextFormat | None = None
    verbosity: str | None = None


# -- requests ----------------------------------------------------------------------------

@attrs.frozen
class SamplingRequest:
    """The sampling fields every API shares (OpenAI's, then vLLM's extensions).
    None means "not given": generation_config or the sampler's default applies."""
    model: str | None = _opt()
    stream: bool = _opt(default=False)
    temperature: float | None = _opt(_between(0.0, 2.0))
    top_p: float | None = _opt(_between(0.0, 1.0, lo_open=True))
    seed: int | None = _opt(_seed_range)
    user: str | None = _opt()                                   # ignored
    # vLLM's sampling extensions
    top_k: int | None = _opt()
    min_p: float | None = _opt(_between(0.0, 1.0))
    repetition_penalty: float | None = _opt()
    stop_token_ids: StopTokenIds = _opt(default=())
    ignore_eos: bool = _opt(default=False)
    min_tokens: int = _opt(_at_least(0), default=0)
    include_stop_str_in_output: bool = _opt(default=False)
    skip_special_tokens: bool = _opt(default=True)
    spaces_between_special_tokens: bool = _opt(default=True)    # ignored: tokenizers decides
    priority: int = _opt(default=0)                             # ignored: one priority class
    request_id: str | None = _opt()                             # ignored: x-request-id names it
    cache_salt: str | None = _opt()                             # ignored
    _not_implemented: ClassVar[dict[str, Any]] = {}

    @top_k.validator
    def _top_k(self, attribute, value) -> None:
        if value is not None and value < -1:
            raise _Invalid(f"must be -1 or 0 (off) or at least 1, got {value}.", attribute.name)

    @repetition_penalty.validator
    def _repetition(self, attribute, value) -> None:
        if value is not None and value <= 0.0:
            raise _Invalid(f"must be greater than 0, got {value:g}.", attribute.name)


@attrs.frozen
class ChoiceRequest(SamplingRequest):
    """What chat and completions share beyond sampling."""
    stop: Stop | None = _opt()
    n: int = _opt(default=1)
    frequency_penalty: float | None = _opt(_between(-2.0, 2.0))
    presence_penalty: float | None = _opt(_between(-2.0, 2.0))
    stream_options: StreamOptions | None = _opt()
    # logit controls (render resolves them against the vocabulary and the tokenizer)
    logit_bias: dict[str, float] | None = _opt()    # token id (a string) -> bias, clamped to ±100
    allowed_token_ids: list[int] | None = _opt()    # sample only among these
    bad_words: list[str] | None = _opt()            # words never generated
    max_tokens: int | None = _opt(_at_least(0))     # 0: completions echo only
    add_special_tokens: bool | None = _opt()
    metadata: dict[str, Any] | None = _opt()                     # ignored
    service_tier: str | None = _opt()                            # ignored
    store: bool | None = _opt()                                  # ignored: nothing is stored
    truncate_prompt_tokens: int | None = _opt()     # keep this many prompt tokens; -1: max_model_len
    truncation_side: str | None = _opt(_one_of("left", "right"))   # which end truncation cuts
    return_token_ids: bool = _opt(default=False)    # prompt_token_ids and token_ids on replies
    kv_transfer_params: dict[str, Any] | None = _opt()   # chat: prompt_token_ids as the prompt
    prompt_logprobs: int | None = _opt()            # the prompt tokens' logprobs (top k)
    echo: bool = _opt(default=False)                # the reply starts with the prompt (chat:
                                                    # with the final message's text)
    # structured outputs (vLLM's extensions; stages/api/structured.py maps them)
    response_format: ResponseFormat | None = _opt()
    structured_outputs: StructuredOutputs | None = _opt()
    guided_json: Any = _opt()
    guided_regex: str | None = _opt()
    guided_choice: list[str] | None = _opt()
    guided_grammar: str | None = _opt()
    structural_tag: str | None = _opt()
    guided_decoding_backend: str | None = _opt()                 # ignored: xgrammar
    guided_whitespace_pattern: str | None = _opt()               # ignored

    @truncate_prompt_tokens.validator
    def _truncate(self, attribute, value) -> None:
        if value is not None and value < -1:
            raise _Invalid(f"must be -1 (max_model_len) or at least 0, got {value}.",
                           attribute.name)

    @logit_bias.validator
    def _logit_bias(self, attribute, value) -> None:
        for key, bias in (value or {}).items():
            if not _is_token_id(key):
                raise _Invalid(f"keys must be token ids (non-negative integers as strings), "
                               f"got {key!r}.", attribute.name)
            if not (type(bias) is int or (type(bias) is float and math.isfinite(bias))):
                raise _Invalid(f"values must be finite numbers, got {json_type(bias)} for "
                               f"token {key}.", attribute.name)

    @allowed_token_ids.validator
    def _allowed_token_ids(self, attribute, value) -> None:
        if value is not None and not value:
            raise _Invalid("must not be empty.", attribute.name)
        if value and min(value) < 0:
            raise _Invalid("must be non-negative integers.", attribute.name)

    @bad_words.validator
    def _bad_words(self, attribute, value) -> None:
        if value and any(not w.strip() for w in value):
            raise _Invalid("cannot contain an empty or blank string.", attribute.name)


# Fields of vLLM's and OpenAI's schemas this server does not act on yet: a 400 naming the
# field, unless the value is one of the harmless ones listed.
_VLLM_EXTRAS = {"use_beam_search": (False,), "length_penalty": (1.0, 1),
                "logits_processors": (), "return_tokens_as_token_ids": (False,),
                "vllm_xargs": (),
                "mm_processor_kwargs": (), "prompt_embeds": (),
                "thinking_token_budget": ()}
# What SGLang's router and vllm-router (derived from it) add to every request they forward,
# with their defaults (docs/scaling.md): accepted at those values, a 400 at any other.
_ROUTER_EXTRAS = {"no_stop_trim": (False,), "return_hidden_states": (False,)}
_ROUTER_CHAT_EXTRAS = {**_ROUTER_EXTRAS, "separate_reasoning": (True,),
                       "stream_reasoning": (True,)}


@attrs.frozen
class ChatCompletionRequest(ChoiceRequest):
    messages: list[ChatMessage] = _opt()
    max_completion_tokens: int | None = _opt(_at_least(1))
    logprobs: bool = _opt(default=False)
    top_logprobs: int | None = _opt()
    tools: list[dict[str, Any]] | None = _opt()
    tool_choice: Any = _opt()
    parallel_tool_calls: bool | None = _opt()
    modalities: list[str] | None = _opt()
    reasoning_effort: str | None = _opt()
    include_reasoning: bool = _opt(default=True)
    add_generation_prompt: bool = _opt(default=True)
    continue_final_message: bool = _opt(default=False)
    chat_template: str | None = _opt()
    chat_template_kwargs: dict[str, Any] | None = _opt()
    prompt_cache_key: str | None = _opt()                        # ignored
    safety_identifier: str | None = _opt()                       # ignored
    verbosity: str | None = _opt()                               # ignored
    _not_implemented: ClassVar[dict[str, Any]] = {
        **_VLLM_EXTRAS, **_ROUTER_CHAT_EXTRAS, "functions": (), "function_call": (),
        "audio": (), "prediction": (), "web_search_options": (), "documents": (),
        "best_of": (1,), "media_io_kwargs": ()}

    @messages.validator
    def _messages(self, attribute, value) -> None:
        if value is None:
            raise _Invalid("is required.", attribute.name)
        if not value:
            raise _Invalid("must contain at least one message.", attribute.name)


@attrs.frozen
class CompletionRequest(ChoiceRequest):
    prompt: Any = _opt()           # a string, token ids, or several of either
    logprobs: int | None = _opt()
    suffix: str | None = _opt()
    best_of: int | None = _opt()
    _not_implemented: ClassVar[dict[str, Any]] = {**_VLLM_EXTRAS, **_ROUTER_EXTRAS}

    @prompt.validator
    def _prompt(self, attribute, value) -> None:
        if value is None:
            raise _Invalid("is required.", attribute.name)


@attrs.frozen
class ResponsesRequest(SamplingRequest):
    input: Union[str, list[InputItem]] = _opt()
    instructions: str | None = _opt()
    max_output_tokens: int | None = _opt(_at_least(1))
    metadata: dict[str, Any] | None = _opt()                     # echoed back
    parallel_tool_calls: bool = _opt(default=True)
    tools: list[dict[str, Any]] | None = _opt()
    tool_choice: Any = _opt()
    text: TextConfig | None = _opt()
    reasoning: Reasoning | None = _opt()
    truncation: str = _opt(default="disabled")
    include: list[str] | None = _opt()
    top_logprobs: int | None = _opt()
    store: bool | None = _opt()                                  # ignored: nothing is stored
    service_tier: str | None = _opt()                            # ignored
    prompt_cache_key: str | None = _opt()                        # ignored
    safety_identifier: str | None = _opt()                       # ignored
    stream_options: dict[str, Any] | None = _opt()               # ignored
    max_tool_calls: int | None = _opt()                          # ignored: no tools
    chat_template_kwargs: dict[str, Any] | None = _opt()
    # vLLM accepts these on the Responses API as well
    stop: Stop | None = _opt()
    frequency_penalty: float | None = _opt(_between(-2.0, 2.0))
    presence_penalty: float | None = _opt(_between(-2.0, 2.0))
    _not_implemented: ClassVar[dict[str, Any]] = {
        "previous_response_id": (), "conversation": (), "prompt": (), "background": (False,),
        "mm_processor_kwargs": (), "enable_response_messages": (False,),
        "previous_input_messages": ()}

    @input.validator
    def _input(self, attribute, value) -> None:
        if value is None:
            raise _Invalid("is required.", attribute.name)
        if isinstance(value, list) and not value:
            raise _Invalid("must contain at least one item.", attribute.name)


def _input(value: object, _: type) -> str | list[InputItem]:
    if type(value) is str:
        return value
    if type(value) is not list:
        raise _mismatch("a string or an array of input items", value)
    return _structure_list(value, list[InputItem])


_hook(Union[str, list[InputItem]], _input)

# Structured pieces tolerate keys they do not know (message fields, content parts of other
# types, tool call shapes): what they hold is checked where it is used.
def _tolerant(cls: type):
    fn = make_dict_structure_fn(cls, converter, _cattrs_forbid_extra_keys=False,
                                _cattrs_detailed_validation=True)
    return lambda value, t: fn(_object(value, t), t)


for _cls in (ContentPart, ChatMessage, InputItem, StreamOptions, ResponseFormat, Reasoning,
             TextFormat, TextConfig, JsonSchemaFormat, StructuredOutputs):
    converter.register_structure_hook(_cls, _tolerant(_cls))

@attrs.frozen
class TokenizeRequest:
    """POST /tokenize, as vLLM serves it: a completion-style `prompt`, or chat `messages`."""
    model: str | None = _opt()
    prompt: str | None = _opt()
    messages: list[ChatMessage] | None = _opt()
    add_special_tokens: bool | None = _opt()    # default: true for a prompt, false for messages
    add_generation_prompt: bool = _opt(default=True)
    continue_final_message: bool = _opt(default=False)
    chat_template: str | None = _opt()
    chat_template_kwargs: dict[str, Any] | None = _opt()
    tools: list[dict[str, Any]] | None = _opt()
    return_token_strs: bool = _opt(default=False)
    _not_implemented: ClassVar[dict[str, Any]] = {"mm_processor_kwargs": (), "media_io_kwargs": ()}


@attrs.frozen
class DetokenizeRequest:
    model: str | None = _opt()
    tokens: list[int] = _opt()
    _not_implemented: ClassVar[dict[str, Any]] = {}

    @tokens.validator
    def _tokens(self, attribute, value) -> None:
        if value is None:
            raise _Invalid("is required.", attribute.name)
        if any(t < 0 for t in value):
            raise _Invalid("must be non-negative integers.", attribute.name)


@attrs.frozen(kw_only=True)
class TokenizeResponse:
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


@attrs.frozen(kw_only=True)
class DetokenizeResponse:
    prompt: str


@attrs.frozen
class ToolSettings:
    """The server's tool flags, as render hands them to the API modules."""
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False


@attrs.frozen
class ToolPlan:
    """How the parse stage finds a request's tool calls."""
    kind: str                    # "auto": the server's parser | "named" | "required"
    parser: str | None = None    # auto: the --tool-call-parser name
    name: str | None = None      # named: the function
    parallel: bool = True        # parallel_tool_calls: false keeps the first call only



@attrs.frozen(kw_only=True)
class PromptPlan:
    """What an API's request asks render to do: which prompt, and the API's own rules
    for max_tokens. render applies the template, tokenises and resolves the limits."""
    messages: list[dict] | None = None       # through the chat template
    add_generation_prompt: bool = True
    continue_final_message: bool = False     # the prompt ends inside the last message
    chat_template: str | None = None         # the request's own template (else the server's)
    template_kwargs: dict = attrs.field(factory=dict)
    text: str | None = None                  # a plain-text prompt
    token_ids: tuple[int, ...] | None = None  # a prompt of token ids (wins over the others)
    token_ids_param: str | None = None       # where they came from, when not prompt_param
    add_special_tokens: bool = False
    prompt_param: str                        # where the prompt came from, for errors
    max_tokens: int | None                   # requested; None: the API's default
    max_tokens_param: str
    default_max_tokens: int | None = None    # None: whatever the context leaves
    truncate: int | None = None              # keep this many prompt tokens (-1: max_model_len)
    truncation_side: str = "left"            # "left" keeps the end of the prompt
    logprobs: int | None = None              # alternatives per token; None: off
    stream: bool = False
    include_usage: bool = True
    continuous_usage: bool = False           # stream: usage so far on every chunk
    constraint: Constraint | None = None     # structured output (stages/api/structured.py)
    tools: ToolPlan | None = None            # how parse finds tool calls (stages/api/tools.py)
    batch: tuple[str | tuple[int, ...], ...] | None = None  # completions: several prompts
    echo: str | None = None                  # chat echo: the text the reply starts with
    echo_prompt: bool = False                # completions echo: each prompt starts its choices
    prompt_logprobs: int | None = None       # logprobs of the prompt tokens (top k); None: off


R = TypeVar("R")


def parse_request(body: object, cls: type[R]) -> R:
    """Structure a JSON body into `cls`, or raise the RequestError for its first problem."""
    if type(body) is not dict:
        raise RequestError("The request body must be a JSON object.")
    # OpenAI treats null as absent; so do we, at the top level (nested types are Optional).
    body = {k: v for k, v in body.items() if v is not None}
    names = {a.alias for a in attrs.fields(cls)}
    for key, value in body.items():
        if key in names:
            continue
        harmless = cls._not_implemented.get(key)
        if harmless is None:
            raise RequestError(f"Unrecognized request argument supplied: {key}", param=key)
        if value not in harmless:
            raise RequestError(f"'{key}' is not supported by this server yet.", param=key)
    body = {k: v for k, v in body.items() if k in names}
    try:
        return converter.structure(body, cls)
    except Exception as exc:
        raise _request_error(exc) from None


def _request_error(exc: BaseException, path: str = "") -> RequestError:
    """The first leaf of cattrs' error tree, with its JSON path."""
    if isinstance(exc, _ItemError):
        return _request_error(exc.error, f"{path}[{exc.index}]")
    if isinstance(exc, (ClassValidationError, IterableValidationError)):
        with_notes, without = exc.group_exceptions()
        for sub, note in with_notes:
            name = getattr(note, "name", None)
            if name is None:
                return _request_error(sub, f"{path}[{getattr(note, 'index', 0)}]")
            return _request_error(sub, f"{path}.{name}" if path else name)
        if without:
            return _request_error(without[0], path)
    if isinstance(exc, ForbiddenExtraKeysError):
        key = sorted(exc.extra_fields)[0]
        where = f"{path}.{key}" if path else key
        return RequestError(f"Unrecognized request argument supplied: {where}", param=where)
    if isinstance(exc, _Invalid):
        if exc.field is not None:
            path = f"{path}.{exc.field}" if path else exc.field
        return RequestError(f"'{path}' {exc.what}", param=path or None)
    if isinstance(exc, KeyError):  # a required nested field is missing
        return RequestError(f"'{path}' is required.", param=path or None)
    return RequestError(f"'{path}' is invalid: {exc}", param=path or None)


# -- replies -----------------------------------------------------------------------------

def omit_absent(cls: type) -> type:
    """Register `cls` so that its fields defaulting to ABSENT are left out when unset."""
    overrides = {a.name: override(omit_if_default=True) for a in attrs.fields(cls)
                 if a.default is ABSENT}
    converter.register_unstructure_hook(cls, make_dict_unstructure_fn(cls, converter, **overrides))
    return cls


@attrs.frozen
class PromptTokensDetails:
    cached_tokens: int = 0


@attrs.frozen
class CompletionTokensDetails:
    reasoning_tokens: int = 0


@attrs.frozen
class UsageInfo:
    """The chat/completions usage object (OpenAI's names, vLLM's details)."""
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails


@attrs.frozen
class InputTokensDetails:
    cached_tokens: int = 0


@attrs.frozen
class OutputTokensDetails:
    reasoning_tokens: int = 0


@attrs.frozen
class ResponseUsage:
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int




# Reply classes are keyword-only so that their fields can follow OpenAI's key order.
reply = attrs.frozen(kw_only=True)


@reply
class TopLogprob:
    token: str
    logprob: float
    bytes: list[int]


@reply
class ChatTokenLogprob:
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


@reply
class ChatLogprobs:
    content: list[ChatTokenLogprob]


@reply
class CompletionLogprobs:
    """The legacy completions shape: parallel lists, alternatives as {token: logprob}."""
    tokens: list[str]
    token_logprobs: list[float | None]          # echo: null for the prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


@omit_absent
@reply
class FunctionChunk:
    name: str = ABSENT
    arguments: str = ABSENT


@omit_absent
@reply
class ToolCallChunk:
    """A streamed tool call: the first chunk has index, id, type and name; later ones
    carry the index and argument text."""
    index: int
    id: str = ABSENT
    type: str = ABSENT
    function: FunctionChunk


@reply
class FunctionCall:
    name: str
    arguments: str            # a JSON string


@reply
class ToolCallOut:
    id: str
    type: str = "function"
    function: FunctionCall


@omit_absent
@reply
class ChatDelta:
    role: str = ABSENT
    content: str = ABSENT
    reasoning: str = ABSENT
    tool_calls: list[ToolCallChunk] = ABSENT


@omit_absent
@reply
class ChatChunkChoice:
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = ABSENT      # on the final chunk only
    token_ids: list[int] = ABSENT               # return_token_ids: this chunk's tokens


@omit_absent
@reply
class ChatCompletionChunk:
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = ABSENT            # with include_usage: null but on the last chunk
    prompt_token_ids: list[int] = ABSENT        # return_token_ids: on the first chunk
    metrics: Any = ABSENT                       # per-request metrics: on the usage chunk


@omit_absent
@reply
class ChatMessageOut:
    role: str = "assistant"
    content: str | None
    refusal: str | None = None
    reasoning: str = ABSENT
    tool_calls: list[ToolCallOut] = ABSENT


@omit_absent
@reply
class ChatChoice:
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str
    stop_reason: str | int | None = None
    token_ids: list[int] = ABSENT               # return_token_ids


@omit_absent
@reply
class ChatCompletion:
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[Any] = ABSENT         # prompt_logprobs (vLLM's shape)
    prompt_token_ids: list[int] = ABSENT        # return_token_ids
    metrics: Any = ABSENT                       # --enable-per-request-metrics


@omit_absent
@reply
class CompletionChoice:
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = ABSENT      # streaming: on the final chunk only
    prompt_logprobs: list[Any] = ABSENT         # prompt_logprobs (vLLM's shape)
    prompt_token_ids: list[int] = ABSENT        # return_token_ids (streaming: first chunk)
    token_ids: list[int] = ABSENT               # return_token_ids


@omit_absent
@reply
class Completion:
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = ABSENT
    metrics: Any = ABSENT                       # --enable-per-request-metrics


# -- Responses API replies ----------------------------------------------------------------

@reply
class OutputText:
    type: str = "output_text"
    text: str
    annotations: list[Any] = attrs.field(factory=list)
    logprobs: list[Any] = attrs.field(factory=list)


@reply
class ReasoningText:
    type: str = "reasoning_text"
    text: str


@reply
class MessageItem:
    id: str
    type: str = "message"
    status: str
    role: str = "assistant"
    content: list[OutputText]


@reply
class ReasoningItem:
    id: str
    type: str = "reasoning"
    summary: list[Any] = attrs.field(factory=list)
    content: list[ReasoningText]
    status: str


@reply
class FunctionCallItem:
    arguments: str
    call_id: str
    name: str
    type: str = "function_call"
    id: str
    status: str


@reply
class ResponseError:
    code: str = "server_error"
    message: str


@reply
class IncompleteDetails:
    reason: str


@reply
class TextFormatOut:
    type: str = "text"


@reply
class TextOut:
    format: TextFormatOut = TextFormatOut()


@reply
class ReasoningOut:
    effort: str | None = None
    summary: str | None = None


@reply
class Response:
    id: str
    object: str = "response"
    created_at: int
    status: str                      # in_progress | completed | incomplete | failed
    background: bool = False
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    model: str
    output: list[MessageItem | ReasoningItem | FunctionCallItem]
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningOut = ReasoningOut()
    store: bool = False              # nothing is ever stored
    temperature: float = 1.0
    text: TextOut = TextOut()
    tool_choice: Any = "auto"
    tools: list[Any] = attrs.field(factory=list)
    top_p: float = 1.0
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, Any] = attrs.field(factory=dict)


_unstructure_hooks: dict[type, Callable[[Any], Any]] = {}


def unstructure(obj: Any) -> Any:
    """converter.unstructure, without its per-call dispatch (every streamed chunk is one)."""
    cls = type(obj)
    hook = _unstructure_hooks.get(cls)
    if hook is None:
        hook = _unstructure_hooks[cls] = converter.get_unstructure_hook(cls)
    return hook(obj)
