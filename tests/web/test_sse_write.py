"""web/sse.py: Hypercorn's connection server with a direct first write attempt."""

import trio
import trio.testing
from hypercorn.config import Config
from hypercorn.events import Closed, RawData

from web.sse import FastWriteTCPServer


class RecordingProtocol:
    def __init__(self):
        self.events = []

    async def handle(self, event):
        self.events.append(event)


def connection():
    ours, theirs = trio.socket.socketpair()
    server = FastWriteTCPServer(None, Config(), None, None, trio.SocketStream(ours))
    server.protocol = RecordingProtocol()
    return server, trio.SocketStream(theirs)


async def read_exactly(stream, n):
    data = bytearray()
    while len(data) < n:
        chunk = await stream.receive_some(1 << 16)
        assert chunk, "the connection ended early"
        data += chunk
        await trio.sleep(0)
    return bytes(data)


async def test_a_write_that_fits_goes_out_at_once_even_while_cancelled():
    """Hypercorn's own path would raise Cancelled at its lock before writing a byte."""
    server, peer = connection()
    with trio.CancelScope() as scope:
        scope.cancel()
        await server.protocol_send(RawData(b"data: 1\n\n"))
    assert not scope.cancelled_caught
    assert await peer.receive_some(100) == b"data: 1\n\n"


async def test_a_large_write_arrives_whole(nursery):
    server, peer = connection()
    big = bytes(range(256)) * (16 << 10)  # 4 MiB: more than the socket takes at once
    received = []

    async def reader():
        received.append(await read_exactly(peer, len(big)))

    with trio.fail_after(20):
        async with trio.open_nursery() as inner:
            inner.start_soon(reader)
            await server.protocol_send(RawData(big))
    assert received[0] == big
    assert server.protocol.events == []


async def test_a_write_waits_for_the_one_under_way(nursery):
    server, peer = connection()
    locked, go = trio.Event(), trio.Event()

    async def earlier_write():
        async with server.send_lock:  # as Hypercorn's own path holds it while it waits to write
            locked.set()
            await go.wait()
            await server.stream.send_all(b"first;")

    with trio.fail_after(10):
        async with trio.open_nursery() as inner:
            inner.start_soon(earlier_write)
            await locked.wait()
            inner.start_soon(server.protocol_send, RawData(b"second;"))
            await trio.testing.wait_all_tasks_blocked()  # the later write has had its chance
            go.set()
    assert await read_exactly(peer, 13) == b"first;second;"


async def test_a_partial_write_finishes_even_if_cancelled(nursery):
    """The rest of a write the socket took only in part must follow: a cut chunk garbles the stream."""
    server, peer = connection()
    big = b"x" * (8 << 20)
    received = []

    async def reader():
        received.append(await read_exactly(peer, len(big) + 4))

    with trio.fail_after(20):
        async with trio.open_nursery() as inner:
            inner.start_soon(reader)
            with trio.CancelScope() as scope:
                scope.cancel()
                await server.protocol_send(RawData(big))
            await server.protocol_send(RawData(b"tail"))
    assert received[0] == big + b"tail"


async def test_a_peer_that_went_away_reports_closed():
    server, peer = connection()
    await peer.aclose()
    with trio.fail_after(10):
        for _ in range(1000):
            await server.protocol_send(RawData(b"x" * 4096))
            if server.protocol.events:
                break
    assert any(isinstance(e, Closed) for e in server.protocol.events)


async def test_our_closed_socket_is_never_written_directly():
    """A closed socket's number may be reused by the next connection: fall back, and report Closed."""
    server, peer = connection()
    await server.stream.aclose()
    await server.protocol_send(RawData(b"x"))
    assert any(isinstance(e, Closed) for e in server.protocol.events)


# -- the whole connection: the bytes on the wire are Hypercorn's and h11's own ----------

async def _streamed(body_parts, headers, tcp_server_base, http_version=b"1.1"):
    """The raw bytes of one response, served by open_http with `tcp_server_base`."""
    import socket

    from web.app import LoadingGate
    from web.server import open_http

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for part in body_parts:
            await send({"type": "http.response.body", "body": part, "more_body": True})
            await trio.lowlevel.checkpoint()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    gate = LoadingGate()
    gate.open(app)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    port = sock.getsockname()[1]
    async with open_http(gate, sock, log_level="warning", tcp_server_base=tcp_server_base):
        client = await trio.open_tcp_stream("127.0.0.1", port)
        async with client:
            await client.send_all(b"GET /x HTTP/" + http_version + b"\r\nHost: x\r\n"
                                  b"Connection: close\r\n\r\n")
            data = bytearray()
            with trio.fail_after(10):
                while chunk := await client.receive_some(1 << 16):
                    data += chunk
        gate.stop_serving()
    # the Date header is the clock's
    return b"\r\n".join(line for line in bytes(data).split(b"\r\n")
                        if not line.lower().startswith(b"date:"))


PARTS = [b"data: {\"a\":1}\n\n", b"", b"data: " + b"x" * 70000 + b"\n\n", b"data: [DONE]\n\n"]


async def test_a_chunked_stream_is_byte_for_byte_hypercorns():
    from hypercorn.trio.tcp_server import TCPServer

    headers = [(b"content-type", b"text/event-stream")]
    ours = await _streamed(PARTS, headers, FastWriteTCPServer)
    assert ours == await _streamed(PARTS, headers, TCPServer)
    assert b"transfer-encoding: chunked" in ours.lower() and ours.endswith(b"0\r\n\r\n")


async def test_content_length_and_http_1_0_bodies_are_byte_for_byte_hypercorns():
    from hypercorn.trio.tcp_server import TCPServer

    size = sum(map(len, PARTS))
    sized = [(b"content-type", b"text/event-stream"), (b"content-length", b"%d" % size)]
    ours = await _streamed(PARTS, sized, FastWriteTCPServer)
    assert ours == await _streamed(PARTS, sized, TCPServer)
    assert ours.endswith(b"".join(PARTS))
    plain = [(b"content-type", b"text/event-stream")]
    ours = await _streamed(PARTS, plain, FastWriteTCPServer, http_version=b"1.0")
    assert ours == await _streamed(PARTS, plain, TCPServer, http_version=b"1.0")
    assert ours.endswith(b"".join(PARTS))


async def test_an_http_1_1_connection_frames_its_chunks_without_h11():
    import h11

    sent = []
    original = h11.Connection.send

    def spy(self, event):
        sent.append(type(event))
        return original(self, event)

    h11.Connection.send = spy
    try:
        await _streamed(PARTS, [(b"content-type", b"text/event-stream")], FastWriteTCPServer)
    finally:
        h11.Connection.send = original
    # the head and the end through h11; no body chunk
    assert sent == [h11.Response, h11.EndOfMessage]
