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
"""

from __future__ import annotations

import os

import trio
from hypercorn.events import RawData
from hypercorn.trio.tcp_server import TCPServer


class FastWriteTCPServer(TCPServer):
    """Hypercorn's per-connection server with a direct first attempt at each write."""

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
