"""A small HTTP/1.1 client on trio sockets, for the benchmark's streamed POSTs.

httpx spends tens of µs of CPU per streamed chunk in its layers (anyio, httpcore,
h11, the decoders), which made the client, not the server, the bottleneck at a few
hundred streams (docs/benchmarks.md, "The benchmark client's cost"). This client does
only what `bench serve` needs: a POST with a body, a response head, and a body framed
by chunked encoding, Content-Length or the connection's end, read with one ``recv`` per
readiness and handed on whole, so the caller takes one timestamp per read.

It speaks the subset of httpx's streaming interface that ``send_request`` uses
(``stream(...)``, ``status_code``, ``aread``, ``aiter_bytes``) and raises httpx's
exception types, so the request code and its error messages are the same with either.
Plain ``http://`` only; ``https://`` targets go through httpx (``serve.open_client``).
Idle connections are kept per host and port and reused, as aiohttp's pool does for
vLLM's ``bench serve``.
"""

from __future__ import annotations

import socket
from contextlib import asynccontextmanager
from typing import AsyncIterator
from urllib.parse import urlsplit

import httpx
import trio

_RECV_SIZE = 1 << 18
_MAX_HEAD = 1 << 16
_USER_AGENT = b"tailrace-bench"


class ChunkedDecoder:
    """Feed raw body bytes in any split; get back the payload bytes each feed completed.

    ``done`` once the last (zero-size) chunk and its trailer section have arrived;
    bytes after that are ``extra`` (they can only come from a misbehaving server).
    """

    def __init__(self) -> None:
        self._buffer = b""
        self._left = 0  # payload bytes still due in the current chunk
        self._state = 0  # 0: size line next, 1: payload, 2: CRLF after payload, 3: trailer lines
        self.done = False
        self.extra = b""

    def feed(self, data: bytes) -> bytes:
        buf = self._buffer + data if self._buffer else data
        out: list[bytes] = []
        pos = 0
        end = len(buf)
        state = self._state
        while pos < end:
            if state == 1:
                take = min(self._left, end - pos)
                out.append(buf[pos : pos + take])
                pos += take
                self._left -= take
                if self._left == 0:
                    state = 2
            elif state == 2:
                if end - pos < 2:
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise httpx.RemoteProtocolError("malformed chunked body: no CRLF after a chunk")
                pos += 2
                state = 0
            else:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    if end - pos > _MAX_HEAD:
                        raise httpx.RemoteProtocolError("malformed chunked body: line too long")
                    break
                line = buf[pos:eol]
                pos = eol + 2
                if state == 3:
                    if not line:  # the blank line that ends the trailer section
                        self.done = True
                        self.extra = buf[pos:]
                        pos = end
                    continue
                size = line.split(b";", 1)[0].strip()
                try:
                    self._left = int(size, 16)
                except ValueError:
                    raise httpx.RemoteProtocolError(f"malformed chunked body: chunk size {size[:20]!r}") from None
                if self._left < 0:
                    raise httpx.RemoteProtocolError("malformed chunked body: negative chunk size")
                state = 1 if self._left else 3
        self._state = state
        self._buffer = buf[pos:] if pos < end else b""
        return b"".join(out) if len(out) != 1 else out[0]


class _Connection:
    """One socket and the bytes read past what has been consumed."""

    def __init__(self, sock: socket.socket, key: tuple[str, int], reused: bool) -> None:
        self.sock = sock
        self.key = key
        self.reused = reused

    async def recv(self, timeout: float | None) -> bytes:
        """Wait for readiness first, then read: when the client keeps up, a read
        tried first would nearly always fail (EAGAIN), a wasted syscall per event."""
        sock = self.sock
        while True:
            if timeout is None:
                await trio.lowlevel.wait_readable(sock)
            else:
                with trio.move_on_after(timeout) as scope:
                    await trio.lowlevel.wait_readable(sock)
                if scope.cancelled_caught:
                    raise httpx.ReadTimeout(f"no data for {timeout} s")
            try:
                return sock.recv(_RECV_SIZE)
            except BlockingIOError:
                continue
            except OSError as exc:
                raise httpx.ReadError(f"{type(exc).__name__}: {exc}") from None

    async def send_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                sent = self.sock.send(view)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self.sock)
                continue
            except OSError as exc:
                raise httpx.WriteError(f"{type(exc).__name__}: {exc}") from None
            view = view[sent:]
        await trio.lowlevel.checkpoint()

    def is_idle_and_open(self) -> bool:
        """A pooled connection the server has not closed (nor written to) meanwhile."""
        try:
            return self.sock.recv(1, socket.MSG_PEEK) is None
        except BlockingIOError:
            return True
        except OSError:
            return False

    def close(self) -> None:
        self.sock.close()


def _parse_head(head: bytes) -> tuple[int, dict[bytes, bytes]]:
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise httpx.RemoteProtocolError(f"malformed status line {lines[0][:80]!r}")
    headers: dict[bytes, bytes] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon:
            raise httpx.RemoteProtocolError(f"malformed header line {line[:80]!r}")
        key = name.strip().lower()
        value = value.strip()
        # Repeated headers join with a comma (RFC 9110 5.3); only the framing ones matter here.
        headers[key] = headers[key] + b", " + value if key in headers else value
    return int(parts[1]), headers


class Response:
    """A response whose head has been read; the body is read by ``aiter_bytes`` or ``aread``."""

    def __init__(self, conn: _Connection, status: int, headers: dict[bytes, bytes], rest: bytes,
                 read_timeout: float | None, head_only: bool) -> None:
        self.status_code = status
        self.headers = headers
        self._conn = conn
        self._rest = rest
        self._timeout = read_timeout
        self.complete = False  # the body ended by its framing, so the connection may be reused
        self._keep_alive = b"close" not in headers.get(b"connection", b"").lower()
        encoding = headers.get(b"transfer-encoding", b"").lower()
        self._chunked: ChunkedDecoder | None = None
        self._length: int | None = None
        if head_only or status in (204, 304) or 100 <= status < 200:
            self._length = 0
        elif encoding:
            if not encoding.endswith(b"chunked"):
                raise httpx.RemoteProtocolError(f"unsupported transfer-encoding {encoding!r}")
            self._chunked = ChunkedDecoder()
        elif b"content-length" in headers:
            try:
                self._length = int(headers[b"content-length"])
            except ValueError:
                raise httpx.RemoteProtocolError("malformed content-length") from None
        else:
            self._keep_alive = False  # the body runs to the connection's end

    @property
    def reusable(self) -> bool:
        return self.complete and self._keep_alive

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body, one piece per socket read (pieces that carried only framing are skipped)."""
        data, self._rest = self._rest, b""
        chunked = self._chunked
        left = self._length
        while True:
            if data:
                if chunked is not None:
                    piece = chunked.feed(data)
                    if chunked.done:
                        self.complete = not chunked.extra
                        if piece:
                            yield piece
                        return
                elif left is not None:
                    piece = data[:left]
                    left -= len(piece)
                else:
                    piece = data
                if piece:
                    yield piece
            if left == 0 and chunked is None:
                self.complete = len(data) <= len(piece) if data else True
                return
            data = await self._conn.recv(self._timeout)
            if not data:
                if chunked is None and left is None:
                    return  # delimited by the connection's end: a whole body
                raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")

    async def aread(self) -> bytes:
        return b"".join([piece async for piece in self.aiter_bytes()])


class StreamClient:
    """Streamed HTTP/1.1 requests over a pool of plain TCP connections."""

    def __init__(self, *, read_timeout: float | None = None, connect_timeout: float = 60.0) -> None:
        self.read_timeout = read_timeout
        self.connect_timeout = connect_timeout
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._addresses: dict[tuple[str, int], list[tuple]] = {}

    async def __aenter__(self) -> StreamClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
        await trio.lowlevel.checkpoint()

    async def _connect(self, key: tuple[str, int]) -> _Connection:
        host, port = key
        with trio.move_on_after(self.connect_timeout) as scope:
            addresses = self._addresses.get(key)
            if addresses is None:
                try:
                    infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                except OSError as exc:
                    raise httpx.ConnectError(f"{type(exc).__name__}: {exc}") from None
                addresses = self._addresses[key] = [(info[0], info[4]) for info in infos]
            error: OSError | None = None
            for family, address in addresses:
                sock = socket.socket(family, socket.SOCK_STREAM)
                sock.setblocking(False)
                try:
                    await trio.socket.from_stdlib_socket(sock).connect(address)
                except OSError as exc:
                    sock.close()
                    error = exc
                    continue
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return _Connection(sock, key, reused=False)
            raise httpx.ConnectError(f"{type(error).__name__}: {error}")
        assert scope.cancelled_caught
        raise httpx.ConnectTimeout(f"no connection to {host}:{port} in {self.connect_timeout} s")

    async def _checkout(self, key: tuple[str, int]) -> _Connection:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if conn.is_idle_and_open():
                conn.reused = True
                return conn
            conn.close()
        return await self._connect(key)

    async def _read_head(self, conn: _Connection) -> tuple[bytes, bytes]:
        data = b""
        while True:
            chunk = await conn.recv(self.read_timeout)
            if not chunk:
                raise httpx.RemoteProtocolError("server disconnected without sending a response")
            data += chunk
            head, sep, rest = data.partition(b"\r\n\r\n")
            if sep:
                return head, rest
            if len(data) > _MAX_HEAD:
                raise httpx.RemoteProtocolError("response head too long")

    @asynccontextmanager
    async def stream(self, method: str, url: str, *, content: bytes = b"",
                     headers: dict[str, str] | None = None) -> AsyncIterator[Response]:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise httpx.UnsupportedProtocol(f"StreamClient speaks plain http only, not {url!r}")
        key = (parts.hostname, parts.port or 80)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        request = _request_bytes(method, target, parts.netloc, content, headers or {})
        for attempt in (0, 1):
            conn = await (self._checkout(key) if attempt == 0 else self._connect(key))
            try:
                await conn.send_all(request)
                head, rest = await self._read_head(conn)
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
                conn.close()
                if conn.reused and attempt == 0:
                    continue  # the server dropped an idle connection as we reused it: once more, afresh
                raise
            except BaseException:
                conn.close()
                raise
            break
        try:
            status, response_headers = _parse_head(head)
            response = Response(conn, status, response_headers, rest, self.read_timeout, method == "HEAD")
        except BaseException:
            conn.close()
            raise
        try:
            yield response
        finally:
            if response.reusable:
                self._idle.setdefault(key, []).append(conn)
            else:
                conn.close()


def _request_bytes(method: str, target: str, netloc: str, content: bytes, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", f"Host: {netloc}", "Accept: */*", f"Content-Length: {len(content)}"]
    names = {"host", "accept", "content-length"}
    for name, value in headers.items():
        if any(c in name or c in value for c in "\r\n\0"):
            raise httpx.LocalProtocolError(f"header {name!r} holds a line break")
        if name.lower() in names:
            lines = [line for line in lines if not line.lower().startswith(name.lower() + ":")]
        lines.append(f"{name}: {value}")
    if not any(line.lower().startswith("user-agent:") for line in lines):
        lines.append("User-Agent: " + _USER_AGENT.decode())
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8") + content
