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

With --data-parallel-size D the frontend holds one link per engine (`EngineLink`) and
`Balancer` picks one per request: the X-data-parallel-rank header's rank, else the least
loaded by the engines' `Load` reports (4 x waiting + running, vLLM's coordinator's score,
with the requests this frontend has sent since the last report counted as waiting; then
KV usage; then in turn). A request's aborts and stop strings go to its engine. Any engine
going away stops the frontend, as one engine does (vLLM's API server exits too).
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
from pipeline.core.stats import AccountStats, EngineStats, sum_engines
from pipeline.layouts.wire import (STEP, AccountQuery, AccountReply, ControlQuery, ControlReply,
                                   FrontendSetup, Link, Load, Refused, SleepState, StatsQuery,
                                   StatsReply, forward, outbox, unpack_step)
from stages.messages import Abort, FinishRequest
from stages import account
from stages.admit import Accepted, shutting_down
from stages.render import RequestError
from stages.replies import Replies

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


@attrs.define(eq=False)
class EngineLink:
    """One engine (data-parallel rank) as a frontend sees it: its wire, its outbox, the
    load it last reported."""
    rank: int
    link: Link
    outbox: trio.MemorySendChannel
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    unreported: int = 0     # sent by this frontend since the engine's last Load
    sleep_state: str = "awake"   # as the engine last told (SleepState)

    def score(self) -> int:
        return 4 * (self.waiting + self.unreported) + self.running

    def report(self, load: Load) -> None:
        self.waiting, self.running, self.kv_usage = load.waiting, load.running, load.kv_usage
        self.unreported = 0


class Balancer:
    """Which engine serves each request (data parallel): a pinned rank, else the least
    loaded; kept until its last choice finishes, for its aborts and stop strings."""

    def __init__(self, engines: list[EngineLink]) -> None:
        self.engines = engines
        self.pinned: dict[str, int] = {}          # request id -> rank (the header's)
        self.assigned: dict[str, list] = {}       # request id -> [EngineLink, choices left]
        self._turn = 0

    def pick(self, rid: str, choices: int) -> EngineLink:
        rank = self.pinned.pop(rid, None)
        if len(self.engines) == 1:
            return self.engines[0]
        if rank is not None:
            e = self.engines[rank]
        else:
            n, turn = len(self.engines), self._turn
            self._turn += 1
            e = min(self.engines, key=lambda x: (x.score(), x.kv_usage, (x.rank - turn) % n))
        e.unreported += 1
        self.assigned[rid] = [e, choices]
        return e

    def of(self, rid: str) -> EngineLink | None:
        if len(self.engines) == 1:
            return self.engines[0]
        a = self.assigned.get(rid)
        return None if a is None else a[0]

    def finished(self, step) -> None:
        """Forget the requests whose last choice finished in `step`."""
        if len(self.engines) == 1:
            return
        for d in step.deltas:
            if d.finish_reason is not None:
                a = self.assigned.get(d.request_id)
                if a is not None:
                    a[1] -= 1
                    if a[1] <= 0:
                        del self.assigned[d.request_id]

    def forget(self, rid: str) -> None:
        self.assigned.pop(rid, None)
        self.pinned.pop(rid, None)


@attrs.define(kw_only=True, eq=False)
class RemoteEngine(EngineClient):
    """The engine as a frontend's web sees it: the same calls as pipeline.core.engine.Engine."""

    link: Link
    accountant: account.Accountant | account.EngineAccounts
    outbox: trio.MemorySendChannel
    balancer: Balancer | None = None
    _queries: dict = attrs.field(factory=dict)
    _numbers: itertools.count = attrs.field(factory=itertools.count)

    @property
    def data_parallel_size(self) -> int:
        return 1 if self.balancer is None else len(self.balancer.engines)

    def pin_rank(self, request_id: str, rank: int) -> None:
        """Serve `request_id` on data-parallel rank `rank` (X-data-parallel-rank)."""
        if self.balancer is not None:
            self.balancer.pinned[request_id] = rank

    def unpin(self, request_id: str) -> None:
        if self.balancer is not None:
            self.balancer.pinned.pop(request_id, None)

    async def fetch_stats(self) -> EngineStats:
        """The engines' stats with every frontend's accounting summed (engine 0 asks
        them all): /metrics adds up whichever frontend is scraped. With data parallel,
        `engines` holds each engine's and the gauges are their sums."""
        if self.failure is not None:
            return EngineStats()
        engines = self.balancer.engines if self.balancer is not None else None
        queries = []
        try:
            for e in engines or [None]:
                query = next(self._numbers)
                done = self._queries[query] = [trio.Event(), None]
                queries.append(query)
                (self.outbox if e is None else e.outbox).send_nowait(StatsQuery(query))
            with trio.move_on_after(STATS_TIMEOUT_S):
                for query in queries:
                    await self._queries[query][0].wait()
            stats = [self._queries[q][1] or EngineStats() for q in queries]
        finally:
            for q in queries:
                self._queries.pop(q, None)
        if engines is None or len(engines) == 1:
            return stats[0]
        return sum_engines(stats)

    async def control(self, op: str, **kw) -> object:
        """An operation on the engine core (stages.messages.Control), as the one-process
        Engine.control: sent to every engine (data parallel: each is reset, put to sleep,
        woken), answered when all have. Reset: whether every one was; sleep and wake-up:
        the first error, or None."""
        queries = []
        try:
            for e in self.balancer.engines:
                query = next(self._numbers)
                self._queries[query] = [trio.Event(), None]
                queries.append(query)
                e.outbox.send_nowait(ControlQuery(query, op, **kw))
            for query in queries:
                await self._queries[query][0].wait()
            values = [self._queries[q][1] for q in queries]
        finally:
            for q in queries:
                self._queries.pop(q, None)
        if op == "reset_prefix_cache":
            return all(values)
        return next((v for v in values if v is not None), None)

    def told(self, me: EngineLink, state: str) -> None:
        """An engine's new sleep state (SleepState): the frontend's is "awake" once every
        engine is, "asleep" once every one is, else "falling" (new requests are refused)."""
        me.sleep_state = state
        states = {e.sleep_state for e in self.balancer.engines}
        self.sleep_state = states.pop() if len(states) == 1 else "falling"

    def answer(self, reply: StatsReply | ControlReply) -> None:
        waiting = self._queries.get(reply.query)
        if waiting is not None:
            waiting[1] = reply.stats if isinstance(reply, StatsReply) else reply.value
            waiting[0].set()


async def _route_back(receive: trio.MemoryReceiveChannel, balancer: Balancer) -> None:
    """The request side's back-edges (aborts, stop strings) to the engine of their request."""
    async with receive:
        async for msg in receive:
            if isinstance(msg, (Abort, FinishRequest)):
                e = balancer.of(msg.request_id)
                if e is not None:
                    e.outbox.send_nowait(msg)
            else:
                for e in balancer.engines:
                    e.outbox.send_nowait(msg)


async def _send_requests(receive: trio.MemoryReceiveChannel, balancer: Balancer,
                         replies: Replies, requests: dict) -> None:
    """render -> the engine's admit: the RenderedRequest whole (plain data), to the engine
    the balancer picks. It is kept here too, since Step frames name new requests by id."""
    async with receive:
        async for req in receive:
            rid = req.request_id
            if not replies.is_open(rid):   # the client left while it was rendered
                balancer.forget(rid)
                replies.release(rid)
                continue
            requests[rid] = req
            try:
                await balancer.pick(rid, req.num_choices).link.send(req)
            except trio.BrokenResourceError:      # the engine has gone (_receive stops us)
                balancer.forget(rid)
                requests.pop(rid, None)
                replies.send(rid, RequestError(
                    "The engine stopped: the engine process has exited", status=503,
                    type="server_error", code="engine_stopped"))
                replies.release(rid)


async def _receive(me: EngineLink, engine: RemoteEngine, steps: trio.MemorySendChannel,
                   requests: dict, events=None) -> None:
    """The engine's frames: admission answers onto reply channels, Steps to detokenize,
    stats queries and answers. When the engine goes, raise EngineGone: the frontend stops as at a
    failed stage (pipeline/core/assembly.py `running`).

    With an event log, each Step is logged as it arrived (`scheduled`, without the plan,
    which the engine's own file has), so this frontend's file replays on its own."""
    replies, link, balancer = engine.replies, me.link, engine.balancer
    async with steps:
        while True:
            try:
                kind, payload = await link.receive_frame()
            except trio.EndOfChannel:
                break
            if kind == STEP:
                step = unpack_step(payload, requests, me.rank)
                balancer.finished(step)
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
                balancer.forget(msg.request_id)
            elif isinstance(msg, Load):
                me.report(msg)
            elif isinstance(msg, (StatsReply, ControlReply)):
                engine.answer(msg)
            elif isinstance(msg, SleepState):
                engine.told(me, msg.state)
            elif isinstance(msg, AccountQuery):
                acct = engine.accountant   # each engine asks for its own requests' figures
                if isinstance(acct, account.EngineAccounts):
                    acct = acct.part(me.rank)
                me.outbox.send_nowait(AccountReply(msg.query, AccountStats.of(acct)))
            else:
                raise TypeError(f"a frontend got {type(msg).__name__} from the engine")
    if len(balancer.engines) > 1:
        raise EngineGone(f"engine {me.rank} (of {len(balancer.engines)}, data parallel) has exited")
    raise EngineGone("the engine process has exited")


@contextlib.asynccontextmanager
async def open_frontend(setup: FrontendSetup, links: list[Link]) -> AsyncIterator[RemoteEngine]:
    """Start the frontend's request side over `links` (one per engine), yield its
    RemoteEngine; on exit cancel it. EngineGone comes out of the block when an engine
    process goes away."""
    events = None
    if setup.event_log is not None:
        events = EventLog(setup.event_log, max_bytes=setup.event_log_max_bytes,
                          backup_count=setup.event_log_backup_count,
                          secrets=frozenset(setup.app_config.api_keys))
        events.write_header(setup.event_log_header or {})

    def start(nursery: trio.Nursery) -> RemoteEngine:
        requests_in, requests_out = trio.open_memory_channel(0)
        steps_in, steps_out = trio.open_memory_channel(1)
        back, back_out = outbox()
        side = start_request_side(nursery, setup.side, requests=requests_in, steps=steps_out,
                                  back_edges=back.clone(), events=events, engines=len(links))
        engines = []
        for rank, link in enumerate(links):
            to_engine, to_engine_out = outbox()
            engines.append(EngineLink(rank, link, to_engine))
            nursery.start_soon(forward, to_engine_out, link)
        balancer = Balancer(engines)
        ctx = setup.side.render_context
        engine = RemoteEngine(model_names=ctx.served_model_names,
                              max_model_len=ctx.max_model_len, replies=side.replies,
                              admission=LocalAdmission(), render_in=side.render_in,
                              render_context=ctx, schedule_in=back,
                              event_log=events, link=links[0], accountant=side.accountant,
                              outbox=engines[0].outbox, balancer=balancer,
                              sleep_mode=setup.sleep_mode)
        sent: dict = {}     # request id -> its RenderedRequest, until its reply ends
        nursery.start_soon(_route_back, back_out, balancer)
        nursery.start_soon(_send_requests, requests_out, balancer, side.replies, sent)
        for i, e in enumerate(engines):
            nursery.start_soon(_receive, e, engine, steps_in.clone() if i else steps_in, sent,
                               events.stage("wire") if events is not None else None)
        return engine

    try:
        async with running(start) as engine:
            yield engine
    finally:
        if events is not None:
            events.close()
