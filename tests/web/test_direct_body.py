"""An SSE reply's chunks written by the step that has them (web/sse.py DirectBody, armed by
pipeline/core/reply.py, used by stages/replies.py): the bytes on the wire are those of the
ordinary path, through the request's task, Quart and Hypercorn, byte for byte."""
from __future__ import annotations

import trio

from pipeline.core.reply import Reply
from stages.emit import ReplyEnd, deliver
from stages.replies import Replies
from tests.support.fake_engine import FakeEngine
from web import sse


class StepEngine(FakeEngine):
    """FakeEngine whose streamed replies are real Replies channels, fed one scripted step
    at a time (as emit feeds them) once the reply's reader waits for more."""

    def __init__(self, steps) -> None:
        super().__init__()
        self.replies = Replies(64)
        self.steps = steps
        self.failure = None
        self.aborted = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def submit(self, api, body, request_id=None, headers=()):
        receive = self.replies.open(request_id)
        self.nursery.start_soon(self._feed, request_id, receive)
        return Reply(self, request_id, True, receive)

    async def _feed(self, rid: str, receive) -> None:
        for step in self.steps:
            # the reader waits with all it was given written (a big write may still be
            # under way while every task waits on the sockets: wait for the reader itself)
            with trio.fail_after(20):
                while not receive.statistics().tasks_waiting_receive:
                    await trio.sleep(0.001)
            if step is None:    # the engine stopped: the channel closes without an end
                self.replies.close_all()
                return
            deliver([(rid, item) for item in step], self.replies)


async def _wire(steps, direct: bool, monkeypatch) -> tuple[bytes, list]:
    """The raw response of one streamed POST /v1/completions, and what DirectBody.write
    returned each time."""
    from web.server import listen_socket, serve

    monkeypatch.setattr(sse, "DIRECT_WRITES", direct)
    results = []
    write = sse.DirectBody.write

    def counted(self, data):
        results.append(r := write(self, data))
        return r

    monkeypatch.setattr(sse.DirectBody, "write", counted)
    engine = StepEngine(steps)
    async with trio.open_nursery() as nursery:
        engine.nursery = nursery
        sock = listen_socket("127.0.0.1", 0)
        port = sock.getsockname()[1]
        await nursery.start(lambda task_status: serve(engine, sock, log_level="warning",
                                                       task_status=task_status))
        client = await trio.open_tcp_stream("127.0.0.1", port)
        body = b'{"prompt": "x", "stream": true}'
        await client.send_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                              b"Content-Type: application/json\r\nConnection: close\r\n"
                              b"Content-Length: %d\r\nX-Request-Id: r1\r\n\r\n%b" % (len(body), body))
        data = bytearray()
        with trio.fail_after(30):
            while chunk := await client.receive_some(1 << 16):
                data += chunk
                await trio.sleep(0)     # a slow reader: big chunks fill the socket
        await client.aclose()
        nursery.cancel_scope.cancel()
    return b"\r\n".join(line for line in bytes(data).split(b"\r\n")
                        if not line.lower().startswith(b"date:")), results


def _event(n: int, size: int = 0) -> bytes:
    return b'data: {"id":"cmpl-1","choices":[{"index":0,"text":"%d%b"}]}\n\n' % (n, b"x" * size)


STEPS = [[_event(0)], [_event(1), _event(2)], [_event(3)], [_event(4, 8 << 20)], [_event(5)],
         [_event(6)], [_event(7), b"data: [DONE]\n\n", ReplyEnd(200)]]


async def test_direct_writes_are_byte_for_byte_the_ordinary_path(monkeypatch):
    direct, results = await _wire(STEPS, True, monkeypatch)
    ordinary, none = await _wire(STEPS, False, monkeypatch)
    assert direct == ordinary
    assert none == []
    assert results.count(True) >= 4                          # steps written directly
    assert any(type(r) is bytes for r in results)            # the 8 MiB one only in part
    assert ordinary.startswith(b"HTTP/1.1 200") and ordinary.endswith(b"[DONE]\n\n\r\n0\r\n\r\n")
    # one chunk per step: a step's two events are one write
    assert b"\r\n" + b"%x" % len(_event(1) + _event(2)) + b"\r\n" + _event(1) + _event(2) in ordinary


async def test_a_stopped_engine_ends_a_direct_stream_as_the_ordinary_one(monkeypatch):
    steps = [[_event(0)], [_event(1)], None]
    direct, results = await _wire(steps, True, monkeypatch)
    ordinary, _ = await _wire(steps, False, monkeypatch)
    assert direct == ordinary and results == [True, True]
    assert b"The engine stopped" in ordinary and ordinary.endswith(b"0\r\n\r\n")


def test_a_step_delivers_each_request_one_item():
    replies = Replies(8)
    a, b = replies.open("a"), replies.open("b")
    deliver([("a", b"1"), ("b", b"x"), ("a", b"2"), ("a", ReplyEnd(200)), ("b", b"y")], replies)
    assert [a.receive_nowait(), a.receive_nowait()] == [b"12", ReplyEnd(200)]
    assert b.receive_nowait() == b"xy"
    assert "a" not in replies and "b" in replies
