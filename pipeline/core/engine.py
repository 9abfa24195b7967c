"""The running engine: wires the eight stages into one nursery, and is the only thing
web talks to (submit, Reply, stats). Start-up (loading, KV sizing, templates) is
pipeline/core/startup.py; a request's reply is pipeline/core/reply.py.

    web -> render -> admit -> schedule <=> gpu step
                                 |
           web <- emit <- account <- parse <- detokenize

Back-edges go into schedule's inbox only: aborts (web) and stop-string finishes
(detokenize), through cloned send channels.

Lifetime: ``async with open_engine(config) as engine:`` runs start-up (in a worker
thread Ctrl-C can abandon; with --tensor-parallel-size, after starting the worker ranks,
pipeline/layouts/tp_procs.py, which it stops on the way out), starts the stages in the context manager's own nursery and
yields a running Engine; leaving the block cancels the stages and closes the event log.

A stage that raises stops the engine cleanly: ``engine.failure`` is set (so /health
answers 503 and new requests get 503), every request in flight ends at once with an
error (Reply), the body gets STOP_GRACE_S to finish on its own (an HTTP server sends
those errors), and then it is cancelled; the stage's error comes out of the block.
"""
from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import AsyncIterator
from functools import partial

import attrs
import torch
import trio

from gpu.loader import LoadedModel
from gpu.runner import ModelRunner
from gpu.simulate import SimulatedRunner
from pipeline.core.config import EngineConfig
from pipeline.core.events import EventLog
from pipeline.core.client import EngineClient
from pipeline.core.reply import describe
from pipeline.core.startup import (Built, build, chat_template_source, freeze_heap,
                              generation_defaults, open_event_log, pick_device)
from pipeline.layouts.tp_procs import TensorParallel, open_tensor_parallel
from pipeline.core.stats import (EngineStats, Latencies, RequestShapes, SpecDecodeStats,
                            cache_config_labels)
from stages import account, admit, detokenize, emit, gpu_step, parse, render, schedule
from stages.admit import Admission
from stages.api.chat import MAX_CHOICES
from stages.schedule.blocks import BlockManager
from stages.render import RenderContext
from stages.lib.replies import Replies
from stages.schedule import Scheduler
from stages.lib.stream_interval import StreamInterval

log = logging.getLogger("tailrace")

STOP_GRACE_S = 2.0      # after a stage failure, how long the body may run on (see open_engine)


@attrs.define(kw_only=True, eq=False)
class Engine(EngineClient):
    """A running engine: built and started by open_engine, never half-made. What web
    calls (submit, abort, the drain) is pipeline/core/client.py's, shared with a frontend
    process's RemoteEngine; this adds the stages' own state."""

    config: EngineConfig
    device: torch.device
    loaded: LoadedModel
    runner: ModelRunner | SimulatedRunner
    blocks: BlockManager
    scheduler: Scheduler
    accountant: account.Accountant

    async def fetch_stats(self) -> EngineStats:
        """The stats for a /metrics scrape: read at once here (a frontend process's
        RemoteEngine asks the engine process instead)."""
        return self.stats()

    def stats(self) -> EngineStats:
        s, a = self.scheduler, self.accountant
        return EngineStats(
            num_running=len(s.running), num_waiting=len(s.waiting) + len(s.compiling),
            num_preemptions=s.num_preemptions, kv_blocks_total=self.blocks.num_blocks,
            kv_blocks_free=self.blocks.num_free, kv_blocks_used=self.blocks.num_used,
            kv_blocks_cached=len(self.blocks.cached),
            prompt_tokens_total=a.prompt_tokens_total,
            generation_tokens_total=a.generation_tokens_total,
            cached_tokens_total=a.cached_tokens_total,
            prefix_cache_queries_total=a.prefix_cache_queries_total,
            prefix_cache_hits_total=a.prefix_cache_hits_total,
            requests_finished_total=dict(a.finished_total), steps_total=s.step,
            num_waiting_by_reason={"capacity": len(s.waiting), "deferred": len(s.compiling)},
            cache_config=self.cache_config,
            latency=Latencies(ttft=a.ttft, itl=a.itl, e2e=a.e2e, queue=a.queue,
                              prefill=a.prefill, decode=a.decode, inference=a.inference),
            shapes=RequestShapes(prompt_tokens=a.request_prompt_tokens,
                                 generation_tokens=a.request_generation_tokens,
                                 params_n=a.request_params_n,
                                 params_max_tokens=a.request_params_max_tokens,
                                 num_preemptions=s.request_preemptions,
                                 iteration_tokens=s.iteration_tokens),
            spec_decode=spec_decode_stats(s))

    @property
    def cache_config(self) -> dict[str, str]:
        return cache_config_labels(self.config, self.blocks.num_blocks)


def spec_decode_stats(s: Scheduler) -> SpecDecodeStats | None:
    """Speculative decoding's counters (None: --speculative-config is off)."""
    if s.drafter is None:
        return None
    return SpecDecodeStats(num_drafts=s.spec.num_drafts, num_draft_tokens=s.spec.num_draft_tokens,
                           num_accepted_tokens=s.spec.num_accepted_tokens,
                           accepted_per_pos=tuple(s.spec.accepted_per_pos))


# -- the stages, wired -----------------------------------------------------------------

def render_context(cfg: EngineConfig, built: Built) -> RenderContext:
    """What render needs (the tokenizer, the template, the defaults): plain data, which
    the engine process hands each frontend (pipeline/layouts/frontend.py)."""
    loaded = built.loaded
    return RenderContext(tokenizer=loaded.tokenizer, served_model_names=built.model_names,
                         max_model_len=built.max_model_len,
                         default_sampling=generation_defaults(cfg, loaded.generation_config),
                         reasoning=built.parsers.reasoning_parser is not None,
                         vocab_size=loaded.config.vocab_size,
                         chat_template=chat_template_source(cfg.chat_template),
                         max_tokens_ceiling=cfg.override_generation_config.get("max_new_tokens"),
                         force_include_usage=cfg.enable_force_include_usage,
                         per_request_metrics=cfg.enable_per_request_metrics,
                         tools=built.parsers.tools, harmony=built.parsers.harmony)


def admission_limits(cfg: EngineConfig) -> tuple[int, int]:
    """(requests admitted at once, schedule's inbox size).

    Admitted at once: at most max_queued_requests + max_num_seqs requests (admission
    counts a request until emit has sent its last byte), each putting at most one request,
    one Abort and one FinishRequest per choice (<= MAX_CHOICES) into schedule's inbox: the
    back-edges never block."""
    max_admitted = cfg.max_queued_requests + cfg.max_num_seqs
    return max_admitted, (2 + MAX_CHOICES) * max_admitted + 16


def _start(nursery: trio.Nursery, cfg: EngineConfig, device: torch.device, built: Built,
           events: EventLog | None, tp: TensorParallel | None = None) -> Engine:
    """Open the channels, start every stage in `nursery`, return the running Engine."""
    ev = events.stage if events else (lambda name: None)
    loaded, tok = built.loaded, built.loaded.tokenizer
    replies = Replies(built.max_model_len + 4)
    accountant = account.Accountant(built.max_model_len)
    ctx = render_context(cfg, built)
    max_admitted, inbox_size = admission_limits(cfg)
    render_in, render_out = trio.open_memory_channel(cfg.max_queued_requests)
    admit_in, admit_out = trio.open_memory_channel(0)
    sched_in, sched_out = trio.open_memory_channel(inbox_size)
    plan_in, plan_out = trio.open_memory_channel(0)
    result_in, result_out = trio.open_memory_channel(0)
    detok_in, detok_out = trio.open_memory_channel(1)
    parse_in, parse_out = trio.open_memory_channel(1)
    acct_in, acct_out = trio.open_memory_channel(1)
    emit_in, emit_out = trio.open_memory_channel(1)
    admission = Admission(max_admitted=max_admitted,
                          kv_capacity_tokens=built.blocks.num_blocks * cfg.block_size,
                          admitted=lambda: replies.num_admitted)
    engine = Engine(config=cfg, device=device, loaded=loaded, model_names=built.model_names,
                    max_model_len=built.max_model_len, runner=built.runner, blocks=built.blocks,
                    scheduler=built.scheduler, accountant=accountant, replies=replies,
                    admission=admission, render_in=render_in, render_context=ctx,
                    schedule_in=sched_in.clone(), event_log=events)
    nursery.start_soon(render.run, render_out, admit_in, replies, ctx, ev("render"))
    nursery.start_soon(admit.run, admit_out, sched_in.clone(), replies, admission, ev("admit"))
    nursery.start_soon(partial(schedule.run, sched_out, plan_in, result_out, detok_in,
                               built.scheduler, ev("schedule")))
    nursery.start_soon(partial(gpu_step.run, plan_out, result_in, built.runner, ev("gpu_step"),
                               faults=cfg.fault_step_kinds))
    nursery.start_soon(detokenize.run, detok_out, parse_in, sched_in,
                       detokenize.Detokenizer(tok), ev("detokenize"))
    nursery.start_soon(parse.run, parse_out, acct_in, parse.Parser(built.parsers.reasoning_parser, tok),
                       ev("parse"))
    nursery.start_soon(account.run, acct_out, emit_in, accountant, ev("account"))
    held = StreamInterval(cfg.stream_interval) if cfg.stream_interval > 1 else None
    nursery.start_soon(emit.run, emit_out, replies, emit.Emitter(), ev("emit"), held)
    if tp is not None:   # a worker rank that exits stops the engine as a failed stage does
        nursery.start_soon(tp.watch)
    return engine


async def _run_stages(cfg: EngineConfig, device: torch.device, built: Built,
                      events: EventLog | None, tp: TensorParallel | None = None, *,
                      task_status) -> None:
    """The stages in their own nursery. When one raises, the engine stops (Engine._stop)
    and the body gets STOP_GRACE_S before the error, raised here, cancels it."""
    engine: Engine | None = None
    try:
        async with trio.open_nursery() as stages:
            engine = _start(stages, cfg, device, built, events, tp)
            task_status.started(engine)
    except Exception as exc:
        if engine is None:
            raise
        log.error("the engine stopped: %s", describe(exc))
        engine._stop(exc)
        await trio.sleep(STOP_GRACE_S)
        raise


@contextlib.asynccontextmanager
async def open_engine(config: EngineConfig, loaded: LoadedModel | None = None
                      ) -> AsyncIterator[Engine]:
    """Load the model, start the eight stages, yield the running Engine; on exit cancel
    the stages and close the event log.

    ``loaded`` (a gpu.loader.LoadedModel) skips loading: tests share one model. Loading
    runs in a worker thread that a cancellation (Ctrl-C) abandons rather than waits for.
    A stage that raises stops the engine (see the module's docstring) and its error comes
    out of the ``async with``, whether the body finished on its own or was cancelled.
    """
    device = pick_device(config.device)
    async with open_tensor_parallel(config, device) as tp:
        if tp is None:
            built = await trio.to_thread.run_sync(partial(build, config, device, loaded),
                                                  abandon_on_cancel=True)
        else:   # rank 0 of --tensor-parallel-size: the workers build their shards alongside
            built = await tp.build(config, device, loaded)
        async with _running(config, device, built, tp) as engine:
            yield engine


@contextlib.asynccontextmanager
async def _running(config: EngineConfig, device: torch.device, built: Built,
                   tp: TensorParallel | None) -> AsyncIterator[Engine]:
    events = open_event_log(config, built) if config.event_log else None
    engine: Engine | None = None
    body_error: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            engine = await nursery.start(_run_stages, config, device, built, events, tp)
            freeze_heap()
            try:
                yield engine
            except BaseException as exc:
                body_error = exc
                raise
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        if engine is not None and engine.failure is not None:
            raise engine.failure from None     # the cause, whatever the body did meanwhile
        # The body's own error alone (the stages were only cancelled): raise it unwrapped.
        if body_error is not None and list(group.exceptions) == [body_error]:
            raise body_error from None
        raise
    finally:
        gc.unfreeze()        # what the engine held may be collected again
        if events is not None:
            events.close()
    if engine.failure is not None:   # the body finished within the grace: the failure stands
        raise engine.failure
