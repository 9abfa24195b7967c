"""The engine process's bookkeeping (pipeline/layouts/engine_proc.py), with no processes:
EngineReplies (who owns each request, the admitted count over every frontend) and `route`
(one frame per frontend per step, under the frontend's own ids)."""
from __future__ import annotations

import attrs
import trio

from pipeline.layouts.engine_proc import EngineReplies, Port, control, route
from pipeline.layouts.frontend import Balancer, EngineLink, RemoteEngine
from pipeline.layouts.wire import (NUDGE, ControlQuery, ControlReply, Refused, SleepState, outbox,
                                   unpack_step)
from stages.admit import Accepted
from stages.delta import Delta, FinishReason
from stages.messages import Control, Step
from stages.render import RequestError
from tests.support.rendered import rendered


class FakeLink:
    """Keeps the frames `route` sends."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.first: list = []            # what send_first queued, unpacked

    def send_first(self, msg) -> None:
        self.first.append(msg)

    async def send_frame(self, frame: bytes) -> None:
        self.frames.append(frame)


def _ports(n: int) -> list[Port]:
    ports = []
    for k in range(n):
        send, receive = outbox()
        ports.append(Port(k, FakeLink(), send, receive))
    return ports


def test_requests_are_named_by_frontend_and_answered_to_their_owner():
    ports = _ports(2)
    replies = EngineReplies(ports)
    a = replies.add(0, rendered("x"))
    b = replies.add(1, rendered("x"))          # the same local id on another frontend
    assert (a.request_id, b.request_id) == ("0:x", "1:x")
    replies.admit("0:x")
    replies.admit("0:x")                       # counted once
    assert replies.num_admitted == 1
    assert replies.send("0:x", Accepted("0:x", True))
    # ahead of any later frame on the link (the local id), and forward nudged to send it
    assert ports[0].link.first == [Accepted("x", True)]
    assert ports[0].pending_out.receive_nowait() is NUDGE
    assert replies.send("1:x", RequestError("too long", status=400, param="messages"))
    refused, = ports[1].link.first
    assert isinstance(refused, Refused) and refused.request_id == "x"
    assert (refused.status, refused.param) == (400, "messages")
    replies.release("1:x")                     # never admitted: the count stays
    assert replies.num_admitted == 1
    replies.release("0:x")
    assert replies.num_admitted == 0 and replies.of_frontend(0) == []


def test_an_abort_is_taken_once_and_only_for_an_admitted_request():
    replies = EngineReplies(_ports(1))
    replies.add(0, rendered("x"))
    assert not replies.mark_aborted("0:x")     # not admitted yet: admit drops it itself
    replies.admit("0:x")
    assert replies.mark_aborted("0:x")
    assert not replies.mark_aborted("0:x")
    assert not replies.mark_aborted("0:unknown")


def test_a_dead_frontend_gets_no_answers():
    ports = _ports(1)
    replies = EngineReplies(ports)
    replies.add(0, rendered("x"))
    ports[0].alive = False
    assert not replies.is_open("0:x")
    assert not replies.send("0:x", Accepted("0:x", False))


async def test_route_sends_each_frontend_its_own_deltas_and_releases_finished_requests():
    ports = _ports(3)
    replies = EngineReplies(ports)
    r0 = replies.add(0, attrs.evolve(rendered("a"), n=2))
    r1 = replies.add(1, rendered("a"))
    replies.add(2, rendered("idle"))
    for rid in ("0:a", "1:a", "2:idle"):
        replies.admit(rid)
    step = Step(7, new_requests=(r0, r1), deltas=(
        Delta("0:a", (5,), finish_reason=FinishReason.LENGTH, index=0),
        Delta("0:a", (6,), index=1),
        Delta("1:a", (9,), finish_reason=FinishReason.STOP)))
    send, receive = trio.open_memory_channel(1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(route, receive, replies)
        await send.send(step)
        await send.aclose()
    got = {k: unpack_step(memoryview(p.link.frames[0])[5:], {"a": "the request"})
           for k, p in enumerate(ports) if p.link.frames}
    assert set(got) == {0, 1}                  # frontend 2 had nothing in this step
    assert [(d.request_id, d.index, d.token_ids) for d in got[0].deltas] == [
        ("a", 0, (5,)), ("a", 1, (6,))]
    assert got[0].new_requests == ("the request",) and got[0].step == 7
    assert [(d.request_id, d.finish_reason) for d in got[1].deltas] == [("a", FinishReason.STOP)]
    # 1:a's only choice finished: released; 0:a has a choice left
    assert "1:a" not in replies.entries and "0:a" in replies.entries
    assert replies.num_admitted == 2


def _sent(port: Port) -> list:
    out = []
    while True:
        try:
            out.append(port.pending_out.receive_nowait())
        except trio.WouldBlock:
            return out


async def test_a_frontends_control_reaches_schedule_and_every_frontend_hears_the_sleep():
    """POST /sleep on frontend 1 (--api-server-count 3): a Control in schedule's inbox, its
    answer back to frontend 1, the engine's sleep state to all three (they refuse new
    requests while it falls asleep and sleeps); a reset is answered to its asker alone."""
    ports = _ports(3)
    ports[2].alive = False                 # a frontend that has gone hears nothing
    inbox, taken = trio.open_memory_channel(4)
    await control(ports[1], ControlQuery(5, "sleep", level=2), ports, 0, inbox.clone())
    msg = taken.receive_nowait()
    assert isinstance(msg, Control) and (msg.op, msg.level) == ("sleep", 2)
    assert _sent(ports[0]) == [SleepState(0, "falling")]
    assert _sent(ports[1]) == [SleepState(0, "falling")]
    msg.answer(None)                       # schedule: asleep
    assert _sent(ports[0]) == [SleepState(0, "asleep")]
    assert _sent(ports[1]) == [ControlReply(5, None), SleepState(0, "asleep")]
    await control(ports[0], ControlQuery(6, "wake_up"), ports, 0, inbox.clone())
    taken.receive_nowait().answer("no memory")     # a wake-up that failed: still asleep
    assert _sent(ports[0]) == [ControlReply(6, "no memory")] and _sent(ports[1]) == []
    await control(ports[0], ControlQuery(7, "reset_prefix_cache", reset_running=True), ports,
                  0, inbox.clone())
    msg = taken.receive_nowait()
    assert (msg.op, msg.reset_running) == ("reset_prefix_cache", True)
    msg.answer(True)
    assert _sent(ports[0]) == [ControlReply(7, True)] and _sent(ports[1]) == []
    assert _sent(ports[2]) == []


async def test_a_remote_engine_asks_every_engine_and_sleeps_when_all_do():
    """Data parallel 2: a frontend's control goes to both engines and is answered when
    both have (a reset only if both reset; a sleep's first error); the frontend is awake
    once both engines are, asleep once both are, falling between."""
    engines, outs = [], []
    for rank in range(2):
        send, receive = outbox()
        engines.append(EngineLink(rank, None, send))
        outs.append(receive)
    remote = RemoteEngine(model_names=("m",), max_model_len=8, replies=None, admission=None,
                          render_in=None, render_context=None, schedule_in=None, link=None,
                          accountant=None, outbox=engines[0].outbox, balancer=Balancer(engines))
    for op, kw, values, want in (
            ("reset_prefix_cache", {"reset_running": False}, (True, False), False),
            ("reset_prefix_cache", {"reset_running": True}, (True, True), True),
            ("sleep", {"level": 2}, (None, "busy"), "busy"),
            ("wake_up", {}, (None, None), None)):
        got = []

        async def ask():
            got.append(await remote.control(op, **kw))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            queries = [await out.receive() for out in outs]   # one query to each engine
            assert all(q == ControlQuery(queries[0].query + i, op, **kw)
                       for i, q in enumerate(queries))
            for q, value in zip(queries, values):
                assert got == []
                remote.answer(ControlReply(q.query, value))
        assert got == [want]
    assert remote._queries == {}
    assert remote.sleep_state == "awake"
    remote.told(engines[0], "falling")
    assert remote.sleep_state == "falling"
    remote.told(engines[0], "asleep")
    assert remote.sleep_state == "falling"       # engine 1 is still awake
    remote.told(engines[1], "asleep")
    assert remote.sleep_state == "asleep"
    remote.told(engines[0], "awake")
    assert remote.sleep_state == "falling"
    remote.told(engines[1], "awake")
    assert remote.sleep_state == "awake"
