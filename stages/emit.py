"""emit: accounted deltas -> the bytes of each request's reply (API framing).

One Framer per request, created from its RenderedRequest. `start()` gives the
bytes to send as soon as the request is admitted; `on_delta()` gives the bytes
for one engine step. A streaming request gets Server-Sent Events (chat and
completions chunks ending in `data: [DONE]`, or Responses API events); a
non-streaming one gets nothing until it finishes, then its whole JSON body.

The framing is a pure function of the deltas, so replaying the event log
reproduces a reply byte for byte.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import attrs
import orjson

from stages.delta import Delta, FinishReason, Step, TokenLogprob, Usage
from stages.render import RenderedRequest

DONE = b"data: [DONE]\n\n"

# HTTP status of a non-streaming reply whose client went away (nginx's
# "client closed request"); nobody reads it, but logs do.
STATUS_CLIENT_CLOSED = 499


def sse_data(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def usage_json(usage: Usage) -> dict:
    """The chat/completions usage object (OpenAI names, vLLM's details)."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    }


def responses_usage_json(usage: Usage) -> dict:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }


def server_error_json(message: str | None) -> dict:
    return {"error": {"message": message or "The engine failed while generating.",
                      "type": "server_error", "param": None, "code": None}}


class Framer(ABC):
    """Frames one request's reply. `Framer(req)` returns the framer for req.api.

    `finished` is set once the final bytes have been produced; `status` is the
    HTTP status of a non-streaming reply (200, 500 on engine failure).
    """

    def __new__(cls, req: RenderedRequest) -> Framer:
        if cls is Framer:
            try:
                cls = _FRAMERS[req.api]
            except KeyError:
                raise ValueError(f"no framer for api {req.api!r}") from None
        return super().__new__(cls)

    def __init__(self, req: RenderedRequest) -> None:
        self.req = req
        self.finished = False
        self.status = 200

    def start(self) -> bytes:
        return b""

    def on_delta(self, delta: Delta) -> bytes:
        if self.finished:
            return b""
        if delta.finish_reason == FinishReason.ABORT:
            # The client is gone: there is nobody to frame anything for.
            self.finished = True
            self.status = STATUS_CLIENT_CLOSED
            return b""
        if self.req.stream:
            out = self._stream(delta)
        else:
            out = self._accumulate(delta)
        if delta.finish_reason is not None:
            self.finished = True
        return out

    @abstractmethod
    def _stream(self, delta: Delta) -> bytes:
        """The SSE bytes for one step of a streaming reply (closing events included)."""

    @abstractmethod
    def _accumulate(self, delta: Delta) -> bytes:
        """Non-streaming: b"" until the request finishes, then the whole JSON body."""


class _ChoiceFramer(Framer):
    """Shared shape of chat and completions: one choice, chunks, [DONE]."""

    object_name: str
    chunk_object_name: str
    id_prefix: str

    def __init__(self, req: RenderedRequest) -> None:
        super().__init__(req)
        self.id = f"{self.id_prefix}{req.request_id}"
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._logprobs: list[TokenLogprob] = []
        self._wants_logprobs = req.sampling.options.logprobs is not None

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> bytes:
        chunk = {"id": self.id, "object": self.chunk_object_name, "created": self.req.created,
                 "model": self.req.model, "choices": choices}
        if self.req.include_usage:
            # OpenAI: with include_usage every chunk has "usage", null but the last.
            chunk["usage"] = usage
        return sse_data(chunk)

    def _stream(self, delta: Delta) -> bytes:
        out = []
        reasoning = self._visible_reasoning(delta)
        logprobs = self._logprobs_json(delta.logprobs) if self._wants_logprobs and delta.logprobs else None
        if delta.content or reasoning or logprobs:
            choice = self._stream_choice(delta.content, reasoning)
            choice["logprobs"] = logprobs
            out.append(self._chunk([choice]))
        reason = delta.finish_reason
        if reason == FinishReason.ERROR:
            out.append(sse_data(server_error_json(delta.error)))
            out.append(DONE)
        elif reason is not None:
            out.append(self._chunk([self._final_choice(reason, delta.stop_reason)]))
            if self.req.include_usage:
                out.append(self._chunk([], usage_json(delta.usage)))
            out.append(DONE)
        return b"".join(out)

    def _accumulate(self, delta: Delta) -> bytes:
        self._text.append(delta.content)
        self._reasoning.append(self._visible_reasoning(delta))
        self._logprobs.extend(delta.logprobs)
        if delta.finish_reason is None:
            return b""
        if delta.finish_reason == FinishReason.ERROR:
            self.status = 500
            return orjson.dumps(server_error_json(delta.error))
        text, reasoning = "".join(self._text), "".join(self._reasoning)
        choice = self._body_choice(text, reasoning, delta.finish_reason, delta.stop_reason)
        if self._wants_logprobs:
            choice["logprobs"] = self._logprobs_json(self._logprobs)
        return orjson.dumps({
            "id": self.id, "object": self.object_name, "created": self.req.created,
            "model": self.req.model,
            "choices": [choice],
            "usage": usage_json(delta.usage),
        })

    @abstractmethod
    def _logprobs_json(self, entries: list[TokenLogprob] | tuple[TokenLogprob, ...]) -> dict:
        """The API's logprobs object for these tokens."""

    def _visible_reasoning(self, delta: Delta) -> str:
        return delta.reasoning

    @abstractmethod
    def _stream_choice(self, text: str, reasoning: str) -> dict:
        """Each API's framer defines this."""

    @abstractmethod
    def _final_choice(self, finish_reason: FinishReason, stop_reason: str | int | None) -> dict:
        """Each API's framer defines this."""

    @abstractmethod
    def _body_choice(self, text: str, reasoning: str, finish_reason: FinishReason,
                     stop_reason: str | int | None) -> dict:
        """Each API's framer defines this."""


class ChatFramer(_ChoiceFramer):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def start(self) -> bytes:
        if not self.req.stream:
            return b""
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}])

    def _logprobs_json(self, entries) -> dict:
        """OpenAI's chat shape: {"content": [{token, logprob, bytes, top_logprobs}]}."""
        def one(token: str, logprob: float) -> dict:
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        return {"content": [{**one(e.token, e.logprob),
                             "top_logprobs": [one(t, v) for t, v in e.top]} for e in entries]}

    def _visible_reasoning(self, delta: Delta) -> str:
        # vLLM's include_reasoning=false drops the reasoning text (it is still counted).
        return delta.reasoning if self.req.echo.get("include_reasoning", True) else ""

    def _stream_choice(self, text: str, reasoning: str) -> dict:
        message: dict = {"content": text}
        if reasoning:
            message["reasoning_content"] = reasoning
        return {"index": 0, "delta": message, "logprobs": None, "finish_reason": None}

    def _final_choice(self, finish_reason: FinishReason, stop_reason: str | int | None) -> dict:
        return {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason,
                "stop_reason": stop_reason}

    def _body_choice(self, text: str, reasoning: str, finish_reason: FinishReason,
                     stop_reason: str | int | None) -> dict:
        message: dict = {"role": "assistant", "content": text, "refusal": None}
        if reasoning:
            message["reasoning_content"] = reasoning
        return {"index": 0, "message": message, "logprobs": None,
                "finish_reason": finish_reason, "stop_reason": stop_reason}


class CompletionFramer(_ChoiceFramer):
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, req: RenderedRequest) -> None:
        super().__init__(req)
        self._offset = 0

    def _logprobs_json(self, entries) -> dict:
        """The legacy completions shape: parallel lists, top alternatives as {token: logprob}."""
        offsets = []
        for e in entries:
            offsets.append(self._offset)
            self._offset += len(e.token)
        return {"tokens": [e.token for e in entries],
                "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [dict(e.top) for e in entries],
                "text_offset": offsets}

    def _visible_reasoning(self, delta: Delta) -> str:
        return ""    # completions have no reasoning field

    def _stream_choice(self, text: str, reasoning: str) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": None}

    def _final_choice(self, finish_reason: FinishReason, stop_reason: str | int | None) -> dict:
        return {"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason,
                "stop_reason": stop_reason}

    def _body_choice(self, text: str, reasoning: str, finish_reason: FinishReason,
                     stop_reason: str | int | None) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                "stop_reason": stop_reason}


# -- Responses API -------------------------------------------------------------

class _OutputItem:
    """One output item of a Response: the reasoning, or the assistant message."""

    def __init__(self, kind: str, item_id: str, output_index: int) -> None:
        self.kind = kind                  # "reasoning" | "message"
        self.id = item_id
        self.output_index = output_index
        self.parts: list[str] = []
        self.status = "in_progress"       # -> "completed" | "incomplete"

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def part(self, text: str) -> dict:
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def json(self, *, with_content: bool = True) -> dict:
        content = [self.part(self.text)] if with_content else []
        if self.kind == "reasoning":
            return {"id": self.id, "type": "reasoning", "summary": [], "content": content,
                    "status": self.status}
        return {"id": self.id, "type": "message", "status": self.status, "role": "assistant",
                "content": content}


class ResponsesFramer(Framer):
    """OpenAI Responses API: a Response object, or its stream of typed events.

    Stream order: response.created, response.in_progress; per output item
    (reasoning first, when the model reasons, then the message):
    output_item.added, reasoning_part/content_part.added, *_text.delta...,
    *_text.done, reasoning_part/content_part.done, output_item.done; then one
    terminal event: response.completed, response.incomplete (max_output_tokens)
    or error + response.failed.
    """

    def __init__(self, req: RenderedRequest) -> None:
        super().__init__(req)
        self.id = f"resp_{req.request_id}"
        self._seq = 0
        self._items: list[_OutputItem] = []

    # -- state shared by both modes

    def _item(self, kind: str) -> tuple[_OutputItem, bool]:
        """The open item of this kind, creating it (closing the one before) if needed."""
        if self._items and self._items[-1].kind == kind and self._items[-1].status == "in_progress":
            return self._items[-1], False
        prefix = "rs_" if kind == "reasoning" else "msg_"
        item = _OutputItem(kind, f"{prefix}{self.req.request_id}", len(self._items))
        self._items.append(item)
        return item, True

    def _takes_reasoning(self) -> bool:
        # Reasoning after the answer has started cannot be shown in order; the
        # <think> parsers never produce it.
        return not any(item.kind == "message" for item in self._items)

    def _response(self, status: str, *, usage: Usage | None = None,
                  incomplete_reason: str | None = None, error: str | None = None) -> dict:
        echo = self.req.echo
        return {
            "id": self.id, "object": "response", "created_at": self.req.created,
            "status": status, "background": False,
            "error": None if error is None else {"code": "server_error", "message": error},
            "incomplete_details": (None if incomplete_reason is None
                                   else {"reason": incomplete_reason}),
            "instructions": echo.get("instructions"),
            "max_output_tokens": echo.get("max_output_tokens"),
            "max_tool_calls": None,
            "model": self.req.model,
            "output": [item.json() for item in self._items],
            "parallel_tool_calls": echo.get("parallel_tool_calls", True),
            "previous_response_id": None,
            "reasoning": echo.get("reasoning", {"effort": None, "summary": None}),
            "store": False,
            "temperature": echo.get("temperature", self.req.sampling.options.temperature),
            "text": {"format": {"type": "text"}},
            "tool_choice": echo.get("tool_choice", "auto"),
            "tools": [],
            "top_p": echo.get("top_p", self.req.sampling.options.top_p),
            "truncation": "disabled",
            "usage": None if usage is None else responses_usage_json(usage),
            "user": echo.get("user"),
            "metadata": echo.get("metadata", {}),
        }

    def _final(self, delta: Delta) -> dict:
        """Close every item and build the terminal Response (not for errors)."""
        message, _ = self._item("message")
        incomplete = delta.finish_reason == FinishReason.LENGTH
        for item in self._items:
            item.status = "completed"
        if incomplete:
            message.status = "incomplete"
            return self._response("incomplete", usage=delta.usage,
                                  incomplete_reason="max_output_tokens")
        return self._response("completed", usage=delta.usage)

    # -- streaming events

    def _event(self, type_: str, **fields: Any) -> bytes:
        data = {"type": type_, "sequence_number": self._seq, **fields}
        self._seq += 1
        return b"event: " + type_.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def _where(self, item: _OutputItem) -> dict:
        return {"item_id": item.id, "output_index": item.output_index, "content_index": 0}

    def _added(self, item: _OutputItem) -> bytes:
        part_event = ("response.reasoning_part.added" if item.kind == "reasoning"
                      else "response.content_part.added")
        return (self._event("response.output_item.added", output_index=item.output_index,
                            item=item.json(with_content=False))
                + self._event(part_event, **self._where(item), part=item.part("")))

    def _text_delta(self, item: _OutputItem, text: str) -> bytes:
        item.parts.append(text)
        if item.kind == "reasoning":
            return self._event("response.reasoning_text.delta", **self._where(item),
                               delta=text)
        return self._event("response.output_text.delta", **self._where(item), delta=text,
                           logprobs=[])

    def _done(self, item: _OutputItem) -> bytes:
        text = item.text
        if item.kind == "reasoning":
            text_done = self._event("response.reasoning_text.done", **self._where(item),
                                    text=text)
            part_done = self._event("response.reasoning_part.done", **self._where(item),
                                    part=item.part(text))
        else:
            text_done = self._event("response.output_text.done", **self._where(item),
                                    text=text, logprobs=[])
            part_done = self._event("response.content_part.done", **self._where(item),
                                    part=item.part(text))
        return text_done + part_done + self._event(
            "response.output_item.done", output_index=item.output_index, item=item.json())

    def _open(self, kind: str) -> tuple[_OutputItem, bytes]:
        """The open item of this kind, with the events that close the previous
        item and announce a new one, when one is needed."""
        previous = self._items[-1] if self._items else None
        item, new = self._item(kind)
        if not new:
            return item, b""
        out = b""
        if previous is not None and previous.status == "in_progress":
            previous.status = "completed"
            out = self._done(previous)
        return item, out + self._added(item)

    # -- Framer API

    def start(self) -> bytes:
        if not self.req.stream:
            return b""
        created = self._response("in_progress")
        return (self._event("response.created", response=created)
                + self._event("response.in_progress", response=created))

    def _stream(self, delta: Delta) -> bytes:
        out = []
        if delta.reasoning and self._takes_reasoning():
            item, opened = self._open("reasoning")
            out += [opened, self._text_delta(item, delta.reasoning)]
        reason = delta.finish_reason
        if delta.content or (reason is not None and reason != FinishReason.ERROR):
            item, opened = self._open("message")
            out.append(opened)
            if delta.content:
                out.append(self._text_delta(item, delta.content))
        if reason == FinishReason.ERROR:
            message = delta.error or "The engine failed."
            for item in self._items:
                if item.status == "in_progress":
                    item.status = "incomplete"
            out.append(self._event("error", code="server_error", message=message, param=None))
            out.append(self._event("response.failed", response=self._response(
                "failed", usage=delta.usage, error=message)))
        elif reason is not None:
            message_item = self._items[-1]
            response = self._final(delta)
            out.append(self._done(message_item))
            terminal = ("response.incomplete" if response["status"] == "incomplete"
                        else "response.completed")
            out.append(self._event(terminal, response=response))
        return b"".join(out)

    def _accumulate(self, delta: Delta) -> bytes:
        if delta.reasoning and self._takes_reasoning():
            self._item("reasoning")[0].parts.append(delta.reasoning)
        if delta.content:
            self._item("message")[0].parts.append(delta.content)
        if delta.finish_reason is None:
            return b""
        if delta.finish_reason == FinishReason.ERROR:
            self.status = 500
            return orjson.dumps(server_error_json(delta.error))
        return orjson.dumps(self._final(delta))


_FRAMERS: dict[str, type[Framer]] = {
    "chat": ChatFramer,
    "completions": CompletionFramer,
    "responses": ResponsesFramer,
}


# --------------------------------------------------------------------------
# Async shell (the lead's): async def run(...) goes below this line.
# --------------------------------------------------------------------------


@attrs.frozen
class ReplyEnd:
    """The last item on a reply channel: the HTTP status of a non-streaming reply."""
    status: int


class Emitter:
    """The pure core: one Framer per request; (request_id, bytes | ReplyEnd) out."""

    def __init__(self) -> None:
        self.framers: dict[str, Framer] = {}

    def process(self, msg: Step) -> list[tuple[str, bytes | ReplyEnd]]:
        out: list[tuple[str, bytes | ReplyEnd]] = []
        for req in msg.new_requests:
            f = self.framers[req.request_id] = Framer(req)
            start = f.start()
            if start:
                out.append((req.request_id, start))
        for d in msg.deltas:
            f = self.framers.get(d.request_id)
            if f is None:
                continue
            data = f.on_delta(d)
            if data:
                out.append((d.request_id, data))
            if f.finished:
                del self.framers[d.request_id]
                out.append((d.request_id, ReplyEnd(f.status)))
        return out


async def run(receive, replies, core: Emitter, log=None) -> None:
    async with receive:
        async for msg in receive:
            for rid, item in core.process(msg):
                if log is not None:
                    if isinstance(item, ReplyEnd):
                        log("reply_end", request_id=rid, status=item.status)
                    else:
                        log("emitted", request_id=rid, data=item.decode())
                replies.send(rid, item)
                if isinstance(item, ReplyEnd):
                    replies.release(rid)
