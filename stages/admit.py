"""admit: queue limits and in-flight counts.

A request that will be refused is refused here, with its HTTP status, before the
response starts: too many requests admitted (503 with Retry-After, like vLLM's overload
answer), the server shutting down (503), or a request that could never fit in the whole
KV cache (400), or a structured-output constraint that does not parse (400; checked
here, in the engine's process, because xgrammar imports torch).

The limit counts admitted requests: from here until emit has sent their last byte
(stages/replies.py). At most ``--max-num-seqs`` of them run; the rest wait in schedule,
so ``max_admitted = --max-num-seqs + --max-queued-requests`` bounds the queue.
"""
from __future__ import annotations

from typing import Callable

import attrs
import trio

from gpu.interface import Constraint
from stages.api.structured import refusal as constraint_refusal
from stages.kv_transfer import notify_refused
from stages.messages import RenderedRequest
from stages.render import RequestError
from stages.replies import Replies


@attrs.frozen
class Accepted:
    """Sent on the request's reply channel: the HTTP response may start."""
    request_id: str
    stream: bool


def overloaded(max_admitted: int) -> RequestError:
    return RequestError(f"The server is overloaded: {max_admitted} requests are already running "
                        "or queued. Retry later.", status=503, type="server_overloaded",
                        code="server_overloaded")


def shutting_down() -> RequestError:
    return RequestError("The server is shutting down and accepts no new requests.", status=503,
                        type="server_unavailable", code="server_shutting_down")


class Admission:
    """The pure core. ``draining`` is set once, when the server starts shutting down."""

    def __init__(self, *, max_admitted: int, kv_capacity_tokens: int,
                 admitted: Callable[[], int],
                 grammar_check: Callable[[Constraint], None] | None = None) -> None:
        """grammar_check: raises GrammarError for a constraint that does not parse (the
        engine's grammar compiler's check); None: constraints are not checked here."""
        self.max_admitted = max_admitted
        self.grammar_check = grammar_check
        self.kv_capacity_tokens = kv_capacity_tokens
        self.admitted = admitted
        self.draining = False

    def refusal(self) -> RequestError | None:
        """What any new request would get now, whatever it asks for."""
        if self.draining:
            return shutting_down()
        if self.admitted() >= self.max_admitted:
            return overloaded(self.max_admitted)
        return None

    def check(self, req: RenderedRequest) -> RequestError | None:
        need = max(len(p) + m for p, m in zip(req.prompts or (req.prompt_token_ids,),
                                              req.prompt_max_tokens or (req.sampling.max_tokens,)))
        if need > self.kv_capacity_tokens:
            return RequestError(
                f"The request needs up to {need} tokens of KV cache (prompt plus max_tokens), "
                f"more than the whole cache holds ({self.kv_capacity_tokens}). Reduce max_tokens "
                "or the prompt, or start the server with a larger KV cache.", param="max_tokens")
        constraint = req.sampling.constraint
        if (constraint is not None and self.grammar_check is not None
                and (bad := constraint_refusal(constraint, self.grammar_check)) is not None):
            return bad
        return self.refusal()


async def run(receive: trio.MemoryReceiveChannel, schedule: trio.MemorySendChannel,
              replies: Replies, core: Admission, log=None) -> None:
    async with receive, schedule:
        async for req in receive:
            if not replies.is_open(req.request_id):
                if log is not None:
                    log("dropped", request_id=req.request_id)  # the client left while it was rendered
                replies.release(req.request_id)
                continue
            err = core.check(req)
            if err is not None:
                if log is not None:
                    log("rejected", request_id=req.request_id, status=err.status, message=err.message)
                replies.send(req.request_id, err)
                replies.release(req.request_id)
                kv = req.kv_transfer
                if kv is not None and kv.remote_prefill is not None:
                    notify_refused(kv.remote_prefill)   # the prefill side frees at once
                continue
            # schedule's inbox is sized to hold every admitted request: the send puts the
            # request in before it can yield, so an Abort can never overtake it.
            replies.admit(req.request_id)
            await schedule.send(req)
            replies.send(req.request_id, Accepted(req.request_id, req.stream))
            if log is not None:
                log("admitted", request_id=req.request_id, prompt_tokens=len(req.prompt_token_ids),
                    max_tokens=req.sampling.max_tokens)
