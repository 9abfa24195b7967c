"""account: usage (prompt, completion, reasoning, cached tokens) and timings."""
from __future__ import annotations

import attrs
import trio

from stages.delta import Delta, FinishReason, Usage
from stages.schedule import Step
from stages.render import RenderedRequest

_with_usage = Delta.evolver("usage")


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
        self.finished_total: dict[FinishReason, int] = {}

    def process(self, msg: Step) -> tuple[Step, list[tuple[str, Usage, FinishReason]]]:
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
            deltas.append(_with_usage(d, usage))
        return attrs.evolve(msg, deltas=tuple(deltas)), finished


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
