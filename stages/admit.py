"""admit: queue limits and in-flight counts.

A request that will be refused is refused here, with its HTTP status, before the
response starts: too many requests in flight (503, like vLLM's overload answer), or a
request that could never fit in the whole KV cache (400).
"""
from __future__ import annotations

from typing import Callable

import attrs
import trio

from stages.render import RenderedRequest, RequestError
from stages.replies import Replies


@attrs.frozen
class Accepted:
    """Sent on the request's reply channel: the HTTP response may start."""
    request_id: str
    stream: bool


class Admission:
    def __init__(self, *, max_in_flight: int, kv_capacity_tokens: int,
                 in_flight: Callable[[], int]) -> None:
        self.max_in_flight = max_in_flight
        self.kv_capacity_tokens = kv_capacity_tokens
        self.in_flight = in_flight

    def check(self, req: RenderedRequest) -> RequestError | None:
        need = len(req.prompt_token_ids) + req.sampling.max_tokens
        if need > self.kv_capacity_tokens:
            return RequestError(
                f"The request needs up to {need} tokens of KV cache (prompt plus max_tokens), "
                f"more than the whole cache holds ({self.kv_capacity_tokens}). Reduce max_tokens "
                "or the prompt, or start the server with a larger KV cache.", param="max_tokens")
        if self.in_flight() > self.max_in_flight:
            return RequestError(f"The server is overloaded: more than {self.max_in_flight} requests "
                                "in flight. Retry later.", status=503, type="server_overloaded",
                                code="server_overloaded")
        return None


async def run(receive: trio.MemoryReceiveChannel, schedule: trio.MemorySendChannel,
              replies: Replies, core: Admission, log=None) -> None:
    async with receive, schedule:
        async for req in receive:
            if not replies.is_open(req.request_id):
                replies.release(req.request_id)  # the client left while it was rendered
                continue
            err = core.check(req)
            if err is not None:
                if log is not None:
                    log("rejected", request_id=req.request_id, status=err.status, message=err.message)
                replies.send(req.request_id, err)
                replies.release(req.request_id)
                continue
            # schedule's inbox is sized to hold every admitted request: never blocks long.
            await schedule.send(req)
            replies.send(req.request_id, Accepted(req.request_id, req.stream))
            if log is not None:
                log("admitted", request_id=req.request_id, prompt_tokens=len(req.prompt_token_ids),
                    max_tokens=req.sampling.max_tokens)
