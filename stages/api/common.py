"""The protocol's machinery, what every API shares: errors, the strict converter and its
validators, `parse_request`, the plan an API hands render (`PromptPlan`, with its tool
settings, one constraint rule and usage rule of a stream) and the helpers of reply classes.
The request pieces and fields the APIs share are stages/api/request_types.py.

Requests are attrs classes structured from the JSON body by `parse_request`, which
keeps OpenAI's strictness (`true` is not an integer, NaN is not a number, null counts
as absent) and turns the first problem into a `RequestError` whose `param` is the JSON
path (`messages[1].content`).

A top-level field is handled in one of three ways:
- a typed attribute: implemented (or accepted and ignored when it means nothing here:
  `user`, `metadata`, `service_tier`, ...), with strict checks of its value;
- listed in the class's `_not_implemented` (a field vLLM acts on and this server cannot
  yet, such as `logits_processors`): a 400 that names the field, when it is present with a
  value other than its harmless default;
- anything else is ignored, as vLLM, SGLang and llama.cpp ignore it: new clients (coding
  agents) send fields no server knows yet. Each field name is logged once per API, at
  warning level (`ignored_field`).

Replies are attrs classes too, unstructured by the same converter. A field defaulting to
`ABSENT` is left out of the JSON (OpenAI omits some keys rather than sending null).
"""
from __future__ import annotations

import logging
import math
import types
import typing
from typing import TYPE_CHECKING, Any, Callable, TypeVar, Union

import attrs
import cattrs
from cattrs.errors import (AttributeValidationNote, ClassValidationError,
                           ForbiddenExtraKeysError, IterableValidationError,
                           IterableValidationNote)
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

from gpu.interface import Constraint
from stages.messages import ReplySpec, ToolPlan

if TYPE_CHECKING:
    from stages.api.request_types import StreamOptions



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

class Invalid(Exception):
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


def mismatch(what: str, value: object) -> Invalid:
    return Invalid(f"must be {what}, got {json_type(value)}.")


def _int(value: object, _: type) -> int:
    if type(value) is not int:
        raise mismatch("an integer", value)
    return value


def _float(value: object, _: type) -> float:
    if type(value) not in (int, float):
        raise mismatch("a number", value)
    if not math.isfinite(value):
        raise Invalid(f"must be a finite number, got {value}.")
    return float(value)


def _bool(value: object, _: type) -> bool:
    if type(value) is not bool:
        raise mismatch("a boolean", value)
    return value


def _str(value: object, _: type) -> str:
    if type(value) is not str:
        raise mismatch("a string", value)
    return value


def _object(value: object, _: type) -> dict:
    if type(value) is not dict:
        raise mismatch("an object", value)
    return value


def _array(value: object) -> list:
    if type(value) is not list:
        raise mismatch("an array", value)
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
converter.register_structure_hook_func(lambda t: typing.get_origin(t) is dict, _object)
converter.register_structure_hook(Any, lambda v, _: v)


def _is_optional(t: Any) -> bool:
    return typing.get_origin(t) in (Union, types.UnionType) and type(None) in typing.get_args(t)


def _optional(value: object, t: Any) -> Any:
    if value is None:
        return None
    rest = tuple(a for a in typing.get_args(t) if a is not type(None))
    return converter.structure(value, rest[0] if len(rest) == 1 else Union[rest])


converter.register_structure_hook_func(_is_optional, _optional)


def structure_hook(t: Any, fn) -> None:
    """A structure hook for exactly type `t` (generic aliases included)."""
    converter.register_structure_hook_func(lambda other: other == t, fn)


class _ItemError(Exception):
    """Element `index` of an array failed with `error`."""

    def __init__(self, index: int, error: BaseException) -> None:
        super().__init__(f"index {index}: {error}")
        self.index = index
        self.error = error


def structure_list(value: object, t: Any) -> list:
    item = t.__args__[0]
    out = []
    for i, v in enumerate(_array(value)):
        try:
            out.append(converter.structure(v, item))
        except Exception as exc:
            raise _ItemError(i, exc) from None
    return out


converter.register_structure_hook_func(lambda t: typing.get_origin(t) is list,
                                       structure_list)


def one_of(*options: str):
    def check(_, attribute, value) -> None:
        if value is not None and value not in options:
            raise Invalid(f"must be one of {', '.join(options)}, got {value!r}.",
                           attribute.name)
    return check


def between(lo: float, hi: float, *, lo_open: bool = False):
    def check(_, attribute, value) -> None:
        if value is None:
            return
        low_ok = value > lo if lo_open else value >= lo
        if not (low_ok and value <= hi):
            bounds = f"in ({lo:g}, {hi:g}]" if lo_open else f"between {lo:g} and {hi:g}"
            raise Invalid(f"must be {bounds}, got {value:g}.", attribute.name)
    return check


def at_least(lo: int):
    def check(_, attribute, value) -> None:
        if value is not None and value < lo:
            raise Invalid(f"must be at least {lo}, got {value}.", attribute.name)
    return check


def is_token_id(key: str) -> bool:
    """A logit_bias key: a token id written as a decimal string, as OpenAI sends them."""
    return key.isascii() and key.strip().isdigit()


def opt(validator=None, default=None, **kw):
    return attrs.field(default=default, validator=validator, kw_only=True, **kw)


_INT64 = 2 ** 63


def seed_range(_, attribute, value) -> None:
    """An integer in int64's range. The JSON parser gives an integer beyond 64 bits as a
    float: a whole one out of range gets the range message too, not a type error."""
    if value is None:
        return
    # (-2**63 - 1 parses to the float -2**63: any whole float that large is out of range)
    if ((type(value) is int and not -_INT64 <= value < _INT64)
            or (type(value) is float and value.is_integer() and abs(value) >= _INT64)):
        raise Invalid("must fit in a signed 64-bit integer.", attribute.name)
    if type(value) is not int:
        exc = mismatch("an integer", value)
        exc.field = attribute.name
        raise exc


# Structured pieces tolerate keys they do not know (message fields, content parts of other
# types, tool call shapes): what they hold is checked where it is used.
def tolerant(cls: type):
    fn = make_dict_structure_fn(cls, converter, _cattrs_forbid_extra_keys=False,
                                _cattrs_detailed_validation=True)
    return lambda value, t: fn(_object(value, t), t)


# -- the plan an API hands render --------------------------------------------------------

def usage_flags(stream: bool, options: StreamOptions | None, *,
                force: bool = False) -> tuple[bool, bool]:
    """(include_usage, continuous_usage) of a reply. Not streamed: the usage is always in
    the reply. A stream: a final usage chunk with stream_options.include_usage, the usage
    so far on every chunk with continuous_usage_stats as well; --enable-force-include-usage
    (`force`) turns both on for every stream."""
    if not stream:
        return True, False
    include = force or bool(options and options.include_usage)
    # as vLLM: continuous_usage_stats only adds to include_usage, never turns it on
    return include, force or (include and bool(options and options.continuous_usage_stats))


@attrs.frozen
class ToolSettings:
    """The server's tool flags, as render hands them to the API modules."""
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False


def one_constraint(structured: Constraint | None, tools: Constraint | None,
                   structured_param: str) -> Constraint | None:
    """The request's output constraint: its structured output's (`structured_param` names
    that in the API), or its tool choice's ("required" or a named function), never both."""
    if tools is None:
        return structured
    if structured is not None:
        raise RequestError("tool_choice \"required\" or a named function cannot be "
                           f"combined with {structured_param}.", param="tool_choice")
    return tools


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
    logprobs: int | None = None              # alternatives per token (-1: all); None: off
    logprobs_param: str = "logprobs"         # the field that asked (for the --max-logprobs 400)
    # logprob_token_ids: these ids' logprobs at every generated position, in place of the
    # top alternatives (logprobs is then 0)
    logprob_token_ids: tuple[int, ...] = ()
    stream: bool = False
    stream_options: StreamOptions | None = None   # what a stream reports of usage (usage_flags)
    constraint: Constraint | None = None     # structured output (stages/api/structured.py)
    tools: ToolPlan | None = None            # how parse finds tool calls (stages/api/tools.py)
    batch: tuple[str | tuple[int, ...], ...] | None = None  # completions: several prompts
    echo: str | None = None                  # chat echo: the text the reply starts with
    echo_prompt: bool = False                # completions echo: each prompt starts its choices
    prompt_logprobs: int | None = None       # the prompt's logprobs (top k, -1: all); None: off
    reply: ReplySpec = ReplySpec()           # what the reply shows and echoes (the API's reply_spec)
    mm_processor_kwargs: dict | None = None  # image processor options (stages/media/prompt.py)


R = TypeVar("R")

_log = logging.getLogger("tailrace.api")
_logged: set[tuple[str, str]] = set()


def ignored_field(api: str, name: str, what: str = "is not a field this server knows") -> None:
    """Log, once per API and field name, that a request's `name` was ignored (why: `what`).
    Once only: an agent sends the same fields on every request."""
    if (api, name) in _logged:
        return
    _logged.add((api, name))
    _log.warning("%s: '%s' %s; ignored (logged once).", api, name, what)


def parse_request(body: object, cls: type[R], api: str | None = None) -> R:
    """Structure a JSON body into `cls`, or raise the RequestError for its first problem.
    A field `cls` does not know is ignored and logged (`ignored_field`, naming `api`)."""
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
            ignored_field(api or cls.__name__, key)
        elif value not in harmless:
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
            if isinstance(note, AttributeValidationNote):
                return _request_error(sub, f"{path}.{note.name}" if path else note.name)
            index = note.index if isinstance(note, IterableValidationNote) else 0
            return _request_error(sub, f"{path}[{index}]")
        if without:
            return _request_error(without[0], path)
    if isinstance(exc, ForbiddenExtraKeysError):
        key = sorted(exc.extra_fields)[0]
        where = f"{path}.{key}" if path else key
        return RequestError(f"Unrecognized request argument supplied: {where}", param=where)
    if isinstance(exc, Invalid):
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


# Reply classes are keyword-only so that their fields can follow OpenAI's key order.
reply = attrs.frozen(kw_only=True)


_unstructure_hooks: dict[type, Callable[[Any], Any]] = {}


def unstructure(obj: Any) -> Any:
    """converter.unstructure, without its per-call dispatch (every streamed chunk is one)."""
    cls = type(obj)
    hook = _unstructure_hooks.get(cls)
    if hook is None:
        hook = _unstructure_hooks[cls] = converter.get_unstructure_hook(cls)
    return hook(obj)
