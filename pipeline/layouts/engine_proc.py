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
"""
from __future__ import annotations

import itertools
import logging
import socket
from functools import partial

import attrs
import trio

from pipeline.core.config import EngineConfig
from pipeline.core.engine import admission_limits, render_context, spec_decode_stats
from pipeline.core.reply import describe
from pipeline.core.startup import build, freeze_heap, open_event_log, pick_device
from pipeline.layouts.tp_procs import TensorParallel, open_tensor_parallel
from pipeline.core.stats import EngineStats, Latencies, RequestShapes, cache_config_labels
from pipeline.layouts.wire import (AccountQuery, AccountReply, FrontendSetup, Link, Refused, StatsQuery,
                           StatsReply, forward, outbox, pack_step)
from stages import admit, gpu_step, schedule
from stages.lib.histogram import Histogram
from stages.admit import Accepted, Admission
from stages.messages import Abort, FinishRequest, RenderedRequest, Step

log = logging.getLogger("tailrace")

ACCOUNT_TIMEOUT_S = 2.0


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
    """What admit takes for stages.lib.replies.Replies, in the engine process: each request's
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
        self.ports[e.frontend].outbox.send_nowait(msg)
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
    """/metrics over every process: the scheduler's gauges here, each frontend's
    accounting asked for at scrape time and summed."""

    def __init__(self, scheduler, blocks, ports: list[Port], cache_config: dict[str, str]) -> None:
        self.scheduler, self.blocks, self.ports = scheduler, blocks, ports
        self.cache_config = cache_config
        self._waiting: dict[int, tuple[trio.Event, list]] = {}
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

    def merge(self, totals: list) -> EngineStats:
        s, b = self.scheduler, self.blocks
        finished: dict[str, int] = {}
        hists: dict[str, Histogram] = {}
        for t in totals:
            for k, v in t.finished_total.items():
                finished[k] = finished.get(k, 0) + v
            for name, buckets, counts, total in t.histograms:
                h = hists.get(name)
                if h is None:
                    h = hists[name] = Histogram(tuple(buckets))
                h.counts = [x + y for x, y in zip(h.counts, counts)]
                h.sum += total
        lat_names = [f.name for f in attrs.fields(Latencies)]
        latency = (Latencies(**{k: hists[k] for k in lat_names})
                   if all(k in hists for k in lat_names) else None)
        shapes = None
        if all(f"request_{k}" in hists for k in ("prompt_tokens", "generation_tokens", "params_n",
                                                 "params_max_tokens")):
            shapes = RequestShapes(prompt_tokens=hists["request_prompt_tokens"],
                                   generation_tokens=hists["request_generation_tokens"],
                                   params_n=hists["request_params_n"],
                                   params_max_tokens=hists["request_params_max_tokens"],
                                   num_preemptions=s.request_preemptions,
                                   iteration_tokens=s.iteration_tokens)
        return EngineStats(
            num_running=len(s.running), num_waiting=len(s.waiting) + len(s.compiling),
            num_waiting_by_reason={"capacity": len(s.waiting), "deferred": len(s.compiling)},
            cache_config=self.cache_config, shapes=shapes, spec_decode=spec_decode_stats(s),
            num_preemptions=s.num_preemptions, kv_blocks_total=b.num_blocks,
            kv_blocks_free=b.num_free, kv_blocks_used=b.num_used, kv_blocks_cached=len(b.cached),
            prompt_tokens_total=sum(t.prompt_tokens_total for t in totals),
            generation_tokens_total=sum(t.generation_tokens_total for t in totals),
            cached_tokens_total=sum(t.cached_tokens_total for t in totals),
            prefix_cache_queries_total=sum(t.prefix_cache_queries_total for t in totals),
            prefix_cache_hits_total=sum(t.prefix_cache_hits_total for t in totals),
            requests_finished_total=finished, steps_total=s.step, latency=latency)


async def _serve_frontend(port: Port, replies: EngineReplies, stats: Stats,
                          to_admit: trio.MemorySendChannel, inbox: trio.MemorySendChannel,
                          nursery: trio.Nursery) -> None:
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


async def run_engine(cfg: EngineConfig, socks: list[socket.socket], setup: FrontendSetup) -> int:
    """Load the model, hand each frontend its setup, serve them until the last has gone.
    `setup` is every frontend's, less what the model decides (filled in here)."""
    device = pick_device(cfg.device)
    async with open_tensor_parallel(cfg, device) as tp:
        if tp is None:
            built = await trio.to_thread.run_sync(partial(build, cfg, device, None),
                                                  abandon_on_cancel=True)
        else:   # rank 0 of --tensor-parallel-size: the workers build their shards alongside
            built = await tp.build(cfg, device)
        return await _serve(cfg, socks, setup, built, tp)


async def _serve(cfg: EngineConfig, socks: list[socket.socket], setup: FrontendSetup, built,
                 tp: TensorParallel | None) -> int:
    events = open_event_log(cfg, built) if cfg.event_log else None
    ev = events.stage if events else (lambda name: None)
    header = _header(cfg, built) if events is not None else None
    ports = []
    for k, sock in enumerate(socks):
        send, receive = outbox()
        ports.append(Port(k, Link(trio.socket.from_stdlib_socket(sock)), send, receive))
    replies = EngineReplies(ports)
    max_admitted, inbox_size = admission_limits(cfg)
    admission = Admission(max_admitted=max_admitted,
                          kv_capacity_tokens=built.blocks.num_blocks * cfg.block_size,
                          admitted=lambda: replies.num_admitted)
    stats = Stats(built.scheduler, built.blocks, ports, cache_config_labels(cfg, built.blocks.num_blocks))
    ctx = render_context(cfg, built)
    try:
        async with trio.open_nursery() as nursery:
            admit_in, admit_out = trio.open_memory_channel(0)
            sched_in, sched_out = trio.open_memory_channel(inbox_size)
            plan_in, plan_out = trio.open_memory_channel(0)
            result_in, result_out = trio.open_memory_channel(0)
            steps_in, steps_out = trio.open_memory_channel(1)
            nursery.start_soon(admit.run, admit_out, sched_in.clone(), replies, admission,
                               ev("admit"))
            nursery.start_soon(partial(schedule.run, sched_out, plan_in, result_out, steps_in,
                                       built.scheduler, ev("schedule")))
            nursery.start_soon(partial(gpu_step.run, plan_out, result_in, built.runner,
                                       ev("gpu_step"), faults=cfg.fault_step_kinds))
            nursery.start_soon(route, steps_out, replies)
            if tp is not None:   # a worker rank that exits stops the engine (exit 1)
                nursery.start_soon(tp.watch)
            async with trio.open_nursery() as frontends:
                for port in ports:
                    mine = attrs.evolve(
                        setup, index=port.index, render_context=ctx,
                        reasoning_parser=built.parsers.reasoning_parser,
                        event_log=None if cfg.event_log is None
                        else f"{cfg.event_log}.frontend-{port.index}",
                        event_log_header=header)
                    try:
                        await port.link.send(mine)
                    except trio.BrokenResourceError:
                        port.alive = False
                    frontends.start_soon(forward, port.pending_out, port.link)
                    frontends.start_soon(_serve_frontend, port, replies, stats,
                                         admit_in.clone(), sched_in.clone(), nursery)
                admit_in.close()
                sched_in.close()
                freeze_heap()
                log.info("engine serving %d frontends", len(ports))
            nursery.cancel_scope.cancel()    # every frontend has gone
    except Exception as exc:
        log.error("the engine stopped: %s", describe(exc))
        raise
    finally:
        if events is not None:
            events.close()
    return 0


def _header(cfg: EngineConfig, built) -> dict:
    from gpu.tokenizer_files import default_model_path
    from pipeline.core.events import make_header

    return make_header(
        cfg, model_path=str(cfg.model or built.loaded.path or default_model_path()),
        model_name=built.loaded.name, tokenizer=built.loaded.tokenizer,
        served_model_names=built.model_names, max_model_len=built.max_model_len,
        kv_blocks_total=built.blocks.num_blocks, block_size=cfg.block_size,
        parsers=built.parsers)
