"""A cheaper socket write under Hypercorn, for hundreds of SSE streams.

Hypercorn's trio worker writes every chunk of a response with ``send_all`` on the
connection's trio stream, under a ``trio.Lock`` and a shielded cancel scope: with
the socket's own send that was about half the server's CPU per SSE event at 256
streams (scripts/bench_sse_write.py, docs/benchmarks.md "One SSE write").
Nearly every such write fits in the socket's send buffer at once, so
``FastWriteTCPServer`` tries it directly, without awaiting; only a write the kernel
cannot take whole (or a TLS stream, or a write while another is under way) takes
Hypercorn's path, with whatever bytes are left.

Order and atomicity stay Hypercorn's: the direct write happens only while no other
write holds the lock, and it runs to completion without yielding, so no other task's
bytes can come between. A closed or broken socket falls through to Hypercorn's path,
which reports ``Closed`` to the protocol as before.

A body chunk of a chunked response (every SSE event) also skips h11's event machinery
(``ChunkedH11Protocol``): Hypercorn builds an ``h11.Data`` for it, and h11 runs its state
machine (which a ``Data`` in ``SEND_BODY`` leaves where it is) and then its
``ChunkedWriter``, which frames the bytes as ``%x\r\n<data>\r\n``. That was about a
fifth of the server's CPU per SSE event (py-spy, scripts/bench_sse_write.py); the same
bytes are framed here, whenever h11's own writer for the response is the chunked one and
the connection is in ``SEND_BODY``. Anything else (a Content-Length body, HTTP/1.0, the
end of a message, an error state) goes through h11 as before.

An SSE reply's chunks can skip the request's task altogether (``DirectBody``): while the
task that streams the reply has written everything it was given and waits for more, the
task that has the next chunk (emit, once per engine step for every stream) frames it and
writes it to the socket itself, as ``ChunkedH11Protocol`` and ``FastWriteTCPServer`` would.
The request's task then does not wake, and Quart's body loop, the ASGI wrappers,
Hypercorn's ``HTTPStream.app_send`` and the memory channel's hop stay out of the way of
each event. stages/replies.py ``Replies.send`` decides when (pipeline/core/reply.py arms it).
"""

from __future__ import annotations

import os
from contextvars import ContextVar

import h11
import trio
from h11._writers import ChunkedWriter
from hypercorn.events import RawData
from hypercorn.protocol.events import Body
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.tcp_server import TCPServer


class ChunkedH11Protocol(H11Protocol):
    """Hypercorn's HTTP/1.1 protocol, framing a chunked body's bytes without h11's events."""

    async def stream_send(self, event) -> None:
        if type(event) is Body:
            conn = self.connection
            # h11 frames Data with its writer for the response: chunked framing alone is
            # ours to copy (a Content-Length writer counts, HTTP/1.0's writes as is)
            if type(getattr(conn, "_writer", None)) is ChunkedWriter and conn.our_state is h11.SEND_BODY:
                data = event.data
                if data:   # as ChunkedWriter: an empty chunk would read as the end
                    await self.send(RawData(data=b"%x\r\n%b\r\n" % (len(data), data)))
                return
        await super().stream_send(event)


DIRECT_WRITES = True      # False: every chunk through the request's task (tests compare the two)

# The connection's server, seen by the request tasks Hypercorn starts from its reading task
_CONNECTION: ContextVar["FastWriteTCPServer | None"] = ContextVar("tailrace_connection",
                                                                  default=None)


class DirectBody:
    """Writes the body chunks of the chunked response under way on one HTTP/1.1 connection
    straight to its socket, from any task, without waiting (stages/replies.py calls it)."""

    __slots__ = ("server", "conn", "sock", "lock")

    def __init__(self, server: "FastWriteTCPServer", conn: h11.Connection) -> None:
        self.server = server
        self.conn = conn
        self.sock = server.stream.socket
        self.lock = server.send_lock

    def ready(self) -> bool:
        """Is the response's head out, with a chunked body under way? Asked when its task
        has written all it had and lends this writer (pipeline/core/reply.py): only that
        task's writes move h11's state on, so it holds until the task writes again."""
        conn = self.conn
        return conn.our_state is h11.SEND_BODY and type(conn._writer) is ChunkedWriter

    def write(self, data: bytes) -> bool | bytes:
        """Frame `data` as one chunk (h11's ChunkedWriter's bytes) and write it now.
        True: it all went. False: nothing went (a write under way, a full or closed
        socket): send it the ordinary way. bytes: the socket took only a part; the rest
        must follow (`finish`) before anything else."""
        if self.lock.locked():
            return False
        fd = self.sock.fileno()   # -1 once closed: the number may be a new connection's
        if fd < 0 or not data:
            return False
        framed = b"%x\r\n%b\r\n" % (len(data), data)
        try:
            sent = os.write(fd, framed)
        except OSError:     # full (BlockingIOError) or broken: the ordinary path deals with it
            return False
        if sent == len(framed):
            return True
        return framed[sent:] if sent > 0 else False

    async def finish(self, rest: bytes) -> None:
        """The rest of a chunk `write` began: shielded, as Hypercorn shields its writes (a
        cut chunk would garble the stream)."""
        with trio.CancelScope(shield=True):
            await self.server.protocol_send(RawData(data=rest))


def direct_body() -> DirectBody | None:
    """The DirectBody of the current request's connection: a FastWriteTCPServer's plain
    TCP, HTTP/1.1 one (framed by ChunkedH11Protocol); else None. Call it from the request's
    task, before its response's first body chunk."""
    server = _CONNECTION.get()
    if not DIRECT_WRITES or server is None or type(server.stream) is not trio.SocketStream:
        return None
    protocol = getattr(getattr(server, "protocol", None), "protocol", None)
    if not isinstance(protocol, ChunkedH11Protocol):
        return None
    return DirectBody(server, protocol.connection)


class FastWriteTCPServer(TCPServer):
    """Hypercorn's per-connection server with a direct first attempt at each write, and
    ChunkedH11Protocol for an HTTP/1.1 connection."""

    async def _read_data(self) -> None:
        # The protocol exists from here (TCPServer.run built it), its first request not yet:
        # each request's stream binds the protocol's stream_send when it is made.
        wrapper = getattr(self, "protocol", None)
        if type(getattr(wrapper, "protocol", None)) is H11Protocol:
            wrapper.protocol.__class__ = ChunkedH11Protocol
        _CONNECTION.set(self)   # this task starts the request tasks: they inherit it
        await super()._read_data()

    async def protocol_send(self, event) -> None:
        if type(event) is RawData and not self.send_lock.locked():
            stream = self.stream
            # A closed socket's fileno() is -1: its number may already belong to a new connection.
            fd = stream.socket.fileno() if type(stream) is trio.SocketStream else -1
            if fd >= 0:
                data = event.data
                try:
                    sent = os.write(fd, data)
                except BlockingIOError:
                    sent = 0
                except OSError:
                    sent = -1  # Hypercorn's path meets the same error and closes the connection
                if sent == len(data):
                    return
                if sent > 0:
                    # The rest must follow, even if this task is cancelled meanwhile (as the
                    # write itself is shielded in Hypercorn): a cut chunk would garble the stream.
                    with trio.CancelScope(shield=True):
                        await super().protocol_send(RawData(data=data[sent:]))
                    return
        await super().protocol_send(event)
