"""render: HTTP request body -> RenderedRequest (token ids + sampling params).

Owns the chat template, tokenisation, validation and max_tokens defaults. A bad
request raises RequestError here, before any HTTP response has started.
"""
from __future__ import annotations

import math
import time
from typing import Any

import attrs
import jinja2

from gpu.sampler import SamplingOptions


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
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


@attrs.frozen
class Submission:
    """What web hands to render: the raw JSON body of one API call."""
    request_id: str
    api: str                      # "chat" | "completions" | "responses"
    body: dict
    arrival: float                # time.monotonic() at the HTTP layer


@attrs.frozen
class SamplingParams:
    """What one request asks of generation: the sampler's options plus what the
    scheduler and detokenize need (max_tokens, EOS, stop strings)."""
    max_tokens: int
    options: SamplingOptions = SamplingOptions()   # the sampler's part, passed to the GPU as is
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


@attrs.frozen
class RenderedRequest:
    request_id: str
    api: str                      # "chat" | "completions" | "responses"
    model: str                    # the served model name echoed back
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    stream: bool
    include_usage: bool           # stream_options.include_usage (always usage when not streaming)
    created: int                  # unix seconds
    arrival: float
    echo: dict = attrs.field(factory=dict, eq=False)  # API-specific fields emit echoes back


# --------------------------------------------------------------------------
# Pure synchronous core: render(Submission, RenderContext) -> RenderedRequest.
# Field names, defaults and error wording follow OpenAI, with vLLM's sampling
# extensions (top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos...).
# --------------------------------------------------------------------------

_NUMBER = (int, float)


@attrs.frozen
class RenderContext:
    tokenizer: Any
    served_model_names: tuple[str, ...]
    max_model_len: int
    # generation_config defaults (temperature, top_p, top_k, min_p,
    # repetition_penalty, max_new_tokens...); used when the request omits a field.
    default_sampling: dict = attrs.field(factory=dict)
    reasoning: bool = False       # a reasoning parser is active
    vocab_size: int | None = None  # the model's embedding rows: token ids must be below it


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, _NUMBER) and not isinstance(value, bool) and math.isfinite(value)


class _Fields:
    """Typed access to one JSON object; null counts as absent, as in OpenAI."""

    def __init__(self, body: dict, prefix: str = "") -> None:
        self.body = body
        self.prefix = prefix

    def param(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def has(self, name: str) -> bool:
        return self.body.get(name) is not None

    def _bad(self, name: str, what: str) -> RequestError:
        return RequestError(f"'{self.param(name)}' must be {what}, got "
                            f"{_json_type(self.body.get(name))}.", param=self.param(name))

    def integer(self, name: str, default: Any = None) -> Any:
        value = self.body.get(name)
        if value is None:
            return default
        if not _is_int(value):
            raise self._bad(name, "an integer")
        return value

    def number(self, name: str, default: Any = None) -> Any:
        value = self.body.get(name)
        if value is None:
            return default
        if not _is_number(value):
            raise self._bad(name, "a number")
        return float(value)

    def boolean(self, name: str, default: Any = None) -> Any:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._bad(name, "a boolean")
        return value

    def string(self, name: str, default: Any = None) -> Any:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self._bad(name, "a string")
        return value

    def object(self, name: str, default: Any = None) -> Any:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, dict):
            raise self._bad(name, "an object")
        return value

    def array(self, name: str, default: Any = None) -> Any:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, list):
            raise self._bad(name, "an array")
        return value

    def unsupported(self, name: str, why: str = "is not supported by this server") -> None:
        raise RequestError(f"'{self.param(name)}' {why}.", param=self.param(name))


def _json_type(value: object) -> str:
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


def render(sub: Submission, ctx: RenderContext) -> RenderedRequest:
    """Validate one API call, render its prompt and resolve its sampling params.

    Raises RequestError (4xx, OpenAI-shaped) for anything the client got wrong.
    """
    if not isinstance(sub.body, dict):
        raise RequestError("The request body must be a JSON object.")
    f = _Fields(sub.body)
    model = _resolve_model(f, ctx)
    if ctx.tokenizer is None and not (sub.api == "completions" and _is_token_ids(sub.body.get("prompt"))):
        raise RequestError("This model was loaded without a tokenizer: only /v1/completions with a "
                           "prompt of token ids is served.", param="prompt")
    if sub.api == "chat":
        return _render_chat(sub, f, ctx, model)
    if sub.api == "completions":
        return _render_completions(sub, f, ctx, model)
    if sub.api == "responses":
        return _render_responses(sub, f, ctx, model)
    raise RequestError(f"Unknown API {sub.api!r}.", status=404, type="not_found_error")


def _is_token_ids(prompt: object) -> bool:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    return isinstance(prompt, list) and bool(prompt) and all(_is_int(t) for t in prompt)


def _resolve_model(f: _Fields, ctx: RenderContext) -> str:
    # Like vLLM, an absent model means the (first) served model.
    name = f.string("model")
    if name is None:
        return ctx.served_model_names[0]
    if name not in ctx.served_model_names:
        raise RequestError(f"The model `{name}` does not exist.", status=404,
                           type="NotFoundError", param="model", code="model_not_found")
    return name


# -- per-API renderers -------------------------------------------------------

MAX_LOGPROBS = 20   # vLLM's default --max-logprobs


def _chat_logprobs(f: _Fields) -> int | None:
    """Chat's logprobs (bool) + top_logprobs (0-20) -> None, or the number of alternatives."""
    top = f.integer("top_logprobs")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise RequestError(f"'top_logprobs' must be between 0 and {MAX_LOGPROBS}, got {top}.",
                           param="top_logprobs")
    if not f.boolean("logprobs", False):
        if top:
            raise RequestError("'top_logprobs' needs 'logprobs' set to true.", param="top_logprobs")
        return None
    return top or 0

def _render_chat(sub: Submission, f: _Fields, ctx: RenderContext, model: str) -> RenderedRequest:
    _check_single_choice(f, "n")
    logprobs = _chat_logprobs(f)
    response_format = f.object("response_format")
    if response_format is not None and response_format.get("type", "text") != "text":
        f.unsupported("response_format", "other than {\"type\": \"text\"} is not supported")
    _check_no_tools(f)
    _reject_present(f, ("functions", "function_call", "guided_json", "guided_regex",
                        "guided_choice", "guided_grammar", "structured_outputs", "audio",
                        "prediction"))
    if f.object("logit_bias"):
        f.unsupported("logit_bias")
    modalities = f.array("modalities")
    if modalities is not None and any(m != "text" for m in modalities):
        f.unsupported("modalities", "other than [\"text\"] are not supported")
    stream, include_usage = _stream_flags(f)
    include_reasoning = f.boolean("include_reasoning", True)

    max_tokens_name = "max_completion_tokens" if f.has("max_completion_tokens") else "max_tokens"
    requested = _requested_max_tokens(f, max_tokens_name)
    sampling_fields = {**_sampling_fields(f, ctx), "logprobs": logprobs}

    messages = _chat_messages(f.body.get("messages"), "messages")
    template_kwargs = f.object("chat_template_kwargs", {})
    add_generation_prompt = f.boolean("add_generation_prompt", True)
    prompt = _apply_template(ctx, messages, add_generation_prompt, template_kwargs)
    ids = ctx.tokenizer.encode(prompt, add_special_tokens=f.boolean("add_special_tokens", False))

    max_tokens = _resolve_max_tokens(ctx, len(ids), requested, max_tokens_name,
                                     default=None, prompt_param="messages")
    return _rendered(sub, model, ids, _sampling(sampling_fields, max_tokens), stream,
                     include_usage, {"include_reasoning": include_reasoning})


def _render_completions(sub: Submission, f: _Fields, ctx: RenderContext,
                        model: str) -> RenderedRequest:
    _check_single_choice(f, "n")
    _check_single_choice(f, "best_of")
    if f.boolean("echo", False):
        f.unsupported("echo")
    if f.body.get("suffix") not in (None, ""):
        f.unsupported("suffix")
    logprobs = f.integer("logprobs")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise RequestError(f"'logprobs' must be between 0 and {MAX_LOGPROBS}, got {logprobs}.",
                           param="logprobs")
    if f.object("logit_bias"):
        f.unsupported("logit_bias")
    _reject_present(f, ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                        "structured_outputs", "response_format"))
    stream, include_usage = _stream_flags(f)
    requested = _requested_max_tokens(f, "max_tokens")
    sampling_fields = {**_sampling_fields(f, ctx), "logprobs": logprobs}

    ids = _completion_prompt_ids(f, ctx)
    # OpenAI's default for /v1/completions is 16 tokens.
    max_tokens = _resolve_max_tokens(ctx, len(ids), requested, "max_tokens",
                                     default=16, prompt_param="prompt")
    return _rendered(sub, model, ids, _sampling(sampling_fields, max_tokens), stream,
                     include_usage, {})


# Responses API fields we accept but cannot act on get a 400 naming them,
# rather than being silently ignored.
_RESPONSES_UNSUPPORTED = ("previous_response_id", "conversation", "prompt", "background")


def _render_responses(sub: Submission, f: _Fields, ctx: RenderContext,
                      model: str) -> RenderedRequest:
    for name in _RESPONSES_UNSUPPORTED:
        value = f.body.get(name)
        if value is not None and value is not False:
            f.unsupported(name)
    if f.array("tools"):
        f.unsupported("tools")
    tool_choice = f.body.get("tool_choice")
    if tool_choice not in (None, "none", "auto"):
        f.unsupported("tool_choice", "requires tools, which are not supported")
    if f.array("include"):
        f.unsupported("include")
    if f.integer("top_logprobs", 0):
        f.unsupported("top_logprobs")
    text = f.object("text")
    if text is not None:
        fmt = text.get("format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
            raise RequestError("'text.format' other than {\"type\": \"text\"} is not supported.",
                               param="text.format")
    reasoning = f.object("reasoning")
    if reasoning is not None and reasoning.get("effort") is not None and not ctx.reasoning:
        raise RequestError("'reasoning.effort' needs a reasoning model (serve with "
                           "--reasoning-parser).", param="reasoning.effort")
    if f.string("truncation", "disabled") != "disabled":
        f.unsupported("truncation", "other than \"disabled\" is not supported")
    metadata = f.object("metadata")
    f.boolean("store")       # accepted for compatibility; nothing is ever stored
    f.boolean("parallel_tool_calls")
    user = f.string("user")
    stream = f.boolean("stream", False)

    requested = _requested_max_tokens(f, "max_output_tokens")
    sampling_fields = _sampling_fields(f, ctx)

    instructions = f.string("instructions")
    messages = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    messages.extend(_responses_input(f))
    prompt = _apply_template(ctx, messages, True, f.object("chat_template_kwargs", {}))
    ids = ctx.tokenizer.encode(prompt, add_special_tokens=False)

    max_tokens = _resolve_max_tokens(ctx, len(ids), requested, "max_output_tokens",
                                     default=None, prompt_param="input")
    sampling = _sampling(sampling_fields, max_tokens)
    echo = {
        "instructions": instructions,
        "max_output_tokens": requested,
        "temperature": sampling.options.temperature,
        "top_p": sampling.options.top_p,
        "metadata": metadata or {},
        "user": user,
        "tool_choice": tool_choice or "auto",
        "parallel_tool_calls": f.boolean("parallel_tool_calls", True),
        "reasoning": {"effort": (reasoning or {}).get("effort"),
                      "summary": (reasoning or {}).get("summary")},
        "store": False,
    }
    return _rendered(sub, model, ids, sampling, stream, True, echo)


# -- shared pieces -----------------------------------------------------------

def _rendered(sub: Submission, model: str, ids: list[int], sampling: SamplingParams,
              stream: bool, include_usage: bool, echo: dict) -> RenderedRequest:
    return RenderedRequest(
        request_id=sub.request_id, api=sub.api, model=model,
        prompt_token_ids=tuple(ids), sampling=sampling, stream=stream,
        include_usage=include_usage if stream else True,
        created=int(time.time()), arrival=sub.arrival, echo=echo)


def _check_single_choice(f: _Fields, name: str) -> None:
    n = f.integer(name, 1)
    if n != 1:
        raise RequestError(f"'{name}' must be 1; this server returns one choice per request.",
                           param=name)


def _check_no_tools(f: _Fields) -> None:
    tools = f.array("tools")
    tool_choice = f.body.get("tool_choice")
    if tool_choice not in (None, "none", "auto"):
        f.unsupported("tool_choice", "is not supported (no tool-call parser)")
    if tools and tool_choice != "none":
        f.unsupported("tools", "are not supported (no tool-call parser); "
                      "send tool_choice \"none\" or omit tools")


def _reject_present(f: _Fields, names: tuple[str, ...]) -> None:
    for name in names:
        if f.has(name):
            f.unsupported(name)


def _stream_flags(f: _Fields) -> tuple[bool, bool]:
    stream = f.boolean("stream", False)
    options = f.object("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise RequestError("'stream_options' is only allowed when 'stream' is true.",
                           param="stream_options")
    include_usage = _Fields(options, "stream_options.").boolean("include_usage", False)
    return stream, include_usage


def _requested_max_tokens(f: _Fields, name: str) -> int | None:
    value = f.integer(name)
    if value is not None and value < 1:
        raise RequestError(f"'{name}' must be at least 1, got {value}.", param=name)
    return value


def _sampling_fields(f: _Fields, ctx: RenderContext) -> dict[str, Any]:
    """Read and range-check every sampling field; generation_config fills the gaps."""
    d = ctx.default_sampling
    out: dict[str, Any] = {}

    def default(name: str) -> Any:
        value = d.get(name)
        return getattr(attrs.fields(SamplingOptions), name).default if value is None else value

    temperature = f.number("temperature", default("temperature"))
    if not 0.0 <= temperature <= 2.0:
        raise RequestError(f"'temperature' must be between 0 and 2, got {temperature}.",
                           param="temperature")
    top_p = f.number("top_p", default("top_p"))
    if not 0.0 < top_p <= 1.0:
        raise RequestError(f"'top_p' must be in (0, 1], got {top_p}.", param="top_p")
    top_k = f.integer("top_k", default("top_k"))
    if top_k < -1:
        raise RequestError(f"'top_k' must be -1 or 0 (off) or at least 1, got {top_k}.",
                           param="top_k")
    min_p = f.number("min_p", default("min_p"))
    if not 0.0 <= min_p <= 1.0:
        raise RequestError(f"'min_p' must be in [0, 1], got {min_p}.", param="min_p")
    for name in ("frequency_penalty", "presence_penalty"):
        value = f.number(name, default(name))
        if not -2.0 <= value <= 2.0:
            raise RequestError(f"'{name}' must be between -2 and 2, got {value}.", param=name)
        out[name] = value
    repetition_penalty = f.number("repetition_penalty", default("repetition_penalty"))
    if repetition_penalty <= 0.0:
        raise RequestError(f"'repetition_penalty' must be greater than 0, got "
                           f"{repetition_penalty}.", param="repetition_penalty")
    min_tokens = f.integer("min_tokens", 0)
    if min_tokens < 0:
        raise RequestError(f"'min_tokens' must be at least 0, got {min_tokens}.",
                           param="min_tokens")
    out.update(
        temperature=float(temperature), top_p=float(top_p), top_k=top_k, min_p=float(min_p),
        repetition_penalty=float(repetition_penalty), min_tokens=min_tokens,
        seed=_seed(f), stop=_stop_strings(f), stop_token_ids=_stop_token_ids(f, ctx.vocab_size),
        ignore_eos=f.boolean("ignore_eos", False),
        include_stop_str_in_output=f.boolean("include_stop_str_in_output", False),
        skip_special_tokens=f.boolean("skip_special_tokens", True),
    )
    return out


def _sampling(fields: dict[str, Any], max_tokens: int) -> SamplingParams:
    if fields["min_tokens"] > max_tokens:
        raise RequestError(f"'min_tokens' ({fields['min_tokens']}) must be at most the "
                           f"maximum number of tokens to generate ({max_tokens}).",
                           param="min_tokens")
    own = {k: fields.pop(k) for k in ("stop", "ignore_eos", "include_stop_str_in_output",
                                      "skip_special_tokens")}
    return SamplingParams(max_tokens=max_tokens, options=SamplingOptions(**fields), **own)


def _stop_strings(f: _Fields) -> tuple[str, ...]:
    stop = f.body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise RequestError("'stop' must be a string or an array of strings.", param="stop")
    if any(s == "" for s in stop):
        raise RequestError("'stop' cannot contain an empty string.", param="stop")
    return tuple(stop)


def _stop_token_ids(f: _Fields, vocab_size: int | None) -> tuple[int, ...]:
    ids = f.array("stop_token_ids", [])
    if not all(_is_int(i) and i >= 0 for i in ids):
        raise RequestError("'stop_token_ids' must be an array of non-negative integers.",
                           param="stop_token_ids")
    if vocab_size is not None and any(i >= vocab_size for i in ids):
        raise RequestError(f"'stop_token_ids' must be below the vocabulary size {vocab_size}.",
                           param="stop_token_ids")
    return tuple(ids)


_INT64 = 2 ** 63


def _seed(f: _Fields) -> int | None:
    seed = f.integer("seed")
    if seed is not None and not -_INT64 <= seed < _INT64:
        raise RequestError("'seed' must fit in a signed 64-bit integer.", param="seed")
    return seed


def _resolve_max_tokens(ctx: RenderContext, prompt_len: int, requested: int | None,
                        name: str, *, default: int | None, prompt_param: str) -> int:
    limit = ctx.max_model_len
    if prompt_len >= limit:
        raise RequestError(
            f"This model's maximum context length is {limit} tokens. However, your request "
            f"has {prompt_len} input tokens. Please reduce the length of the input.",
            param=prompt_param, code="context_length_exceeded")
    room = limit - prompt_len
    if requested is None:
        cap = ctx.default_sampling.get("max_new_tokens")
        value = room if default is None else default
        if _is_int(cap) and cap > 0:
            value = min(value, cap)
        return min(value, room)
    if requested > room:
        where = "messages" if prompt_param in ("messages", "input") else "prompt"
        raise RequestError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{requested + prompt_len} tokens ({prompt_len} in the {where}, {requested} in the "
            f"completion). Please reduce the length of the {where} or completion.",
            param=name, code="context_length_exceeded")
    return requested


# -- prompts -----------------------------------------------------------------

_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
_RESPONSES_ROLES = ("system", "developer", "user", "assistant")
# Keys a template may need beyond role/content; passed through untouched.
_MESSAGE_PASSTHROUGH = ("name", "tool_call_id", "tool_calls", "reasoning_content")
# chat_template_kwargs may not override what render itself decides.
_RESERVED_TEMPLATE_KWARGS = ("messages", "conversation", "add_generation_prompt", "tools",
                             "tokenize")


def _chat_messages(raw: object, param: str) -> list[dict]:
    if not isinstance(raw, list):
        raise RequestError(f"'{param}' must be an array of messages, got {_json_type(raw)}.",
                           param=param)
    if not raw:
        raise RequestError(f"'{param}' must contain at least one message.", param=param)
    messages = []
    for i, message in enumerate(raw):
        where = f"{param}[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"'{where}' must be an object.", param=where)
        role = message.get("role")
        if role not in _CHAT_ROLES:
            raise RequestError(f"'{where}.role' must be one of {', '.join(_CHAT_ROLES)}, "
                               f"got {role!r}.", param=f"{where}.role")
        content = _content_text(message.get("content"), f"{where}.content", ("text",),
                                allow_null=role == "assistant")
        out = {"role": _template_role(role), "content": content}
        out.update((k, message[k]) for k in _MESSAGE_PASSTHROUGH if message.get(k) is not None)
        messages.append(out)
    return messages


def _responses_input(f: _Fields) -> list[dict]:
    raw = f.body.get("input")
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise RequestError(f"'input' must be a string or an array of input items, got "
                           f"{_json_type(raw)}.", param="input")
    if not raw:
        raise RequestError("'input' must contain at least one item.", param="input")
    messages = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"'{where}' must be an object.", param=where)
        kind = item.get("type", "message")
        if kind != "message":
            raise RequestError(f"'{where}.type' {kind!r} is not supported; only message "
                               "items are.", param=f"{where}.type")
        role = item.get("role")
        if role not in _RESPONSES_ROLES:
            raise RequestError(f"'{where}.role' must be one of {', '.join(_RESPONSES_ROLES)}, "
                               f"got {role!r}.", param=f"{where}.role")
        content = _content_text(item.get("content"), f"{where}.content",
                                ("input_text", "output_text", "text"), allow_null=False)
        messages.append({"role": _template_role(role), "content": content})
    return messages


def _template_role(role: str) -> str:
    # OpenAI's "developer" is the system prompt; most chat templates only know "system".
    return "system" if role == "developer" else role


def _content_text(content: object, param: str, part_types: tuple[str, ...], *,
                  allow_null: bool) -> str:
    if content is None and allow_null:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"'{param}' must be a string or an array of content parts, got "
                           f"{_json_type(content)}.", param=param)
    texts = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise RequestError(f"'{where}' must be an object.", param=where)
        if part.get("type") not in part_types:
            raise RequestError(f"'{where}.type' {part.get('type')!r} is not supported; "
                               f"expected {' or '.join(part_types)}.", param=f"{where}.type")
        text = part.get("text")
        if not isinstance(text, str):
            raise RequestError(f"'{where}.text' must be a string.", param=f"{where}.text")
        texts.append(text)
    # vLLM joins text parts with a newline.
    return "\n".join(texts)


def _apply_template(ctx: RenderContext, messages: list[dict], add_generation_prompt: bool,
                    template_kwargs: dict) -> str:
    kwargs = {k: v for k, v in template_kwargs.items() if k not in _RESERVED_TEMPLATE_KWARGS}
    try:
        return ctx.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **kwargs)
    except (ValueError, TypeError, jinja2.TemplateError) as exc:
        raise RequestError(f"Could not apply the chat template: {exc}",
                           param="messages") from exc


def _completion_prompt_ids(f: _Fields, ctx: RenderContext) -> list[int]:
    prompt = f.body.get("prompt")
    if prompt is None:
        raise RequestError("'prompt' is required.", param="prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]          # a batch of one
    if isinstance(prompt, str):
        ids = ctx.tokenizer.encode(prompt, add_special_tokens=f.boolean("add_special_tokens", True))
    elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        vocab = ctx.vocab_size or getattr(ctx.tokenizer, "vocab_size", None)
        bad = [t for t in prompt if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise RequestError(f"'prompt' has token id {bad[0]} outside the vocabulary "
                               f"[0, {vocab}).", param="prompt")
        ids = list(prompt)
    elif isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError("'prompt' holds more than one prompt; batched prompts are not "
                           "supported, send one request per prompt.", param="prompt")
    else:
        raise RequestError("'prompt' must be a string or an array of token ids.",
                           param="prompt")
    if not ids:
        raise RequestError("'prompt' must not be empty.", param="prompt")
    return ids


# --------------------------------------------------------------------------
# Async shell (the lead's): async def run(...) goes below this line.
# --------------------------------------------------------------------------


async def run(receive, send, replies, ctx: RenderContext, log=None) -> None:
    """Render each submission; a bad one gets its error on its reply channel."""
    async with receive, send:
        async for sub in receive:
            try:
                req = render(sub, ctx)
            except RequestError as err:
                if log is not None:
                    log("rejected", request_id=sub.request_id, status=err.status, message=err.message)
                replies.send(sub.request_id, err)
                replies.release(sub.request_id)
                continue
            except Exception as exc:  # a bug must cost one request, not the server
                if log is not None:
                    log("render_failed", request_id=sub.request_id, error=repr(exc))
                replies.send(sub.request_id, RequestError(
                    f"Internal error while rendering the request: {exc}", status=500,
                    type="server_error"))
                replies.release(sub.request_id)
                continue
            if log is not None:
                log("rendered", request_id=req.request_id, api=req.api,
                    prompt_tokens=len(req.prompt_token_ids), max_tokens=req.sampling.max_tokens)
            await send.send(req)
