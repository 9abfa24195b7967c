"""emit: accounted deltas -> the bytes of each request's reply.

One Framer per request (its API's, from stages.api.APIS), chosen by `framer_for`: `start()` gives
the bytes to send as soon as the request is admitted, `on_delta()` the bytes for one
engine step. The framing is a pure function of the deltas, so replaying the event log
reproduces a reply byte for byte.
"""
from __future__ import annotations

import attrs

from stages.api import APIS
from stages.api.framing import Framer
from stages.api.pooling import PoolingFramer
from stages.messages import RenderedRequest, Step

def framer_for(req: RenderedRequest) -> Framer:
    if req.pooling is not None:
        return PoolingFramer(req)
    try:
        framer = APIS[req.api].framer
    except KeyError:
        raise ValueError(f"no framer for api {req.api!r}") from None
    return framer(req)


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
            f = self.framers[req.request_id] = framer_for(req)
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


async def run(receive, replies, core: Emitter, log=None, held=None) -> None:
    """`held`: a stages.stream_interval.StreamInterval (--stream-interval > 1)."""
    async with receive:
        async for msg in receive:
            items = core.process(msg)
            if log is not None:   # one call per step (the step's bytes, and the replies that ended)
                log("emitted", items=items)
            if held is not None:
                items = held.route(msg, items)
            deliver(items, replies)


def deliver(items: list[tuple[str, bytes | ReplyEnd]], replies) -> None:
    """One step's items to the reply channels: each request's bytes of the step as one
    item (its start and first delta, several choices' chunks), so one socket write per
    stream per step whoever writes it (stages/replies.py), then its end, if it ended."""
    step: dict[str, bytes] = {}
    for rid, item in items:
        if type(item) is bytes:
            before = step.get(rid)
            step[rid] = item if before is None else before + item
        else:
            data = step.pop(rid, None)
            if data is not None:
                replies.send(rid, data)
            replies.send(rid, item)
            if isinstance(item, ReplyEnd):
                replies.release(rid)
    for rid, data in step.items():
        replies.send(rid, data)
