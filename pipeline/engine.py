"""The running engine: wires the eight stages into one nursery, and is the only thing
web talks to (submit, Reply, stats). Start-up (loading, KV sizing, templates) is
pipeline/startup.py; a request's reply is pipeline/reply.py.

    web -> render -> admit -> schedule <=> gpu step
                                 |
           web <- emit <- account <- parse <- detokenize

Back-edges go into schedule's inbox only: aborts (web) and stop-string finishes
(detokenize), through cloned send channels.

Lifetime: ``async with open_engine(config) as engine:`` runs start-up (in a worker
thread Ctrl-C can abandon), starts the stages in the context manager's own nursery and
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
import time
import uuid
from collections.abc import AsyncIterator
from functools import partial
from typing import TYPE_CHECKING

import attrs
import torch
import trio

from gpu.loader import LoadedModel
from gpu.runner import ModelRunner
from gpu.simulate import SimulatedRunner
from pipeline.config import EngineConfig
from pipeline.events import EventLog
from pipeline.reply import Reply, describe
from pipeline.startup import (Built, build, chat_template_source, freeze_heap,
                              generation_defaults, open_event_log, pick_device)
from pipeline.stats import EngineStats, Latencies, SpecDecodeStats
from stages import account, admit, detokenize, emit, gpu_step, parse, render, schedule
from stages.admit import Accepted, Admission
from stages.api.chat import MAX_CHOICES
from stages.blocks import BlockManager
from stages.messages import Abort, Submission
from stages.render import RenderContext, RequestError
from stages.replies import Replies
from stages.schedule import Scheduler
from stages.stream_interval import StreamInterval

if TYPE_CHECKING:
    from stages.api.tokenize import DetokenizeResponse, TokenizeResponse

log = logging.getLogger("tailrace")

STOP_GRACE_S = 2.0      # after a stage failure, how long the body may run on (see open_engine)


@attrs.define(kw_only=True, eq=False)
class Engine:
    """A running engine: built and started by open_engine, never half-made."""

    config: EngineConfig
    device: torch.device
    loaded: LoadedModel
    model_names: tuple[str, ...]
    max_model_len: int
    runner: ModelRunner | SimulatedRunner
    blocks: BlockManager
    scheduler: Scheduler
    accountant: account.Accountant
    replies: Replies
    admission: Admission
    render_in: trio.MemorySendChannel       # web -> render
    render_context: RenderContext           # what tokenize and detokenize use
    schedule_in: trio.MemorySendChannel     # aborts -> schedule's inbox
    event_log: EventLog | None = None       # --event-log (web/server.py adds the API keys to hide)
    failure: BaseException | None = None    # a stage raised: the engine has stopped

    @property
    def healthy(self) -> bool:
        """Running and taking requests (/health): not stopped, not draining."""
        return self.failure is None and not self.admission.draining

    async def submit(self, api: str, body: object, request_id: str | None = None,
                     headers: tuple[tuple[str, str], ...] = ()) -> Reply:
        """Render and admit one request. Raises RequestError before anything is streamed.

        A request that admission would refuse whatever it asks (overload, shutdown) is
        refused here at once, before render spends any work on it."""
        refusal = self._stopped_error() or self.admission.refusal()
        if refusal is not None:
            raise refusal
        rid = request_id or uuid.uuid4().hex
        if rid in self.replies:
            rid = f"{rid}-{uuid.uuid4().hex[:8]}"
        receive = self.replies.open(rid)
        accepted = False
        try:
            try:
                await self.render_in.send(Submission(rid, api, body, time.monotonic(), headers))
                first = await receive.receive()
            except (trio.EndOfChannel, trio.BrokenResourceError):  # the engine stopped meanwhile
                raise self._stopped_error() from None
            if isinstance(first, RequestError):
                raise first
            assert isinstance(first, Accepted), first
            accepted = True
            return Reply(self, rid, first.stream, receive)
        finally:
            if not accepted:  # refused (already released), or cancelled on the way in
                self.abort(rid)

    def tokenize(self, body: object) -> TokenizeResponse:
        """POST /tokenize: the prompt's token ids as render would make them, at once (no
        engine step). Raises RequestError."""
        return render.tokenize(body, self.render_context)

    def detokenize(self, body: object) -> DetokenizeResponse:
        """POST /detokenize: token ids back to text, at once. Raises RequestError."""
        return render.detokenize(body, self.render_context)

    def _stopped_error(self) -> RequestError | None:
        if self.failure is None:
            return None
        return RequestError(f"The engine stopped: {describe(self.failure)}", status=503,
                            type="server_error", code="engine_stopped")

    def abort(self, request_id: str) -> None:
        """The client is gone. Its request keeps its admission slot until emit releases it."""
        self.replies.detach(request_id)
        self._abort(request_id, None)

    def _abort(self, request_id: str, error: str | None) -> None:
        # Only an admitted request is known to schedule, and each gets one Abort at most:
        # schedule's inbox is sized for that (see _start), so this never blocks. A request
        # not admitted yet is dropped by admit once its reply is detached.
        if not self.replies.mark_aborted(request_id):
            return
        try:
            self.schedule_in.send_nowait(Abort(request_id, error))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # the engine is shutting down

    # -- shutdown (web/server.py drives it) ---------------------------------------------------
    def begin_drain(self) -> None:
        """Take no new request (503, and /health 503); those in flight run on."""
        self.admission.draining = True

    def abort_all(self, message: str) -> None:
        """End every admitted request now with `message` as an in-band error (an error
        chunk and [DONE], or a 500 body); schedule frees their blocks with its next step."""
        for rid in self.replies.admitted_ids():
            self._abort(rid, message)

    async def wait_idle(self) -> None:
        """Until no request is in flight (every reply's last byte handed to its reader)."""
        await self.replies.wait_empty()

    def _stop(self, exc: BaseException) -> None:
        """A stage raised: refuse everything from now on and end every reply with an error."""
        self.failure = exc
        self.replies.close_all()

    def stats(self) -> EngineStats:
        s, a = self.scheduler, self.accountant
        return EngineStats(
            num_running=len(s.running), num_waiting=len(s.waiting),
            num_preemptions=s.num_preemptions, kv_blocks_total=self.blocks.num_blocks,
            kv_blocks_free=self.blocks.num_free, kv_blocks_used=self.blocks.num_used,
            kv_blocks_cached=len(self.blocks.cached),
            prompt_tokens_total=a.prompt_tokens_total,
            generation_tokens_total=a.generation_tokens_total,
            cached_tokens_total=a.cached_tokens_total,
            prefix_cache_queries_total=a.prefix_cache_queries_total,
            prefix_cache_hits_total=a.prefix_cache_hits_total,
            requests_finished_total=dict(a.finished_total), steps_total=s.step,
            latency=Latencies(ttft=a.ttft, itl=a.itl, e2e=a.e2e, queue=a.queue,
                              prefill=a.prefill, decode=a.decode),
            spec_decode=None if s.drafter is None else SpecDecodeStats(
                num_drafts=s.spec.num_drafts, num_draft_tokens=s.spec.num_draft_tokens,
                num_accepted_tokens=s.spec.num_accepted_tokens,
                accepted_per_pos=tuple(s.spec.accepted_per_pos)))


# -- the stages, wired -----------------------------------------------------------------

def _start(nursery: trio.Nursery, cfg: EngineConfig, device: torch.device, built: Built,
           events: EventLog | None) -> Engine:
    """Open the channels, start every stage in `nursery`, return the running Engine."""
    ev = events.stage if events else (lambda name: None)
    loaded, tok = built.loaded, built.loaded.tokenizer
    replies = Replies(built.max_model_len + 4)
    accountant = account.Accountant()
    ctx = RenderContext(tokenizer=tok, served_model_names=built.model_names,
                        max_model_len=built.max_model_len,
                        default_sampling=generation_defaults(cfg, loaded.generation_config),
                        reasoning=built.parsers.reasoning_parser is not None,
                        vocab_size=loaded.config.vocab_size,
                        chat_template=chat_template_source(cfg.chat_template),
                        max_tokens_ceiling=cfg.override_generation_config.get("max_new_tokens"),
                        force_include_usage=cfg.enable_force_include_usage,
                        per_request_metrics=cfg.enable_per_request_metrics,
                        tools=built.parsers.tools, harmony=built.parsers.harmony)
    # Admitted at once: at most max_queued_requests + max_num_seqs requests (admission
    # counts a request until emit has sent its last byte), each putting at most one request,
    # one Abort and one FinishRequest per choice (<= MAX_CHOICES) into schedule's inbox: the
    # back-edges never block.
    max_admitted = cfg.max_queued_requests + cfg.max_num_seqs
    inbox_size = (2 + MAX_CHOICES) * max_admitted + 16
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
                               built.scheduler, ev("schedule"),
                               # drafts need the last token: no planning ahead (docs/cli.md)
                               async_scheduling=(cfg.async_scheduling
                                                 and cfg.speculative_config is None)))
    nursery.start_soon(partial(gpu_step.run, plan_out, result_in, built.runner, ev("gpu_step"),
                               faults=cfg.fault_step_kinds))
    nursery.start_soon(detokenize.run, detok_out, parse_in, sched_in,
                       detokenize.Detokenizer(tok), ev("detokenize"))
    nursery.start_soon(parse.run, parse_out, acct_in, parse.Parser(built.parsers.reasoning_parser),
                       ev("parse"))
    nursery.start_soon(account.run, acct_out, emit_in, accountant, ev("account"))
    held = StreamInterval(cfg.stream_interval) if cfg.stream_interval > 1 else None
    nursery.start_soon(emit.run, emit_out, replies, emit.Emitter(), ev("emit"), held)
    return engine


async def _run_stages(cfg: EngineConfig, device: torch.device, built: Built,
                      events: EventLog | None, *, task_status) -> None:
    """The stages in their own nursery. When one raises, the engine stops (Engine._stop)
    and the body gets STOP_GRACE_S before the error, raised here, cancels it."""
    engine: Engine | None = None
    try:
        async with trio.open_nursery() as stages:
            engine = _start(stages, cfg, device, built, events)
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
    built = await trio.to_thread.run_sync(partial(build, config, device, loaded),
                                          abandon_on_cancel=True)
    events = open_event_log(config, built) if config.event_log else None
    engine: Engine | None = None
    body_error: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            engine = await nursery.start(_run_stages, config, device, built, events)
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
