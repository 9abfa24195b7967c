"""Each request's reply channel, keyed by request id, and the count of requests in flight.

web opens one per request and reads it; render and admit send a rejection or Accepted
on it, emit sends the framed bytes. A request's reply channel receives at most one
item per engine step (plus a start and an end item), and a request lives at most
max_model_len steps, so a buffer of max_model_len + 4 never fills: senders use
send_nowait and the engine never waits on a slow client.

An entry lives from ``open`` until ``release``: the stage that sees the request's last
message releases it (render or admit when they refuse or drop it, emit after its
final item). A client that leaves only ``detach``es its entry, so the request still
counts as in flight, and its id stays taken, until the pipeline has let go of it.
That count is what admission limits, and what sizes schedule's inbox.
"""
from __future__ import annotations

import trio


class Replies:
    def __init__(self, buffer: int) -> None:
        self.buffer = buffer
        self._send: dict[str, trio.MemorySendChannel | None] = {}   # None: the client left

    def __len__(self) -> int:
        return len(self._send)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._send

    def open(self, request_id: str) -> trio.MemoryReceiveChannel:
        if request_id in self._send:
            raise ValueError(f"request id {request_id!r} is already in flight")
        send, receive = trio.open_memory_channel(self.buffer)
        self._send[request_id] = send
        return receive

    def is_open(self, request_id: str) -> bool:
        """Is somebody still reading this request's reply?"""
        return self._send.get(request_id) is not None

    def send(self, request_id: str, item) -> bool:
        """Deliver without waiting; False when the client is gone."""
        ch = self._send.get(request_id)
        if ch is None:
            return False
        try:
            ch.send_nowait(item)
            return True
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.detach(request_id)
            return False

    def detach(self, request_id: str) -> None:
        """The client is gone: close its channel, keep counting the request."""
        ch = self._send.get(request_id)
        if ch is not None:
            ch.close()
            self._send[request_id] = None

    def release(self, request_id: str) -> None:
        """The pipeline is done with the request: forget it."""
        self.detach(request_id)
        self._send.pop(request_id, None)
