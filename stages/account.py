"""account: usage (prompt, completion, reasoning, cached tokens) and timings."""
from __future__ import annotations

import attrs
import trio

from stages.detokenize import TokenLogprob
from stages.parse import ParsedStep
from stages.render import RenderedRequest


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@attrs.frozen
class RequestDelta:
    """What one engine step produced for one request, ready for framing."""
    request_id: str
    text: str                          # new content text
    reasoning: str                     # new reasoning text ("" without a reasoning parser)
    token_ids: tuple[int, ...]         # tokens sampled this step
    finish_reason: str | None          # None while running; "stop" | "length" | "abort" | "error"
    usage: Usage                       # running totals; final when finish_reason is set
    stop_reason: str | int | None = None   # the stop string or stop token id that matched
    error: str | None = None           # engine failure message when finish_reason == "error"
    logprobs: tuple[TokenLogprob, ...] = ()   # one per token of token_ids, when asked for


@attrs.frozen
class AccountedStep:
    new_requests: tuple[RenderedRequest, ...]
    deltas: tuple[RequestDelta, ...]


class _RequestUsage:
    __slots__ = ("prompt", "completion", "reasoning", "arrival")

    def __init__(self, req: RenderedRequest) -> None:
        self.prompt = len(req.prompt_token_ids)
        self.completion = 0
        self.reasoning = 0
        self.arrival = req.arrival


class Accountant:
    """The pure core: per-request usage, plus server-wide counters for /metrics."""

    def __init__(self) -> None:
        self.requests: dict[str, _RequestUsage] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.cached_tokens_total = 0
        self.finished_total: dict[str, int] = {}

    def process(self, msg: ParsedStep) -> tuple[AccountedStep, list[tuple[str, Usage, str]]]:
        """Returns the accounted step and the (request_id, usage, reason) of finished requests."""
        for req in msg.new_requests:
            self.requests[req.request_id] = _RequestUsage(req)
        deltas, finished = [], []
        for d in msg.deltas:
            u = self.requests.get(d.request_id)
            if u is None:
                continue
            n = len(d.token_ids)
            u.completion += n
            if d.reasoning and not d.content:
                u.reasoning += n
            self.generation_tokens_total += n
            usage = Usage(u.prompt, u.completion, d.num_cached_tokens, u.reasoning)
            if d.finish_reason is not None:
                del self.requests[d.request_id]
                self.prompt_tokens_total += u.prompt
                self.cached_tokens_total += d.num_cached_tokens
                self.finished_total[d.finish_reason] = self.finished_total.get(d.finish_reason, 0) + 1
                finished.append((d.request_id, usage, d.finish_reason))
            deltas.append(RequestDelta(d.request_id, d.content, d.reasoning, d.token_ids,
                                       d.finish_reason, usage, d.stop_reason, d.error, d.logprobs))
        return AccountedStep(msg.new_requests, tuple(deltas)), finished


async def run(receive: trio.MemoryReceiveChannel, send: trio.MemorySendChannel,
              core: Accountant, log=None) -> None:
    async with receive, send:
        async for msg in receive:
            out, finished = core.process(msg)
            if log is not None:
                for rid, usage, reason in finished:
                    log("finished", request_id=rid, finish_reason=reason,
                        prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                        cached_tokens=usage.cached_tokens, reasoning_tokens=usage.reasoning_tokens)
            await send.send(out)
