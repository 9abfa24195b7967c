"""The request pieces and fields the APIs share: stop strings, content parts, chat
messages, stream options, the structured-output formats, the sampling fields of every API
(`SamplingRequest`) and what chat and completions share beyond them (`ChoiceRequest`),
and the fields of vLLM's and the routers' schemas this server does not act on.

They are structured by stages/api/common.py's strict converter (see there for the rules).
"""
from __future__ import annotations

import math
from typing import Any, ClassVar, Union

import attrs

from stages.api.common import (Invalid, at_least, between, converter, is_token_id, json_type,
                               mismatch, one_of, opt, seed_range, structure_hook,
                               structure_list, tolerant)


# -- request pieces ----------------------------------------------------------------------

def _stop(value: object, _: type) -> tuple[str, ...]:
    if type(value) is str:
        value = [value]
    if type(value) is not list or not all(type(s) is str for s in value):
        raise Invalid("must be a string or an array of strings.")
    if any(s == "" for s in value):
        raise Invalid("cannot contain an empty string.")
    return tuple(value)


Stop = Union[str, list[str]]
structure_hook(Stop, _stop)


def _stop_token_ids(value: object, _: type) -> tuple[int, ...]:
    if type(value) is not list or not all(type(i) is int and i >= 0 for i in value):
        raise Invalid("must be an array of non-negative integers.")
    return tuple(value)


StopTokenIds = tuple[int, ...]
structure_hook(StopTokenIds, _stop_token_ids)


@attrs.frozen
class ContentPart:
    """One part of a message's content; only text parts are rendered. The media keys are
    kept so that a part carrying one is refused even when it says it is text."""
    type: str | None = None       # None: vLLM's shorthand {"image_url": "..."}
    text: str | None = None
    refusal: str | None = None    # a "refusal" part's text (an assistant turn OpenAI's SDK replays)
    thinking: str | None = None   # a "thinking" part's text (vLLM's: the turn's reasoning)
    image_url: Any = None
    input_audio: Any = None
    video_url: Any = None
    audio_url: Any = None
    image: Any = None
    file: Any = None
    detail: str | None = None     # an image's detail (auto/low/high): every picture is seen whole
    uuid: Any = None              # vLLM's: a media item's id; with one, any part is its media

    MEDIA_KEYS: ClassVar[tuple[str, ...]] = ("image_url", "input_audio", "video_url",
                                              "audio_url", "image", "file")

    @property
    def media_key(self) -> str | None:
        values = (self.image_url, self.input_audio, self.video_url, self.audio_url, self.image,
                  self.file)   # in MEDIA_KEYS' order
        return next((k for k, v in zip(self.MEDIA_KEYS, values) if v is not None), None)


class PartsText(str):
    """Text parts joined with a newline, as templates see them, remembering the parts
    (`parts`), for formats that join them otherwise (Harmony's tool results)."""
    parts: tuple[str, ...] = ()

    @classmethod
    def of(cls, texts: list[str]) -> str:
        joined = cls("\n".join(texts))
        joined.parts = tuple(texts)
        return joined


def _content(value: object, _: type) -> str | tuple[ContentPart, ...] | None:
    if value is None or type(value) is str:
        return value
    if type(value) is not list:
        raise mismatch("a string or an array of content parts", value)
    return tuple(structure_list(value, list[ContentPart]))


Content = Union[str, tuple[ContentPart, ...], None]
structure_hook(Content, _content)


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


for _cls in (ContentPart, ChatMessage, StreamOptions, ResponseFormat, JsonSchemaFormat,
             StructuredOutputs):
    converter.register_structure_hook(_cls, tolerant(_cls))


# -- requests ----------------------------------------------------------------------------

@attrs.frozen
class SamplingRequest:
    """The sampling fields every API shares (OpenAI's, then vLLM's extensions).
    None means "not given": generation_config or the sampler's default applies."""
    model: str | None = opt()
    stream: bool = opt(default=False)
    temperature: float | None = opt(between(0.0, 2.0))
    top_p: float | None = opt(between(0.0, 1.0, lo_open=True))
    seed: Any = opt(seed_range)                # int | None, checked by seed_range
    user: str | None = opt()                                   # ignored
    # vLLM's sampling extensions
    top_k: int | None = opt()
    min_p: float | None = opt(between(0.0, 1.0))
    repetition_penalty: float | None = opt()
    stop_token_ids: StopTokenIds = opt(default=())
    ignore_eos: bool = opt(default=False)
    min_tokens: int = opt(at_least(0), default=0)
    include_stop_str_in_output: bool = opt(default=False)
    skip_special_tokens: bool = opt(default=True)
    spaces_between_special_tokens: bool = opt(default=True)    # ignored: tokenizers decides
    priority: int = opt(default=0)   # --scheduling-policy priority: lower first; else 0 only
    request_id: str | None = opt()                             # ignored: x-request-id names it
    cache_salt: str | None = opt()   # prefix-cache blocks are shared only with the same salt
    # most reasoning tokens (a <think> reasoning parser): then </think> is forced (issue 37)
    thinking_token_budget: int | None = opt()
    _not_implemented: ClassVar[dict[str, Any]] = {}

    @thinking_token_budget.validator
    def _thinking_budget(self, attribute, value) -> None:
        if value is not None and value < -1:
            raise Invalid(f"must be -1 (no limit) or at least 0, got {value}.", attribute.name)

    @top_k.validator
    def _top_k(self, attribute, value) -> None:
        if value is not None and value < -1:
            raise Invalid(f"must be -1 or 0 (off) or at least 1, got {value}.", attribute.name)

    @repetition_penalty.validator
    def _repetition(self, attribute, value) -> None:
        if value is not None and value <= 0.0:
            raise Invalid(f"must be greater than 0, got {value:g}.", attribute.name)


@attrs.frozen
class ChoiceRequest(SamplingRequest):
    """What chat and completions share beyond sampling."""
    stop: Stop | None = opt()
    n: int = opt(default=1)
    frequency_penalty: float | None = opt(between(-2.0, 2.0))
    presence_penalty: float | None = opt(between(-2.0, 2.0))
    stream_options: StreamOptions | None = opt()
    # logit controls (render resolves them against the vocabulary and the tokenizer)
    logit_bias: dict[str, float] | None = opt()    # token id (a string) -> bias, clamped to ±100
    allowed_token_ids: list[int] | None = opt()    # sample only among these
    bad_words: list[str] | None = opt()            # words never generated
    max_tokens: int | None = opt(at_least(0))     # 0: completions echo only
    add_special_tokens: bool | None = opt()
    metadata: dict[str, Any] | None = opt()                     # ignored
    service_tier: str | None = opt()                            # ignored
    store: bool | None = opt()                                  # ignored: nothing is stored
    truncate_prompt_tokens: int | None = opt()     # keep this many prompt tokens; -1: max_model_len
    truncation_side: str | None = opt(one_of("left", "right"))   # which end truncation cuts
    return_token_ids: bool = opt(default=False)    # prompt_token_ids and token_ids on replies
    return_tokens_as_token_ids: bool = opt(default=False)   # logprobs name tokens token_id:N
    kv_transfer_params: dict[str, Any] | None = opt()   # chat: prompt_token_ids as the prompt
    prompt_logprobs: int | None = opt()            # the prompt tokens' logprobs (top k)
    logprob_token_ids: list[int] | None = opt()    # these ids' logprobs at every position
    # beam search (vLLM's): n beams, ranked by cumulative logprob / length ** length_penalty
    use_beam_search: bool = opt(default=False)
    length_penalty: float = opt(default=1.0)
    echo: bool = opt(default=False)                # the reply starts with the prompt (chat:
                                                    # with the final message's text)
    # structured outputs (vLLM's extensions; stages/api/structured.py maps them)
    response_format: ResponseFormat | None = opt()
    structured_outputs: StructuredOutputs | None = opt()
    guided_json: Any = opt()
    guided_regex: str | None = opt()
    guided_choice: list[str] | None = opt()
    guided_grammar: str | None = opt()
    structural_tag: str | None = opt()
    guided_decoding_backend: str | None = opt()                 # ignored: xgrammar
    guided_whitespace_pattern: str | None = opt()               # ignored

    @truncate_prompt_tokens.validator
    def _truncate(self, attribute, value) -> None:
        if value is not None and value < -1:
            raise Invalid(f"must be -1 (max_model_len) or at least 0, got {value}.",
                           attribute.name)

    @logit_bias.validator
    def _logit_bias(self, attribute, value) -> None:
        for key, bias in (value or {}).items():
            if not is_token_id(key):
                raise Invalid(f"keys must be token ids (non-negative integers as strings), "
                               f"got {key!r}.", attribute.name)
            if not (type(bias) is int or (type(bias) is float and math.isfinite(bias))):
                raise Invalid(f"values must be finite numbers, got {json_type(bias)} for "
                               f"token {key}.", attribute.name)

    @allowed_token_ids.validator
    def _allowed_token_ids(self, attribute, value) -> None:
        if value is not None and not value:
            raise Invalid("must not be empty.", attribute.name)
        if value and min(value) < 0:
            raise Invalid("must be non-negative integers.", attribute.name)

    @bad_words.validator
    def _bad_words(self, attribute, value) -> None:
        if value and any(not w.strip() for w in value):
            raise Invalid("cannot contain an empty or blank string.", attribute.name)


# Fields of vLLM's and OpenAI's schemas this server does not act on yet: a 400 naming the
# field, unless the value is one of the harmless ones listed.
VLLM_EXTRAS = {"logits_processors": (),
                "vllm_xargs": (),
                "mm_processor_kwargs": (), "prompt_embeds": ()}
# What SGLang's router and vllm-router (derived from it) add to every request they forward,
# with their defaults (docs/scaling.md): accepted at those values, a 400 at any other.
ROUTER_EXTRAS = {"no_stop_trim": (False,), "return_hidden_states": (False,)}
