"""The engine process (--api-server-count): admit, schedule and the GPU step, serving N
frontend processes (pipeline/layouts/frontend.py) over one socketpair each (pipeline/layouts/wire.py).

Requests arrive rendered from a frontend and are known here as "K:ID" (frontend K's own
request id), so two frontends never collide. `EngineReplies` stands where one process
has its reply channels: admit's answer (Accepted or a refusal) goes back to the owning
frontend, and a request counts against the admission limit until its last delta has
left here (exact: every frontend's requests in one count). `route` splits each Step by
frontend into one frame each, under the frontends' own ids.

A frontend that goes away (its socket closes) gets every request of its aborted, which
frees their KV blocks with the next step; the others keep being served. When the last
frontend has gone the engine stops (exit 0); a stage that raises stops it (exit 1),
which every frontend sees as its socket closing.

With --data-parallel-size D, D such processes (ranks 0..D-1) serve the same frontends,
each its own engine core; each reports its load (`Load`: waiting, running, KV usage)
to every frontend when it changes, as vLLM's DP coordinator publishes it, and the
frontends pick an engine per request. For /metrics each rank gathers the frontends'
accounting of its own requests (each frontend accounts per engine: account.EngineAccounts),
so every series can carry the `engine` label.
"""
from __future__ import annotations

import itertools
import logging
import socket

import attrs
import trio

from pipeline.core.assembly import (RequestSideSpec, core_admission, inbox_channel,
                                    start_engine_core)
from pipeline.core.config import EngineConfig
from pipeline.core.reply import describe
from pipeline.core.startup import event_log_header, freeze_heap, open_event_log
from pipeline.core.stats import AccountStats, CoreStats, EngineStats, cache_config_labels
from pipeline.layouts.tp_procs import TensorParallel, open_built
from pipeline.layouts.wire import (AccountQuery, AccountReply, ControlQuery, ControlReply,
                                   FrontendSetup, Link, Load, Refused, SleepState, StatsQuery,
                                   StatsReply, forward, outbox, pack_step, NUDGE)
from stages.admit import Accepted
from stages.messages import Abort, Control, FinishRequest, RenderedRequest

log = logging.getLogger("tailrace")

ACCOUNT_TIMEOUT_S = 2.0
LOAD_INTERVAL_S = 0.02      # how often an engine looks whether its load changed


@attrs.define(eq=False)
class Port:
    """The engine's end of one frontend's wire."""
    index: int
    link: Link
    outbox: trio.MemorySendChannel
    pending_out: trio.MemoryReceiveChannel     # what `forward` sends from outbox
    alive: bool = True


class _Entry:
    __slots__ = ("frontend", "local", "admitted", "aborted", "left")

    def __init__(self, frontend: int, local: str, choices: int) -> None:
        self.frontend = frontend
        self.local = local          # the frontend's request id
        self.admitted = False
        self.aborted = False
        self.left = choices         # choices whose last delta has not left yet


class EngineReplies:
    """What admit takes for stages.replies.Replies, in the engine process: each request's
    owner, and the admitted count (admission's limit over every frontend)."""

    def __init__(self, ports: list[Port]) -> None:
        self.ports = ports
        self.entries: dict[str, _Entry] = {}
        self.num_admitted = 0

    def add(self, frontend: int, req: RenderedRequest) -> RenderedRequest:
        rid = f"{frontend}:{req.request_id}"
        self.entries[rid] = _Entry(frontend, req.request_id, req.num_choices)
        return attrs.evolve(req, request_id=rid)

    def is_open(self, rid: str) -> bool:
        e = self.entries.get(rid)
        return e is not None and self.ports[e.frontend].alive

    def admit(self, rid: str) -> None:
        e = self.entries[rid]
        if not e.admitted:
            e.admitted = True
            self.num_admitted += 1

    def send(self, rid: str, item) -> bool:
        e = self.entries.get(rid)
        if e is None or not self.ports[e.frontend].alive:
            return False
        if isinstance(item, Accepted):
            msg = Accepted(e.local, item.stream)
        else:   # a RequestError
            msg = Refused(e.local, item.message, item.status, item.type, item.param, item.code)
        port = self.ports[e.frontend]
        # ahead of any Step frame route sends from now on (route writes those itself)
        port.link.send_first(msg)
        port.outbox.send_nowait(NUDGE)
        return True

    def release(self, rid: str) -> None:
        e = self.entries.pop(rid, None)
        if e is not None and e.admitted:
            self.num_admitted -= 1

    def mark_aborted(self, rid: str) -> bool:
        e = self.entries.get(rid)
        if e is None or not e.admitted or e.aborted:
            return False
        e.aborted = True
        return True

    def of_frontend(self, frontend: int) -> list[str]:
        return [rid for rid, e in self.entries.items() if e.frontend == frontend]


async def route(receive: trio.MemoryReceiveChannel, replies: EngineReplies) -> None:
    """schedule's Steps -> one frame per frontend that owns a sequence (or a new request)
    in it. A request's entry goes with its last choice's last delta."""
    entries, ports = replies.entries, replies.ports
    async with receive:
        async for step in receive:
            per: dict[int, tuple[list, list]] = {}
            for req in step.new_requests:
                e = entries.get(req.request_id)
                if e is not None:
                    per.setdefault(e.frontend, ([], []))[0].append(e.local)
            for d in step.deltas:
                e = entries.get(d.request_id)
                if e is None:
                    continue
                mine = per.get(e.frontend)
                if mine is None:
                    mine = per[e.frontend] = ([], [])
                mine[1].append((e.local, d))
                if d.finish_reason is not None:
                    e.left -= 1
                    if e.left == 0:
                        replies.release(d.request_id)
            for k, (new, items) in per.items():
                port = ports[k]
                if port.alive:
                    try:
                        await port.link.send_frame(pack_step(step, new, items))
                    except trio.BrokenResourceError:
                        pass     # its reader sees the socket close and aborts its requests


class Stats:
    """/metrics over every process: the core's gauges here, each frontend's accounting
    asked for at scrape time, merged (EngineStats.merge)."""

    def __init__(self, scheduler, blocks, ports: list[Port], cache_config: dict[str, str]) -> None:
        self.scheduler, self.blocks, self.ports = scheduler, blocks, ports
        self.cache_config = cache_config
        self.lora = False        # --enable-lora: vllm:lora_requests_info
        self._waiting: dict[int, tuple[trio.Event, list[AccountStats]]] = {}
        self._numbers = itertools.count()

    def answer(self, reply: AccountReply) -> None:
        waiting = self._waiting.get(reply.query)
        if waiting is not None:
            waiting[1].append(reply.totals)
            if len(waiting[1]) >= sum(p.alive for p in self.ports):
                waiting[0].set()

    async def reply(self, port: Port, query: StatsQuery) -> None:
        number = next(self._numbers)
        done, totals = self._waiting[number] = (trio.Event(), [])
        try:
            for p in self.ports:
                if p.alive:
                    p.outbox.send_nowait(AccountQuery(number))
            with trio.move_on_after(ACCOUNT_TIMEOUT_S):
                await done.wait()
        finally:
            del self._waiting[number]
        if port.alive:
            port.outbox.send_nowait(StatsReply(query.query, self.merge(totals)))

    def merge(self, totals: list[AccountStats]) -> EngineStats:
        return EngineStats.merge(CoreStats.of(self.scheduler, self.blocks, self.cache_config,
                                              self.lora), totals)


def load_of(scheduler, blocks, rank: int) -> Load:
    return Load(rank, len(scheduler.waiting) + len(scheduler.compiling), len(scheduler.running),
                blocks.num_used / blocks.num_blocks if blocks.num_blocks else 0.0)


async def report_load(scheduler, blocks, ports: list[Port], rank: int) -> None:
    """Each frontend gets this engine's load whenever it changes (looked at every
    LOAD_INTERVAL_S), so they pick the least loaded engine (data parallel)."""
    last = None
    while True:
        load = load_of(scheduler, blocks, rank)
        if load != last:
            for p in ports:
                if p.alive:
                    p.outbox.send_nowait(load)
            last = load
        await trio.sleep(LOAD_INTERVAL_S)


async def control(port: Port, query: ControlQuery, ports: list[Port], rank: int,
                  inbox: trio.MemorySendChannel) -> None:
    """A frontend's control operation, as the one-process Engine.control sends it: a Control
    in schedule's inbox, whose answer goes back to that frontend. A sleep or a wake-up tells
    every frontend the engine's new state (SleepState), so that each refuses new requests
    while it sleeps, not only the one that asked."""
    def tell(state: str) -> None:
        for p in ports:
            if p.alive:
                p.outbox.send_nowait(SleepState(rank, state))

    def answer(value: object) -> None:
        if port.alive:
            port.outbox.send_nowait(ControlReply(query.query, value))
        if query.op == "sleep":
            tell("asleep" if value is None else "awake")
        elif query.op == "wake_up" and value is None:
            tell("awake")

    async with inbox:
        if query.op == "sleep":
            tell("falling")
        await inbox.send(Control(query.op, answer, level=query.level,
                                 reset_running=query.reset_running))


async def _serve_frontend(port: Port, replies: EngineReplies, stats: Stats,
                          to_admit: trio.MemorySendChannel, inbox: trio.MemorySendChannel,
                          nursery: trio.Nursery, rank: int = 0) -> None:
    """One frontend's frames: requests to admit, aborts and stop strings to schedule,
    stats. When its socket closes, abort every request it had."""
    k = port.index
    async with to_admit, inbox:
        while True:
            try:
                msg = await port.link.receive()
            except trio.EndOfChannel:
                break
            if isinstance(msg, RenderedRequest):
                await to_admit.send(replies.add(k, msg))
            elif isinstance(msg, Abort):
                rid = f"{k}:{msg.request_id}"
                if replies.mark_aborted(rid):
                    inbox.send_nowait(Abort(rid, msg.error))
            elif isinstance(msg, FinishRequest):
                inbox.send_nowait(FinishRequest(f"{k}:{msg.request_id}", msg.index))
            elif isinstance(msg, StatsQuery):
                nursery.start_soon(stats.reply, port, msg)
            elif isinstance(msg, AccountReply):
                stats.answer(msg)
            elif isinstance(msg, ControlQuery):
                nursery.start_soon(control, port, msg, replies.ports, rank, inbox.clone())
            else:
                raise TypeError(f"the engine got {type(msg).__name__} from frontend {k}")
        port.alive = False
        port.outbox.close()
        gone = replies.of_frontend(k)
        if gone:
            log.warning("frontend %d has gone: aborting its %d requests", k, len(gone))
        for rid in gone:
            if replies.mark_aborted(rid):
                inbox.send_nowait(Abort(rid))


async def run_engine(cfg: EngineConfig, socks: list[socket.socket], setup: FrontendSetup, *,
                     dp_rank: int = 0, data_parallel: bool = False) -> int:
    """Load the model, hand each frontend its setup, serve them until the last has gone.
    `setup` is every frontend's, less what the model decides (filled in here)."""
    async with open_built(cfg) as (_device, built, tp):
        return await _serve(cfg, socks, setup, built, tp, dp_rank, data_parallel)


async def _serve(cfg: EngineConfig, socks: list[socket.socket], setup: FrontendSetup, built,
                 tp: TensorParallel | None, dp_rank: int = 0, data_parallel: bool = False) -> int:
    secrets = frozenset(setup.app_config.api_keys)
    events = open_event_log(cfg, built, secrets) if cfg.event_log else None
    header = event_log_header(cfg, built) if events is not None else None
    ports = []
    for k, sock in enumerate(socks):
        send, receive = outbox()
        ports.append(Port(k, Link(trio.socket.from_stdlib_socket(sock)), send, receive))
    replies = EngineReplies(ports)
    labels = {**cache_config_labels(cfg, built.blocks.num_blocks, built.max_model_len,
                                         built.blocks.prefix_caching),
              "engine": str(dp_rank)}
    stats = Stats(built.scheduler, built.blocks, ports, labels)
    stats.lora = cfg.enable_lora
    side = RequestSideSpec.of(cfg, built)
    try:
        async with trio.open_nursery() as nursery:
            requests_in, requests_out = trio.open_memory_channel(0)
            steps_in, steps_out = trio.open_memory_channel(1)
            inbox_in, inbox_out = inbox_channel(cfg)
            start_engine_core(nursery, cfg, built, replies=replies,
                              admission=core_admission(cfg, built, lambda: replies.num_admitted),
                              requests=requests_out, inbox=(inbox_in, inbox_out), steps=steps_in,
                              events=events, watch=None if tp is None else tp.watch)
            nursery.start_soon(route, steps_out, replies)
            if data_parallel:
                nursery.start_soon(report_load, built.scheduler, built.blocks, ports, dp_rank)
            async with trio.open_nursery() as frontends:
                for port in ports:
                    mine = attrs.evolve(
                        setup, index=port.index, side=side,
                        event_log=None if cfg.event_log is None
                        else f"{cfg.event_log}.frontend-{port.index}",
                        event_log_header=header, sleep_mode=cfg.enable_sleep_mode)
                    try:
                        await port.link.send(mine)
                    except trio.BrokenResourceError:
                        port.alive = False
                    frontends.start_soon(forward, port.pending_out, port.link)
                    frontends.start_soon(_serve_frontend, port, replies, stats,
                                         requests_in.clone(), inbox_in.clone(), nursery, dp_rank)
                requests_in.close()
                inbox_in.close()
                freeze_heap()
                log.info("engine %d serving %d frontends", dp_rank, len(ports))
            nursery.cancel_scope.cancel()    # every frontend has gone
    except Exception as exc:
        log.error("the engine stopped: %s", describe(exc))
        raise
    finally:
        if events is not None:
            events.close()
    return 0
