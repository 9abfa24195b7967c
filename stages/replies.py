"""Each request's reply channel, keyed by request id.

web opens one per request and reads it; render and admit send a rejection or
Accepted on it, emit sends the framed bytes. A request's reply channel receives at
most one item per engine step (plus a start and an end item), and a request lives at
most max_model_len steps, so a buffer of max_model_len + 4 never fills: senders use
send_nowait and the engine never waits on a slow client.
"""
from __future__ import annotations

import trio


class Replies:
    def __init__(self, buffer: int) -> None:
        self.buffer = buffer
        self._send: dict[str, trio.MemorySendChannel] = {}

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
        return request_id in self._send

    def send(self, request_id: str, item) -> bool:
        """Deliver without waiting; False when the client is gone."""
        ch = self._send.get(request_id)
        if ch is None:
            return False
        try:
            ch.send_nowait(item)
            return True
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.close(request_id)
            return False

    def close(self, request_id: str) -> None:
        ch = self._send.pop(request_id, None)
        if ch is not None:
            ch.close()
