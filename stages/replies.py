"""Each request's reply channel, keyed by request id, and the counts of requests in flight.

web opens one per request and reads it; render and admit send a rejection or Accepted
on it, emit sends the framed bytes. A request's reply channel receives at most one
item per engine step (plus a start and an end item), and a request lives at most
max_model_len steps, so a buffer of max_model_len + 4 never fills: senders use
send_nowait and the engine never waits on a slow client.

An entry lives from ``open`` until ``release``: the stage that sees the request's last
message releases it (render or admit when they refuse or drop it, emit after its
final item). A client that leaves only ``detach``es its entry, so the request still
counts as in flight, and its id stays taken, until the pipeline has let go of it.

An entry is ``admitted`` from the moment admit hands it to schedule until its release:
admission limits that count (``num_admitted``), and only an admitted request can have
anything of it in schedule's inbox. Each admitted request puts at most one request, one
``Abort`` (``mark_aborted`` says whether one was already sent) and one ``FinishRequest``
into that inbox, which is what sizes it.

A streamed reply's bytes may skip its channel (``arm``): while the reader has written all
it was given and waits for more, it lends its entry a direct writer (web/sse.py
``DirectBody``), and ``send`` writes a step's bytes with it at once, in the sender's task,
with no wake-up of the reader. Anything the writer cannot take whole, and every other item,
goes on the channel as before, and disarms the entry until the reader waits again: bytes
never overtake each other. A write the socket took only in part leaves its rest on the
channel first (``Rest``), for the reader to finish.
"""
from __future__ import annotations

import trio


class Rest:
    """The part of a directly written chunk the socket did not take: the reader finishes it
    (``await rest.finish()``) before anything else it writes."""
    __slots__ = ("writer", "data")

    def __init__(self, writer, data: bytes) -> None:
        self.writer = writer
        self.data = data

    async def finish(self) -> None:
        await self.writer.finish(self.data)


class _Entry:
    __slots__ = ("send", "admitted", "aborted", "direct")

    def __init__(self, send: trio.MemorySendChannel) -> None:
        self.send: trio.MemorySendChannel | None = send    # None: the client left
        self.admitted = False
        self.aborted = False
        self.direct = None     # the reader's writer while it waits with nothing unwritten


class Replies:
    def __init__(self, buffer: int) -> None:
        self.buffer = buffer
        self._entries: dict[str, _Entry] = {}
        self.num_admitted = 0
        self._emptied = trio.Event()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def open(self, request_id: str) -> trio.MemoryReceiveChannel:
        if request_id in self._entries:
            raise ValueError(f"request id {request_id!r} is already in flight")
        send, receive = trio.open_memory_channel(self.buffer)
        self._entries[request_id] = _Entry(send)
        return receive

    def is_open(self, request_id: str) -> bool:
        """Is somebody still reading this request's reply?"""
        entry = self._entries.get(request_id)
        return entry is not None and entry.send is not None

    def admit(self, request_id: str) -> None:
        """admit hands the request to schedule: it counts against the admission limit."""
        entry = self._entries[request_id]
        if not entry.admitted:
            entry.admitted = True
            self.num_admitted += 1

    def mark_aborted(self, request_id: str) -> bool:
        """True once for an admitted request: the caller sends its one Abort to schedule.
        False when it is not admitted (admit drops a detached request itself), already
        aborted, or no longer in flight."""
        entry = self._entries.get(request_id)
        if entry is None or not entry.admitted or entry.aborted:
            return False
        entry.aborted = True
        return True

    def admitted_ids(self) -> list[str]:
        return [rid for rid, e in self._entries.items() if e.admitted]

    def arm(self, request_id: str, writer) -> None:
        """The reader has written everything it received and waits: bytes may go through
        `writer` (its ``write(bytes) -> True | False | rest``) until the next item it is sent."""
        entry = self._entries.get(request_id)
        if entry is not None and entry.send is not None:
            entry.direct = writer

    def disarm(self, request_id: str) -> None:
        entry = self._entries.get(request_id)
        if entry is not None:
            entry.direct = None

    def send(self, request_id: str, item) -> bool:
        """Deliver without waiting; False when the client is gone."""
        entry = self._entries.get(request_id)
        if entry is None or entry.send is None:
            return False
        direct = entry.direct
        if direct is not None:
            if type(item) is bytes:
                done = direct.write(item)
                if done is True:
                    return True
                if done is not False:
                    item = Rest(direct, done)
            entry.direct = None      # the reader has something to do: no bytes may pass it
        try:
            entry.send.send_nowait(item)
            return True
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.detach(request_id)
            return False

    def detach(self, request_id: str) -> None:
        """The client is gone: close its channel, keep counting the request."""
        entry = self._entries.get(request_id)
        if entry is not None and entry.send is not None:
            entry.send.close()
            entry.send = None
            entry.direct = None

    def release(self, request_id: str) -> None:
        """The pipeline is done with the request: forget it."""
        self.detach(request_id)
        entry = self._entries.pop(request_id, None)
        if entry is not None and entry.admitted:
            self.num_admitted -= 1
        if not self._entries:
            self._emptied.set()

    def close_all(self) -> None:
        """The engine has stopped: close every reply channel (a reader sees its reply end
        without the final item) and forget every request."""
        for rid in list(self._entries):
            self.release(rid)

    async def wait_empty(self) -> None:
        """Until no request is in flight."""
        while self._entries:
            if self._emptied.is_set():
                self._emptied = trio.Event()
            await self._emptied.wait()
