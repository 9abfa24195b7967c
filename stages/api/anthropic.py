"""POST /v1/messages (Anthropic's Messages API): its request, prompt plan and framer.

The request maps onto what chat already renders: `system` and `messages` (content blocks:
text, tool_use, tool_result, thinking) become chat-template messages, `tools` and
`tool_choice` chat-form tools (so the same tool parsers find the calls), `output_format`
(or `output_config.format`) a JSON-schema constraint, `thinking` the template's
`enable_thinking`. The reply is a `message` of content blocks: thinking (the reasoning
parser's reasoning), text, tool_use, in the order the model wrote them.

Stream order, as Anthropic's: message_start, ping; per block content_block_start,
content_block_delta... (text_delta, thinking_delta then signature_delta, input_json_delta),
content_block_stop; then message_delta (stop_reason, stop_sequence, usage) and
message_stop. An engine failure mid-stream is an `error` event.

Usage follows Anthropic's meaning: `input_tokens` are the prompt tokens not read from the
prefix cache, `cache_read_input_tokens` those that were; `count_tokens` (and the two added
up) is the whole rendered prompt.
"""
from __future__ import annotations

import json
from typing import Any, ClassVar, Union

import attrs
import orjson

from gpu.interface import Constraint
from stages.api.chat import template_messages
from stages.api.common import (Invalid, PromptPlan, RequestError, ToolSettings, at_least,
                               between, converter, mismatch, one_constraint, opt, reply,
                               structure_hook, structure_list, tolerant, unstructure)
from stages.api.framing import Framer, json_body
from stages.api.request_types import ChatMessage, SamplingRequest, StreamOptions
from stages.api.structured import named
from stages.api.tools import tool_request
from stages.delta import Delta, FinishReason, Usage
from stages.messages import ReplySpec

# -- errors ---------------------------------------------------------------------------------

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_dict(err: RequestError) -> dict[str, Any]:
    """A RequestError in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
    return {"type": "error", "error": {"type": error_type(err.status), "message": err.message}}


def _server_error(message: str | None) -> dict[str, Any]:
    return {"type": "error", "error": {"type": "api_error",
                                       "message": message or "The engine failed while generating."}}


# -- the request ------------------------------------------------------------------------------

@attrs.frozen
class Block:
    """One content block of a message (or of `system`, or of a tool_result's content).
    Keys this server does not read (cache_control, citations) are tolerated."""
    type: str
    text: str | None = None
    id: str | None = None              # tool_use
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None     # tool_result
    content: Any = None                # tool_result: a string or an array of blocks
    is_error: bool | None = None
    thinking: str | None = None        # thinking
    signature: str | None = None
    data: str | None = None            # redacted_thinking
    source: Any = None                 # image, document


Blocks = Union[str, list[Block]]


def _blocks(value: object, _: type) -> str | list[Block]:
    if type(value) is str:
        return value
    if type(value) is not list:
        raise mismatch("a string or an array of content blocks", value)
    return structure_list(value, list[Block])


structure_hook(Blocks, _blocks)


@attrs.frozen
class InputMessage:
    role: str
    content: Blocks


converter.register_structure_hook(Block, tolerant(Block))
converter.register_structure_hook(InputMessage, tolerant(InputMessage))

ROLES = ("user", "assistant")


@attrs.frozen
class MessagesBase(SamplingRequest):
    """What /v1/messages and /v1/messages/count_tokens share."""
    messages: list[InputMessage] = opt()
    system: Blocks | None = opt()
    tools: list[dict[str, Any]] | None = opt()
    tool_choice: dict[str, Any] | None = opt()
    thinking: dict[str, Any] | None = opt()
    output_format: dict[str, Any] | None = opt()     # the structured-outputs beta's name
    output_config: dict[str, Any] | None = opt()     # {"format": ..., "effort": ...}
    chat_template_kwargs: dict[str, Any] | None = opt()   # as vLLM's extension
    # Anthropic's, accepted and ignored (nothing here reads them)
    metadata: dict[str, Any] | None = opt()
    service_tier: str | None = opt()
    cache_control: Any = opt()
    inference_geo: str | None = opt()
    speed: str | None = opt()
    _not_implemented: ClassVar[dict[str, Any]] = {
        "container": (), "mcp_servers": (), "context_management": (), "diagnostics": ()}

    @messages.validator
    def _messages(self, attribute, value) -> None:
        if value is None:
            raise Invalid("is required.", attribute.name)
        if not value:
            raise Invalid("must contain at least one message.", attribute.name)


@attrs.frozen
class MessagesRequest(MessagesBase):
    max_tokens: int | None = opt(at_least(1))        # required, as Anthropic's
    stop_sequences: list[str] | None = opt()
    # Anthropic's range and default (the SDK passes them through extra_body)
    temperature: float | None = opt(between(0.0, 1.0), default=1.0)
    # vLLM's sampling extensions, as on its other APIs
    frequency_penalty: float | None = opt(between(-2.0, 2.0))
    presence_penalty: float | None = opt(between(-2.0, 2.0))

    @max_tokens.validator
    def _max_tokens(self, attribute, value) -> None:
        if value is None:
            raise Invalid("is required.", attribute.name)

    @stop_sequences.validator
    def _stops(self, attribute, value) -> None:
        if value and any(s == "" for s in value):
            raise Invalid("cannot contain an empty string.", attribute.name)

    @property
    def stop(self) -> tuple[str, ...]:
        """The stop strings, under the name render reads."""
        return tuple(self.stop_sequences or ())


@attrs.frozen
class CountTokensRequest(MessagesBase):
    """POST /v1/messages/count_tokens: a Messages request without the generation fields."""
    _not_implemented: ClassVar[dict[str, Any]] = {
        **MessagesBase._not_implemented, "max_tokens": (), "stop_sequences": ()}


# -- request -> chat form -------------------------------------------------------------------

def _text_of(content: Blocks | None, where: str, types: tuple[str, ...] = ("text",)) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        if block.type not in types:
            raise RequestError(f"'{at}.type' {block.type!r} is not supported here; expected "
                               f"{' or '.join(types)}.", param=f"{at}.type")
        if block.text is None:
            raise RequestError(f"'{at}.text' must be a string.", param=f"{at}.text")
        texts.append(block.text)
    return "\n".join(texts)


def _tool_result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise RequestError(f"'{where}' must be a string or an array of text blocks.",
                           param=where)
    try:
        blocks = structure_list(content, list[Block])
    except Exception:
        raise RequestError(f"'{where}' must be a string or an array of text blocks.",
                           param=where) from None
    return _text_of(blocks, where)


_MEDIA = ("image", "document", "search_result")


def chat_messages(req: MessagesBase) -> list[dict]:
    """The request's system prompt and messages as chat messages (ChatMessage's fields)."""
    out: list[dict] = []
    if req.system is not None:
        system = _text_of(req.system, "system")
        if system:
            out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        if m.role not in ROLES:
            raise RequestError(f"'{where}.role' must be one of user, assistant, got "
                               f"{m.role!r}.", param=f"{where}.role")
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts, calls, thinking = [], [], []
        for j, b in enumerate(m.content):
            at = f"{where}.content[{j}]"
            if b.type == "text":
                if b.text is None:
                    raise RequestError(f"'{at}.text' must be a string.", param=f"{at}.text")
                texts.append(b.text)
            elif b.type in _MEDIA:
                raise RequestError(f"'{at}' is a {b.type} block: the served model takes text "
                                   "only.", param=f"{at}.type")
            elif b.type == "tool_result" and m.role == "user":
                if not b.tool_use_id:
                    raise RequestError(f"'{at}.tool_use_id' is required.",
                                       param=f"{at}.tool_use_id")
                out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                            "content": _tool_result_text(b.content, f"{at}.content")})
            elif b.type == "tool_use" and m.role == "assistant":
                if not b.id or not b.name:
                    param = f"{at}.id" if not b.id else f"{at}.name"
                    raise RequestError(f"'{param}' is required.", param=param)
                if b.input is not None and not isinstance(b.input, dict):
                    raise RequestError(f"'{at}.input' must be an object.", param=f"{at}.input")
                calls.append({"id": b.id, "type": "function", "function": {
                    "name": b.name, "arguments": json.dumps(b.input or {})}})
            elif b.type == "thinking" and m.role == "assistant":
                thinking.append(b.thinking or "")
            elif b.type == "redacted_thinking" and m.role == "assistant":
                continue    # encrypted elsewhere: nothing this model can read
            else:
                raise RequestError(f"'{at}.type' {b.type!r} is not supported in a {m.role} "
                                   "message.", param=f"{at}.type")
        if not (texts or calls or thinking):
            continue        # a user turn of tool results only
        message: dict = {"role": m.role, "content": "\n".join(texts)}
        if calls:
            message["tool_calls"] = calls
        if thinking:
            message["reasoning"] = "\n".join(thinking)
        out.append(message)
    return out


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Anthropic's custom tools ({name, description, input_schema}) in chat form."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.get("type", "custom") != "custom":
            raise RequestError(f"'{where}.type' {json.dumps(tool.get('type'))} is a server "
                               "tool, which this server does not run; only custom tools are "
                               "supported.", param=f"{where}.type")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"'{where}.name' must be a non-empty string.",
                               param=f"{where}.name")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise RequestError(f"'{where}.input_schema' must be a JSON schema object.",
                               param=f"{where}.input_schema")
        fn = {"name": name, "parameters": schema}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict | None) -> tuple[Any, bool | None]:
    """(chat's tool_choice, parallel_tool_calls) from Anthropic's tool_choice."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") is True else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError("'tool_choice.name' must be a non-empty string.",
                               param="tool_choice.name")
        return {"type": "function", "function": {"name": name}}, parallel
    raise RequestError("'tool_choice.type' must be one of auto, any, tool, none, got "
                       f"{json.dumps(kind)}.", param="tool_choice.type")


def _thinking_kwargs(req: MessagesBase, reasoning_parser: bool) -> dict:
    if req.thinking is None:
        return {}
    kind = req.thinking.get("type")
    if kind == "disabled":
        return {"enable_thinking": False}
    if kind not in ("enabled", "adaptive"):
        raise RequestError("'thinking.type' must be one of enabled, adaptive, disabled, got "
                           f"{json.dumps(kind)}.", param="thinking.type")
    budget = req.thinking.get("budget_tokens")
    if kind == "enabled" and (type(budget) is not int or budget < 1):
        raise RequestError("'thinking.budget_tokens' must be a positive integer.",
                           param="thinking.budget_tokens")
    if not reasoning_parser:
        raise RequestError("'thinking' needs a reasoning model (serve with "
                           "--reasoning-parser).", param="thinking")
    return {"enable_thinking": True}


def _output_constraint(req: MessagesBase) -> Constraint | None:
    fmt, param = req.output_format, "output_format"
    if fmt is None and req.output_config is not None:
        fmt, param = req.output_config.get("format"), "output_config.format"
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise RequestError(f"'{param}.type' must be \"json_schema\".", param=f"{param}.type")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise RequestError(f"'{param}.schema' must be a JSON schema object.",
                           param=f"{param}.schema")
    return named(Constraint("json_schema", json.dumps(schema)), param)


_WITH_USAGE = StreamOptions(include_usage=True)


def template_inputs(req: MessagesBase, reasoning_parser: bool, tools: ToolSettings):
    """(chat messages, template kwargs, ToolRequest): what both the plan and count_tokens
    hand the chat template."""
    choice, parallel = _tool_choice(req.tool_choice)
    tr = tool_request(chat_tools(req.tools), choice, parallel, tools)
    kwargs = dict(req.chat_template_kwargs or {})
    kwargs.update(_thinking_kwargs(req, reasoning_parser))
    effort = (req.output_config or {}).get("effort")
    if isinstance(effort, str):
        kwargs.setdefault("reasoning_effort", effort)
    if tr.template_tools is not None:
        kwargs["tools"] = tr.template_tools
    return chat_messages(req), kwargs, tr


def _prefill(messages: list[dict]) -> bool:
    """A last assistant message is a prefill: the reply continues it, as Anthropic's does."""
    return messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls")


def plan(req: MessagesRequest, *, reasoning_parser: bool,
         tools: ToolSettings = ToolSettings()) -> PromptPlan:
    messages, kwargs, tr = template_inputs(req, reasoning_parser, tools)
    if not messages:
        raise RequestError("'messages' must contain some content.", param="messages")
    constraint = one_constraint(_output_constraint(req), tr.constraint, "output_format")
    chat_form = template_messages([ChatMessage(**m) for m in messages], "messages")
    prefill = _prefill(messages)
    return PromptPlan(messages=chat_form, template_kwargs=kwargs, prompt_param="messages",
                      add_generation_prompt=not prefill, continue_final_message=prefill,
                      max_tokens=req.max_tokens, max_tokens_param="max_tokens",
                      stream=req.stream, stream_options=_WITH_USAGE, constraint=constraint,
                      tools=tr.plan, reply=reply_spec(req))


def reply_spec(req: MessagesRequest) -> ReplySpec:
    """Nothing of the request is echoed but the stop sequences, which the framer reads
    from the sampling params (a matched one is the message's stop_sequence)."""
    return ReplySpec()


def count_tokens_body(body: object, *, reasoning_parser: bool, tools: ToolSettings,
                      parse) -> dict:
    """The /tokenize body whose count is a count_tokens request's prompt length (`parse`:
    common.parse_request)."""
    req = parse(body, CountTokensRequest)
    messages, kwargs, _ = template_inputs(req, reasoning_parser, tools)
    if not messages:
        raise RequestError("'messages' must contain some content.", param="messages")
    tools_kw = kwargs.pop("tools", None)
    prefill = _prefill(messages)
    return {"model": req.model, "messages": messages, "chat_template_kwargs": kwargs,
            "add_generation_prompt": not prefill, "continue_final_message": prefill,
            **({"tools": tools_kw} if tools_kw is not None else {})}


# -- replies ------------------------------------------------------------------------------

@reply
class MessageUsage:
    input_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    output_tokens: int


def message_usage(usage: Usage) -> MessageUsage:
    return MessageUsage(input_tokens=usage.prompt_tokens - usage.cached_tokens,
                        cache_read_input_tokens=usage.cached_tokens,
                        output_tokens=usage.completion_tokens)


@reply
class Message:
    id: str
    type: str = "message"
    role: str = "assistant"
    model: str
    content: list[dict]
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: MessageUsage


class _Block:
    """One content block while it is built: thinking, text or tool_use."""

    def __init__(self, kind: str, call=None) -> None:
        self.kind = kind
        self.parts: list[str] = []
        self.call = call
        self.open = True

    def start(self) -> dict:
        if self.kind == "thinking":
            return {"type": "thinking", "thinking": "", "signature": ""}
        if self.kind == "text":
            return {"type": "text", "text": ""}
        return {"type": "tool_use", "id": tool_use_id(self.call.id), "name": self.call.name,
                "input": {}}

    def whole(self) -> dict:
        text = "".join(self.parts)
        if self.kind == "thinking":
            return {"type": "thinking", "thinking": text, "signature": ""}
        if self.kind == "text":
            return {"type": "text", "text": text}
        return {**self.start(), "input": _arguments(self.call.arguments)}


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _event(type_: str, data: dict) -> bytes:
    return (b"event: " + type_.encode() + b"\ndata: "
            + orjson.dumps({"type": type_, **data}) + b"\n\n")


class MessagesFramer(Framer):
    """Anthropic's message, or its event stream, from one request's deltas."""

    def __init__(self, req) -> None:
        super().__init__(req)
        self.id = f"msg_{req.request_id}"
        self._blocks: list[_Block] = []
        self._stops = frozenset(req.sampling.stop)      # the request's stop_sequences

    # -- what both modes share

    def _stop(self, delta: Delta) -> tuple[str, str | None]:
        reason = delta.finish_reason
        if reason is FinishReason.LENGTH:
            return "max_tokens", None
        if reason is FinishReason.TOOL_CALLS or any(b.kind == "tool_use" for b in self._blocks):
            return "tool_use", None
        if isinstance(delta.stop_reason, str) and delta.stop_reason in self._stops:
            return "stop_sequence", delta.stop_reason
        return "end_turn", None

    def _message(self, content: list[dict], usage: Usage, stop: tuple[str | None, str | None]
                 ) -> Message:
        return Message(id=self.id, model=self.req.model, content=content, stop_reason=stop[0],
                       stop_sequence=stop[1], usage=message_usage(usage))

    def _add(self, kind: str, call=None) -> tuple[_Block, bool]:
        """The open block of this kind, or a new one (closing the one before)."""
        last = self._blocks[-1] if self._blocks else None
        if kind != "tool_use" and last is not None and last.kind == kind and last.open:
            return last, False
        block = _Block(kind, call)
        self._blocks.append(block)
        return block, True

    # -- streaming

    def start(self) -> bytes:
        if not self.req.stream:
            return b""
        usage = Usage(len(self.req.prompt_token_ids), 0)
        started = self._message([], usage, (None, None))
        return _event("message_start", {"message": unstructure(started)}) + _event("ping", {})

    def _close(self, block: _Block, index: int) -> bytes:
        block.open = False
        out = b""
        if block.kind == "thinking":
            out = _event("content_block_delta", {"index": index, "delta": {
                "type": "signature_delta", "signature": ""}})
        return out + _event("content_block_stop", {"index": index})

    def _open(self, kind: str, call=None) -> tuple[int, bytes]:
        before = len(self._blocks)
        block, new = self._add(kind, call)
        index = len(self._blocks) - 1
        if not new:
            return index, b""
        out = b""
        if before and self._blocks[before - 1].open:
            out = self._close(self._blocks[before - 1], before - 1)
        return index, out + _event("content_block_start",
                                   {"index": index, "content_block": block.start()})

    def _text(self, kind: str, text: str) -> bytes:
        index, out = self._open(kind)
        self._blocks[index].parts.append(text)
        key, delta_type = (("thinking", "thinking_delta") if kind == "thinking"
                           else ("text", "text_delta"))
        return out + _event("content_block_delta", {"index": index, "delta": {
            "type": delta_type, key: text}})

    def _stream(self, delta: Delta) -> bytes:
        out = []
        if delta.reasoning:
            out.append(self._text("thinking", delta.reasoning))
        if delta.content:
            out.append(self._text("text", delta.content))
        for call in delta.tool_calls:
            index, opened = self._open("tool_use", call)
            self._blocks[index].parts.append(call.arguments)
            out += [opened, _event("content_block_delta", {"index": index, "delta": {
                "type": "input_json_delta", "partial_json": call.arguments}}),
                    self._close(self._blocks[index], index)]
        reason = delta.finish_reason
        if reason is FinishReason.ERROR:
            out.append(_event("error", {"error": _server_error(delta.error)["error"]}))
        elif reason is not None:
            if not self._blocks:    # an empty answer is one empty text block
                out.append(self._open("text")[1])
            last = len(self._blocks) - 1
            if self._blocks[last].open:
                out.append(self._close(self._blocks[last], last))
            stop_reason, stop_sequence = self._stop(delta)
            out.append(_event("message_delta", {
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": unstructure(message_usage(delta.usage))}))
            out.append(_event("message_stop", {}))
        return b"".join(out)

    # -- one body

    def _accumulate(self, delta: Delta) -> bytes:
        if delta.reasoning:
            self._add("thinking")[0].parts.append(delta.reasoning)
        if delta.content:
            self._add("text")[0].parts.append(delta.content)
        for call in delta.tool_calls:
            self._add("tool_use", call)[0].parts.append(call.arguments)
        if delta.finish_reason is None:
            return b""
        if delta.finish_reason is FinishReason.ERROR:
            self.status = 500
            return orjson.dumps(_server_error(delta.error))
        content = [b.whole() for b in self._blocks] or [{"type": "text", "text": ""}]
        return json_body(self._message(content, delta.usage, self._stop(delta)))
