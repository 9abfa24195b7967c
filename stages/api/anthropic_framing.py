"""The replies of POST /v1/messages (Anthropic's Messages API): its errors, its message and
its event stream, framed from one request's deltas (the request and its plan are
stages/api/anthropic.py).

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
from typing import Any

import orjson

from stages.api.common import RequestError, reply, unstructure
from stages.api.framing import Framer, json_body
from stages.delta import Delta, FinishReason, Usage

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


# -- replies ------------------------------------------------------------------------------

@reply
class MessageUsage:
    input_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    output_tokens: int


def message_usage(usage: Usage) -> MessageUsage:
    """Anthropic's: the prompt is input_tokens + cache_read + cache_creation (as vLLM's)."""
    return MessageUsage(input_tokens=(usage.prompt_tokens - usage.cached_tokens
                                      - usage.created_cache_tokens),
                        cache_creation_input_tokens=usage.created_cache_tokens,
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
