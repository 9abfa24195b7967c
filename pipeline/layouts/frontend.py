"""A frontend process (--api-server-count): HTTP, render, detokenize, parse, account and
emit, and each request's Reply, over the wire (pipeline/layouts/wire.py) to the engine process
(pipeline/layouts/engine_proc.py), which admits, schedules and steps. Imports no torch.

    HTTP -> render -> [wire] -> admit -> schedule <=> gpu step          (engine process)
                                           | one Step frame per step
    HTTP <- emit <- account <- parse <- detokenize <- [wire]
                                           | FinishRequest (stop string), Abort
                                           +-> [wire] -> schedule's inbox

The stages are the same code as in one process; only the channels at the cut are the
wire's: render's requests go to the engine instead of admit, the engine's Steps come in
instead of schedule's, and the back-edges (aborts, stop strings) go out to the engine's
schedule inbox. `RemoteEngine` is what web holds (pipeline/core/client.py): web cannot tell.

Admission is counted in the engine, exactly: its admit answers each request with
Accepted or a refusal, which the request's reply channel gets as in one process, so a
refusal still comes before the 200. A request counts until the engine has sent its last
delta. When the engine process goes away, every open reply ends with an error event and
[DONE], /health answers 503, and after STOP_GRACE_S the frontend stops (exit 1).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import pickle
from collections.abc import AsyncIterator

import attrs
import trio

from pipeline.core.client import EngineClient
from pipeline.core.reply import describe
from pipeline.core.stats import EngineStats
from pipeline.layouts.wire import (STEP, AccountQuery, AccountReply, AccountTotals, FrontendSetup, Link,
                           Refused, StatsQuery, StatsReply, forward, outbox, unpack_step)
from stages import account, detokenize, emit, parse, render
from stages.admit import Accepted, shutting_down
from stages.render import RequestError
from stages.lib.replies import Replies
from stages.lib.stream_interval import StreamInterval

log = logging.getLogger("tailrace")

STOP_GRACE_S = 2.0          # as pipeline.core.engine's: for the HTTP server to write the errors
STATS_TIMEOUT_S = 5.0
_HISTOGRAMS = ("ttft", "itl", "e2e", "queue", "prefill", "decode", "inference",
               "request_prompt_tokens", "request_generation_tokens", "request_params_n",
               "request_params_max_tokens")   # every histogram of stages.account.Accountant


class EngineGone(RuntimeError):
    """The engine process closed its end of the wire (it exited or was killed)."""


class LocalAdmission:
    """A frontend refuses at once only while it drains; overload and KV capacity are
    the engine's admit's to decide (it counts every frontend's requests)."""

    def __init__(self) -> None:
        self.draining = False

    def refusal(self) -> RequestError | None:
        return shutting_down() if self.draining else None


def account_totals(a: account.Accountant) -> AccountTotals:
    return AccountTotals(
        a.prompt_tokens_total, a.generation_tokens_total, a.cached_tokens_total,
        a.prefix_cache_queries_total, a.prefix_cache_hits_total,
        {str(k): v for k, v in a.finished_total.items()},
        tuple((name, h.buckets, tuple(h.counts), h.sum)
              for name in _HISTOGRAMS for h in (getattr(a, name),)))


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
    """render -> the engine's admit. Keeps each request here (its typed request is for
    the framers, and Step frames name new requests by id); the engine gets it without."""
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
    stats queries and answers. When the engine goes, stop as a failed stage does.

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
                engine.outbox.send_nowait(AccountReply(msg.query, account_totals(engine.accountant)))
            else:
                raise TypeError(f"a frontend got {type(msg).__name__} from the engine")
    exc = EngineGone("the engine process has exited")
    log.error("the engine stopped: %s", describe(exc))
    engine._stop(exc)
    await trio.sleep(STOP_GRACE_S)
    raise exc


@contextlib.asynccontextmanager
async def open_frontend(setup: FrontendSetup, link: Link) -> AsyncIterator[RemoteEngine]:
    """Start the frontend's stages over `link`, yield its RemoteEngine; on exit cancel
    them. EngineGone comes out of the block when the engine process goes away."""
    from pipeline.core.events import EventLog

    events = None
    if setup.event_log is not None:
        events = EventLog(setup.event_log, max_bytes=setup.event_log_max_bytes,
                          backup_count=setup.event_log_backup_count)
        events.write_header(setup.event_log_header or {})
    ev = events.stage if events else (lambda name: None)
    ctx = setup.render_context
    replies = Replies(ctx.max_model_len + 4)
    accountant = account.Accountant(ctx.max_model_len)
    to_engine, to_engine_out = outbox()
    requests: dict = {}
    render_in, render_out = trio.open_memory_channel(setup.max_queued_requests)
    sent_in, sent_out = trio.open_memory_channel(0)
    detok_in, detok_out = trio.open_memory_channel(1)
    parse_in, parse_out = trio.open_memory_channel(1)
    acct_in, acct_out = trio.open_memory_channel(1)
    emit_in, emit_out = trio.open_memory_channel(1)
    engine = RemoteEngine(model_names=ctx.served_model_names, max_model_len=ctx.max_model_len,
                          replies=replies, admission=LocalAdmission(), render_in=render_in,
                          render_context=ctx, schedule_in=to_engine.clone(), event_log=events,
                          link=link, accountant=accountant, outbox=to_engine.clone())
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(forward, to_engine_out, link)
            nursery.start_soon(render.run, render_out, sent_in, replies, ctx, ev("render"))
            nursery.start_soon(_send_requests, sent_out, link, replies, requests)
            nursery.start_soon(_receive, link, engine, detok_in, requests, ev("wire"))
            nursery.start_soon(detokenize.run, detok_out, parse_in, to_engine,
                               detokenize.Detokenizer(ctx.tokenizer), ev("detokenize"))
            nursery.start_soon(parse.run, parse_out, acct_in, parse.Parser(setup.reasoning_parser),
                               ev("parse"))
            nursery.start_soon(account.run, acct_out, emit_in, accountant, ev("account"))
            held = StreamInterval(setup.stream_interval) if setup.stream_interval > 1 else None
            nursery.start_soon(emit.run, emit_out, replies, emit.Emitter(), ev("emit"), held)
            yield engine
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        if engine.failure is not None:
            raise engine.failure from None
        raise
    finally:
        if events is not None:
            events.close()
