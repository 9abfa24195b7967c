"""A frontend process (--api-server-count): HTTP, render, detokenize, parse, account and
emit, and each request's Reply, over the wire (pipeline/layouts/wire.py) to the engine process
(pipeline/layouts/engine_proc.py), which admits, schedules and steps. Imports no torch.

    HTTP -> render -> [wire] -> admit -> schedule <=> gpu step          (engine process)
                                           | one Step frame per step
    HTTP <- emit <- account <- parse <- detokenize <- [wire]
                                           | FinishRequest (stop string), Abort
                                           +-> [wire] -> schedule's inbox

The request side is started as in one process (pipeline/core/assembly.py); only the
channels at the cut are the wire's: render's requests go to the engine instead of admit,
the engine's Steps come in instead of schedule's, and the back-edges (aborts, stop
strings) go out to the engine's schedule inbox. `RemoteEngine` is what web holds (pipeline/core/client.py): web cannot tell.

Admission is counted in the engine, exactly: its admit answers each request with
Accepted or a refusal, which the request's reply channel gets as in one process, so a
refusal still comes before the 200. A request counts until the engine has sent its last
delta. When the engine process goes away, every open reply ends with an error event and
[DONE], /health answers 503, and after the grace of pipeline/core/assembly.py `running`
the frontend stops (exit 1).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import pickle
from collections.abc import AsyncIterator

import attrs
import trio

from pipeline.core.assembly import running, start_request_side
from pipeline.core.client import EngineClient
from pipeline.core.events import EventLog
from pipeline.core.reply import describe
from pipeline.core.stats import AccountStats, EngineStats
from pipeline.layouts.wire import (STEP, AccountQuery, AccountReply, FrontendSetup, Link,
                                   Refused, StatsQuery, StatsReply, forward, outbox, unpack_step)
from stages import account
from stages.admit import Accepted, shutting_down
from stages.render import RequestError
from stages.lib.replies import Replies

log = logging.getLogger("tailrace")

STATS_TIMEOUT_S = 5.0


class EngineGone(RuntimeError):
    """The engine process closed its end of the wire (it exited or was killed)."""


class LocalAdmission:
    """A frontend refuses at once only while it drains; overload and KV capacity are
    the engine's admit's to decide (it counts every frontend's requests)."""

    def __init__(self) -> None:
        self.draining = False

    def refusal(self) -> RequestError | None:
        return shutting_down() if self.draining else None


@attrs.define(kw_only=True, eq=False)
class RemoteEngine(EngineClient):
    """The engine as a frontend's web sees it: the same calls as pipeline.core.engine.Engine."""

    link: Link
    accountant: account.Accountant
    outbox: trio.MemorySendChannel
    _queries: dict = attrs.field(factory=dict)
    _numbers: itertools.count = attrs.field(factory=itertools.count)

    async def fetch_stats(self) -> EngineStats:
        """The engine's stats with every frontend's accounting summed (the engine asks
        them all): /metrics adds up whichever frontend is scraped."""
        if self.failure is not None:
            return EngineStats()
        query = next(self._numbers)
        done = self._queries[query] = [trio.Event(), None]
        try:
            self.outbox.send_nowait(StatsQuery(query))
            with trio.move_on_after(STATS_TIMEOUT_S):
                await done[0].wait()
        finally:
            del self._queries[query]
        return done[1] if done[1] is not None else EngineStats()

    def answer(self, reply: StatsReply) -> None:
        waiting = self._queries.get(reply.query)
        if waiting is not None:
            waiting[1] = reply.stats
            waiting[0].set()


async def _send_requests(receive: trio.MemoryReceiveChannel, link: Link, replies: Replies,
                         requests: dict) -> None:
    """render -> the engine's admit: the RenderedRequest whole (plain data). It is kept
    here too, since Step frames name new requests by id."""
    async with receive:
        async for req in receive:
            rid = req.request_id
            if not replies.is_open(rid):   # the client left while it was rendered
                replies.release(rid)
                continue
            requests[rid] = req
            try:
                await link.send(req)
            except trio.BrokenResourceError:      # the engine has gone (_receive stops us)
                requests.pop(rid, None)
                replies.send(rid, RequestError(
                    "The engine stopped: the engine process has exited", status=503,
                    type="server_error", code="engine_stopped"))
                replies.release(rid)


async def _receive(link: Link, engine: RemoteEngine, steps: trio.MemorySendChannel,
                   requests: dict, events=None) -> None:
    """The engine's frames: admission answers onto reply channels, Steps to detokenize,
    stats queries and answers. When the engine goes, raise EngineGone: the frontend stops as at a
    failed stage (pipeline/core/assembly.py `running`).

    With an event log, each Step is logged as it arrived (`scheduled`, without the plan,
    which the engine's own file has), so this frontend's file replays on its own."""
    replies = engine.replies
    async with steps:
        while True:
            try:
                kind, payload = await link.receive_frame()
            except trio.EndOfChannel:
                break
            if kind == STEP:
                step = unpack_step(payload, requests)
                if events is not None:
                    events("scheduled", plan=None, preempted=(), message=step)
                await steps.send(step)
                continue
            msg = pickle.loads(payload)
            if isinstance(msg, Accepted):
                replies.admit(msg.request_id)
                if not replies.send(msg.request_id, msg):   # the client left meanwhile
                    engine._abort(msg.request_id, None)
            elif isinstance(msg, Refused):
                replies.send(msg.request_id, RequestError(
                    msg.message, status=msg.status, type=msg.type, param=msg.param,
                    code=msg.code))
                replies.release(msg.request_id)
                requests.pop(msg.request_id, None)
            elif isinstance(msg, StatsReply):
                engine.answer(msg)
            elif isinstance(msg, AccountQuery):
                engine.outbox.send_nowait(AccountReply(msg.query, AccountStats.of(engine.accountant)))
            else:
                raise TypeError(f"a frontend got {type(msg).__name__} from the engine")
    raise EngineGone("the engine process has exited")


@contextlib.asynccontextmanager
async def open_frontend(setup: FrontendSetup, link: Link) -> AsyncIterator[RemoteEngine]:
    """Start the frontend's request side over `link`, yield its RemoteEngine; on exit
    cancel it. EngineGone comes out of the block when the engine process goes away."""
    events = None
    if setup.event_log is not None:
        events = EventLog(setup.event_log, max_bytes=setup.event_log_max_bytes,
                          backup_count=setup.event_log_backup_count,
                          secrets=frozenset(setup.app_config.api_keys))
        events.write_header(setup.event_log_header or {})

    def start(nursery: trio.Nursery) -> RemoteEngine:
        requests_in, requests_out = trio.open_memory_channel(0)
        steps_in, steps_out = trio.open_memory_channel(1)
        to_engine, to_engine_out = outbox()
        side = start_request_side(nursery, setup.side, requests=requests_in, steps=steps_out,
                                  back_edges=to_engine.clone(), events=events)
        ctx = setup.side.render_context
        engine = RemoteEngine(model_names=ctx.served_model_names,
                              max_model_len=ctx.max_model_len, replies=side.replies,
                              admission=LocalAdmission(), render_in=side.render_in,
                              render_context=ctx, schedule_in=to_engine.clone(),
                              event_log=events, link=link, accountant=side.accountant,
                              outbox=to_engine)
        sent: dict = {}     # request id -> its RenderedRequest, until its reply ends
        nursery.start_soon(forward, to_engine_out, link)
        nursery.start_soon(_send_requests, requests_out, link, side.replies, sent)
        nursery.start_soon(_receive, link, engine, steps_in, sent,
                           events.stage("wire") if events is not None else None)
        return engine

    try:
        async with running(start) as engine:
            yield engine
    finally:
        if events is not None:
            events.close()
