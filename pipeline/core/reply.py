"""One request's framed reply as web reads it (`Reply`), and how a stopped engine's error
reads in one line (`describe`)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from stages import emit
from stages.replies import Rest
from stages.api.framing import DONE, json_body, sse_data
from stages.api.common import server_error

if TYPE_CHECKING:
    from pipeline.core.engine import Engine


def describe(exc: BaseException | None) -> str:
    """One line for an error (a group of one is its member; of several, theirs joined)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(describe(e) for e in exc.exceptions)
    return "unknown error" if exc is None else f"{type(exc).__name__}: {exc}"


class Reply:
    """One request's framed reply. Iterate for bytes; aclose() aborts if unfinished.

    ``direct``: a writer of this reply's bytes straight to the client (web/sse.py
    ``DirectBody``: ``ready()``, ``write(bytes)``, ``finish(rest)``), set before iterating by a reader that passes every chunk on unchanged
    (web/app.py's SSE response). While the iteration waits with everything it yielded
    written, emit's bytes go through it (stages/replies.py ``Replies.arm``); the iteration
    yields only what came by the channel."""

    direct = None

    def __init__(self, engine: Engine, request_id: str, stream: bool,
                 receive: trio.MemoryReceiveChannel) -> None:
        self.engine = engine
        self.request_id = request_id
        self.stream = stream
        self.status = 200
        self._receive = receive
        self.finished = False

    def __aiter__(self):
        return self._iter()

    async def _iter(self):
        # Whatever has piled up since the reader last ran goes out as one chunk: when the
        # event loop is busier than one step per read (hundreds of streams), each stream
        # costs one socket write per read instead of one per engine step.
        receive, direct, rid = self._receive, self.direct, self.request_id
        replies = self.engine.replies if direct is not None else None
        while True:
            try:
                item = receive.receive_nowait()
            except trio.EndOfChannel:
                break
            except trio.WouldBlock:
                if replies is not None and direct.ready():   # all yielded is written
                    replies.arm(rid, direct)
                try:
                    item = await receive.receive()
                except trio.EndOfChannel:
                    break
                finally:
                    if replies is not None:
                        replies.disarm(rid)
            parts = []
            while True:
                if type(item) is Rest:    # a direct write's rest: before anything after it
                    if parts:
                        yield b"".join(parts)
                        parts = []
                    await item.finish()
                elif isinstance(item, emit.ReplyEnd):
                    self.status = item.status
                    self.finished = True
                else:
                    parts.append(item)
                try:
                    item = receive.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            if parts:
                yield parts[0] if len(parts) == 1 else b"".join(parts)
        if not self.finished:  # the channel closed before its last item: the engine stopped
            self.finished = True
            self.status = 500
            error = server_error(f"The engine stopped: {describe(self.engine.failure)}")
            yield sse_data(error) + DONE if self.stream else json_body(error)

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self])

    async def aclose(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)
        await self._receive.aclose()
