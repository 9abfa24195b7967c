"""What every API's framer shares: the Framer contract, SSE bytes, usage objects.

A Framer turns one request's deltas into the bytes of its reply. `start()` gives the
bytes to send as soon as the request is admitted; `on_delta()` the bytes for one engine
step. A streaming request gets Server-Sent Events; a non-streaming one gets nothing
until it finishes, then its whole JSON body. Framing is a pure function of the deltas,
so replaying the event log reproduces a reply byte for byte.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar

import attrs
import orjson

from stages.api.common import ABSENT, omit_absent, server_error, unstructure
from stages.delta import Delta, FinishReason, Usage
from stages.messages import RenderedRequest

DONE = b"data: [DONE]\n\n"

# HTTP status of a non-streaming reply whose client went away (nginx's
# "client closed request"); nobody reads it, but logs do.
STATUS_CLIENT_CLOSED = 499


# stands for the text in a chunk template (ChunkBytes.text), where it is the only string
_MARK = "\x00tailrace-text\x00"


def sse_data(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(unstructure(obj)) + b"\n\n"


def json_body(obj: Any) -> bytes:
    return orjson.dumps(unstructure(obj))


# -- usage objects: chat's and completions' (UsageInfo), the Responses API's (ResponseUsage)

@omit_absent
@attrs.frozen
class PromptTokensDetails:
    cached_tokens: int = 0
    created_cache_tokens: int = 0                  # written into the prefix cache (vLLM's)
    multimodal_tokens: dict[str, int] = ABSENT     # {"image": N} when the prompt had pictures


@attrs.frozen
class CompletionTokensDetails:
    reasoning_tokens: int = 0


@omit_absent
@attrs.frozen(kw_only=True)
class UsageInfo:
    """The chat/completions usage object (OpenAI's names, vLLM's details): as vLLM,
    prompt_tokens_details only with --enable-prompt-tokens-details, and the reasoning
    tokens only with a reasoning parser."""
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = ABSENT
    completion_tokens_details: CompletionTokensDetails = ABSENT


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


def usage_info(usage: Usage, req: RenderedRequest | None = None) -> UsageInfo:
    """prompt_tokens_details when the request's reply asks for them (render sets it under
    --enable-prompt-tokens-details), with multimodal_tokens when its prompt had pictures;
    completion_tokens_details when a reasoning parser is on (ReplySpec.reasoning_details)."""
    details = ABSENT
    if req is not None and req.reply.prompt_tokens_details:
        images = sum(im.length for im in req.images)
        details = PromptTokensDetails(usage.cached_tokens, usage.created_cache_tokens,
                                      {"image": images} if images else ABSENT)
    reasoning = req is not None and req.reply.reasoning_details
    return UsageInfo(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                     total_tokens=usage.total_tokens, prompt_tokens_details=details,
                     completion_tokens_details=CompletionTokensDetails(usage.reasoning_tokens)
                     if reasoning else ABSENT)


def response_usage(usage: Usage) -> ResponseUsage:
    return ResponseUsage(usage.prompt_tokens, InputTokensDetails(usage.cached_tokens),
                         usage.completion_tokens, OutputTokensDetails(usage.reasoning_tokens),
                         usage.total_tokens)


class ChunkBytes:
    """The SSE bytes of one request's stream chunks. Everything but `choices` (and the final
    `usage`) is the same in every chunk of a request, so it is serialised once, around
    the choices: one small orjson call per chunk on the hot path. With continuous usage
    every chunk has its own usage, and is serialised whole."""

    def __init__(self, template: Any, *, continuous_usage: bool = False) -> None:
        """`template`: the request's chunk with `choices=[]` (and its `usage`, if any)."""
        whole = orjson.dumps(unstructure(template))
        head, sep, tail = whole.partition(b'"choices":[]')
        assert sep, whole
        self.template = template
        self.continuous_usage = continuous_usage
        self.head = b"data: " + head + b'"choices":'
        self.tail = tail + b"\n\n"
        self._text: dict[int, tuple[bytes, bytes]] = {}   # see text()

    def __call__(self, choices: list, usage: Any = None, **fields: Any) -> bytes:
        """A chunk; `usage` (the usage so far) is used with continuous usage, `fields` are
        other top-level fields of this one chunk (prompt_token_ids)."""
        if fields or (self.continuous_usage and usage is not None):
            if self.continuous_usage and usage is not None:
                fields["usage"] = usage
            return sse_data(attrs.evolve(self.template, choices=choices, **fields))
        return self.head + orjson.dumps([unstructure(c) for c in choices]) + self.tail

    def text(self, index: int, text: str, choice: Callable[[int, str], Any]) -> bytes:
        """The chunk of choice `index` that differs from its others only in a string:
        `choice(index, text)` as `self([...])` frames it, from a template made once per
        choice. Most chunks of most streams are a running choice's new text."""
        parts = self._text.get(index)
        if parts is None:
            whole = orjson.dumps([unstructure(choice(index, _MARK))])
            mark = orjson.dumps(_MARK)
            before, sep, after = whole.partition(mark)
            assert sep and mark not in after, whole
            parts = self._text[index] = (self.head + before, after + self.tail)
        return parts[0] + orjson.dumps(text) + parts[1]

    def with_usage(self, usage: Any, metrics: Any = None) -> bytes:
        """The usage chunk: no choices, the final usage (and the request's metrics)."""
        extra = {} if metrics is None else {"metrics": metrics}
        return sse_data(attrs.evolve(self.template, usage=usage, **extra))


def error_bytes(delta: Delta) -> bytes:
    return json_body(server_error(delta.error))


class Framer(ABC):
    """Frames one request's reply. `finished` is set once the final bytes are produced;
    `status` is the HTTP status of a non-streaming reply (200, 500 on engine failure).

    A request of n choices finishes with its last choice: `closing` is true while the
    delta that finishes it is framed. An abort or an engine error ends the whole request
    at once; deltas after the end are dropped."""

    def __init__(self, req: RenderedRequest) -> None:
        self.req = req
        self.finished = False
        self.status = 200
        self.open_choices = req.num_choices
        self.closing = False

    def start(self) -> bytes:
        return b""

    def on_delta(self, delta: Delta) -> bytes:
        if self.finished:
            return b""
        reason = delta.finish_reason
        if reason is FinishReason.ABORT:
            # The client is gone: there is nobody to frame anything for.
            self.finished = True
            self.status = STATUS_CLIENT_CLOSED
            return b""
        if reason is not None:
            self.open_choices -= 1
            self.closing = self.open_choices == 0 or reason is FinishReason.ERROR
        out = self._stream(delta) if self.req.stream else self._accumulate(delta)
        self.finished = self.closing
        return out

    @abstractmethod
    def _stream(self, delta: Delta) -> bytes:
        """The SSE bytes for one step of a streaming reply (closing events included)."""

    @abstractmethod
    def _accumulate(self, delta: Delta) -> bytes:
        """Non-streaming: b"" until the request finishes, then the whole JSON body."""


# vLLM sends a logprob of -inf as this (JSON has no infinity).
MIN_LOGPROB = -9999.0


def prompt_logprobs_json(entries) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token null (the first) or {token id: {logprob,
    rank, decoded_token}} for the token itself and then the top alternatives."""
    out: list[dict | None] = []
    for e in entries:
        if e.logprob is None:
            out.append(None)
            continue
        d = {str(e.token_id): {"logprob": max(e.logprob, MIN_LOGPROB), "rank": e.rank,
                               "decoded_token": e.token}}
        for rank, (tid, text, lp) in enumerate(e.top, 1):
            d.setdefault(str(tid), {"logprob": max(lp, MIN_LOGPROB), "rank": rank,
                                    "decoded_token": text})
        out.append(d)
    return out


class ChoiceState:
    """What a non-streaming reply keeps of one choice until the request ends."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.logprobs: list = []
        self.token_ids: list[int] = []       # with return_token_ids
        self.tool_calls: list = []           # chat: ToolCallOut, from the parse stage
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None


class ChoicesFramer(Framer):
    """Chat's and completions' framing: stream chunks of the API's `chunk_type` that carry
    choices, a body of its `body_type` made of the choices kept in `_choices`. A subclass
    says what a finished choice's chunk (`_finish_choice`) and a body's choice
    (`_body_choice`) are, and what else its body has (`_body_fields`)."""

    chunk_type: ClassVar[type]
    body_type: ClassVar[type]
    _choices: list[ChoiceState]

    def __init__(self, req: RenderedRequest, reply_id: str) -> None:
        """Every chunk and the body have id `reply_id`."""
        super().__init__(req)
        self.id = reply_id
        # OpenAI: with include_usage every chunk has "usage", null but on the last.
        self._chunk = ChunkBytes(self.chunk_type(
            id=self.id, created=req.created, model=req.model, choices=[],
            **({"usage": None} if req.include_usage else {})),
            continuous_usage=req.continuous_usage)

    @abstractmethod
    def _finish_choice(self, delta: Delta) -> Any:
        """The choice of the chunk that finishes choice delta.index."""

    @abstractmethod
    def _body_choice(self, index: int, c: ChoiceState) -> Any:
        """Choice `index` of the body, from what was kept of it."""

    def _body_fields(self) -> dict[str, Any]:
        """Top-level fields of the body besides id, created, model, choices, usage, metrics."""
        return {}

    def _usage(self, usage: Usage) -> UsageInfo:
        return usage_info(usage, self.req)

    def _chunk_usage(self, delta: Delta) -> UsageInfo | None:
        """A chunk's usage with continuous usage stats: its choice's own counts (as vLLM;
        account's Usage.choice where the request has several choices), else None."""
        if not self.req.continuous_usage or delta.usage is None:
            return None
        usage = delta.usage
        return self._usage(usage.choice if usage.choice is not None else usage)

    def _stream_end(self, delta: Delta, usage: Any) -> list[bytes]:
        """The events that end a choice's stream (none while it runs): its finish chunk,
        then after the last choice's the usage chunk (include_usage) and [DONE]; an engine
        error instead ends the whole stream."""
        reason = delta.finish_reason
        if reason is FinishReason.ERROR:
            return [sse_data(server_error(delta.error)), DONE]
        if reason is None:
            return []
        out = [self._chunk([self._finish_choice(delta)], usage)]
        if self.closing:
            if self.req.include_usage:
                out.append(self._chunk.with_usage(self._usage(delta.usage), delta.metrics))
            out.append(DONE)
        return out

    def _body_end(self, delta: Delta) -> bytes:
        """Non-streaming, once the delta's own content is kept: its choice's finish noted;
        b"" until the request closes, then the whole body (or the engine's error)."""
        if delta.finish_reason is not None:
            c = self._choices[delta.index]
            c.finish_reason, c.stop_reason = delta.finish_reason, delta.stop_reason
        if not self.closing:
            return b""
        if delta.finish_reason is FinishReason.ERROR:
            self.status = 500
            return error_bytes(delta)
        return json_body(self.body_type(
            id=self.id, created=self.req.created, model=self.req.model,
            choices=[self._body_choice(i, c) for i, c in enumerate(self._choices)],
            usage=self._usage(delta.usage),
            **({} if delta.metrics is None else {"metrics": delta.metrics}),
            **({} if delta.kv_transfer_params is None
               else {"kv_transfer_params": delta.kv_transfer_params}),
            **self._body_fields()))
