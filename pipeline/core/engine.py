"""The one-process layout: the pipeline's two halves (pipeline/core/assembly.py) in one
trio process, joined by memory channels, and `Engine`, the only thing web talks to
(submit, Reply, stats). Start-up (loading, KV sizing, templates) is pipeline/core/startup.py;
a request's reply is pipeline/core/reply.py.

Lifetime: ``async with open_engine(config) as engine:`` runs start-up (in a worker
thread Ctrl-C can abandon; with --tensor-parallel-size, after starting the worker ranks,
pipeline/layouts/tp_procs.py, which it stops on the way out), starts the stages in the
context manager's own nursery and yields a running Engine; leaving the block cancels the
stages and closes the event log. A stage that raises stops the engine as
pipeline/core/assembly.py `running` says, and its error comes out of the block.
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import AsyncIterator

import attrs
import torch
import trio

from gpu.loader.decoder import LoadedModel
from gpu.loader.pooling import LoadedPooling
from gpu.worker.pooling_runner import PoolingRunner
from gpu.worker.runner import ModelRunner
from gpu.worker.simulate import SimulatedRunner
from pipeline.core.assembly import (RequestSideSpec, core_admission, inbox_channel, running,
                                    start_engine_core, start_request_side)
from pipeline.core.client import EngineClient
from pipeline.core.config import EngineConfig
from pipeline.core.events import EventLog
from pipeline.core.parts import Built
from pipeline.core.startup import freeze_heap, open_event_log
from pipeline.core.stats import AccountStats, CoreStats, EngineStats, cache_config_labels
from pipeline.layouts.tp_procs import TensorParallel, open_built
from stages import account
from stages.messages import Control
from stages.schedule.blocks import BlockManager
from stages.schedule import Scheduler


@attrs.define(kw_only=True, eq=False)
class Engine(EngineClient):
    """A running engine: built and started by open_engine, never half-made. What web
    calls (submit, abort, the drain) is pipeline/core/client.py's, shared with a frontend
    process's RemoteEngine; this adds the stages' own state."""

    config: EngineConfig
    device: torch.device
    loaded: LoadedModel | LoadedPooling
    runner: ModelRunner | SimulatedRunner | PoolingRunner
    blocks: BlockManager
    scheduler: Scheduler
    accountant: account.Accountant

    async def control(self, op: str, **kw) -> object:
        """Send schedule a Control (stages/messages.py) and wait for its answer."""
        done, box = trio.Event(), []

        def answer(value: object) -> None:
            box.append(value)
            done.set()

        await self.schedule_in.send(Control(op, answer, **kw))
        await done.wait()
        return box[0]

    async def fetch_stats(self) -> EngineStats:
        """The stats for a /metrics scrape: read at once here (a frontend process's
        RemoteEngine asks the engine process instead)."""
        return self.stats()

    def stats(self) -> EngineStats:
        return EngineStats.merge(CoreStats.of(self.scheduler, self.blocks, self.cache_config,
                                                self.config.enable_lora),
                                 [AccountStats.of(self.accountant)])

    @property
    def cache_config(self) -> dict[str, str]:
        return cache_config_labels(self.config, self.blocks.num_blocks, self.max_model_len,
                                   self.blocks.prefix_caching)


def _start(nursery: trio.Nursery, cfg: EngineConfig, device: torch.device, built: Built,
           events: EventLog | None, tp: TensorParallel | None) -> Engine:
    """Both halves in `nursery`, joined by memory channels; return the running Engine."""
    requests_in, requests_out = trio.open_memory_channel(0)
    steps_in, steps_out = trio.open_memory_channel(1)
    inbox_in, inbox_out = inbox_channel(cfg)
    spec = RequestSideSpec.of(cfg, built)
    side = start_request_side(nursery, spec, requests=requests_in, steps=steps_out,
                              back_edges=inbox_in.clone(), events=events)
    admission = core_admission(cfg, built, lambda: side.replies.num_admitted)
    start_engine_core(nursery, cfg, built, replies=side.replies, admission=admission,
                      requests=requests_out, inbox=(inbox_in, inbox_out), steps=steps_in,
                      events=events, watch=None if tp is None else tp.watch)
    return Engine(config=cfg, device=device, loaded=built.loaded, model_names=built.model_names,
                  max_model_len=built.max_model_len, runner=built.runner, blocks=built.blocks,
                  scheduler=built.scheduler, accountant=side.accountant, replies=side.replies,
                  admission=admission, render_in=side.render_in,
                  render_context=spec.render_context, schedule_in=inbox_in, event_log=events,
                  sleep_mode=cfg.enable_sleep_mode)


@contextlib.asynccontextmanager
async def open_engine(config: EngineConfig, loaded: LoadedModel | None = None, *,
                      secrets: frozenset[str] = frozenset()) -> AsyncIterator[Engine]:
    """Load the model, start the eight stages, yield the running Engine; on exit cancel
    the stages and close the event log.

    ``loaded`` (a gpu.loader.decoder.LoadedModel) skips loading: tests share one model. Loading
    runs in a worker thread that a cancellation (Ctrl-C) abandons rather than waits for.
    ``secrets`` (the API keys) are never written to the event log.
    """
    async with open_built(config, loaded) as (device, built, tp):
        events = open_event_log(config, built, secrets) if config.event_log else None
        try:
            async with running(lambda nursery: _start(nursery, config, device, built, events,
                                                      tp)) as engine:
                freeze_heap()
                yield engine
        finally:
            gc.unfreeze()        # what the engine held may be collected again
            if events is not None:
                events.close()
