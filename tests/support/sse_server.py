"""A scripted HTTP/1.1 SSE responder on 127.0.0.1, port 0, for bench tests.

A script maps each received request to a ``Reply``: a status and a list of
steps, each either bytes (written as one HTTP chunk) or a float (seconds to
sleep). ``truncate=True`` closes the connection without the final chunk.

Also what other bench tests share: ``LocalServer`` (the listening part, for servers of
their own), ``split_at`` (a stream cut anywhere) and ``FakeTokenizer``.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import orjson
import trio


@attrs.define
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)


@attrs.define
class Reply:
    steps: list[bytes | float] = attrs.Factory(list)
    status: int = 200
    truncate: bool = False
    content_type: str = "text/event-stream"


def sse(obj: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + orjson.dumps(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"


async def read_request(stream: trio.SocketStream, buffer: bytes = b"") -> tuple[Received | None, bytes]:
    """The next request on a connection (None if it closes first) and the bytes read past
    it; `buffer`: those left from the request before."""
    while b"\r\n\r\n" not in buffer:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return None, buffer
        buffer += chunk
    head, _, body = buffer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return None, b""
        body += chunk
    return Received(method, path, headers, body[:length]), body[length:]


class LocalServer:
    """A server on 127.0.0.1 and a free port: `await nursery.start(server.serve)` returns it
    listening; `_handle` answers each connection."""

    port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self)
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, stream: trio.SocketStream) -> None:
        raise NotImplementedError


class ScriptedServer(LocalServer):
    def __init__(self, script: Callable[[Received], Reply]) -> None:
        self.script = script
        self.received: list[Received] = []

    async def _handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            received, _ = await read_request(stream)
            if received is None:
                return
            self.received.append(received)
            reply = self.script(received)
            if reply.status != 200 or reply.content_type != "text/event-stream":
                payload = b"".join(s for s in reply.steps if isinstance(s, bytes))
                await stream.send_all(
                    f"HTTP/1.1 {reply.status} X\r\nContent-Type: {reply.content_type}\r\n"
                    f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
                return
            await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                  b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
            for step in reply.steps:
                if isinstance(step, float):
                    await trio.sleep(step)
                elif step:
                    await stream.send_all(b"%x\r\n" % len(step) + step + b"\r\n")
            if not reply.truncate:
                await stream.send_all(b"0\r\n\r\n")


def split_at(data: bytes, cuts) -> list[bytes]:
    """`data` in pieces, cut at each of `cuts` (modulo its length + 1; empty pieces kept)."""
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, last = [], 0
    for p in points + [len(data)]:
        pieces.append(data[last:p])
        last = p
    return pieces


def json_reply(status: int, obj: Any) -> Reply:
    return Reply(steps=[orjson.dumps(obj)], status=status, content_type="application/json")


class FakeTokenizer:
    """Whitespace words; ids are word indices ``w<i>``, unknown words hash into the vocab."""

    def __init__(self, vocab_size: int = 64) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = []
        for word in text.split():
            if word.startswith("w") and word[1:].isdigit() and int(word[1:]) < self.vocab_size:
                ids.append(int(word[1:]))
            else:
                ids.append(sum(word.encode()) % self.vocab_size)
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)
