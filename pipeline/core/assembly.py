"""The pipeline, described once: the eight stages, their channels and back-edges, in the
two halves that every process layout cuts the same way.

    request side                                     engine core
    web -> render ──requests──▶ admit ──▶ schedule ◀══▶ gpu step
                                             │ steps (one Step per engine step)
    web <- emit <- account <- parse <- detokenize ◀─┘
           back-edges: Abort (web), FinishRequest (detokenize) ──▶ schedule's inbox

A layout chooses where the halves live and what stands at the three cuts (requests,
steps, back-edges):
- one process (pipeline/core/engine.py `open_engine`): memory channels;
- `--api-server-count N` (pipeline/layouts/): a request side in each frontend process
  (frontend.py) and the core in the engine process (engine_proc.py), the wire at the cuts;
- `--tensor-parallel-size N`: either, rank 0's core watching its worker ranks.
Every stage, channel size and start-up step is here or in the stage itself; a layout adds
only its transport. Combination rules (async scheduling with speculation) are
EngineConfig's, decided at construction.

Failure, one rule for every layout that holds a client (`running`): a stage that raises
(or a transport whose far end has gone) stops the client: `failure` set, every reply
ended with an error, new requests 503; the body (the HTTP server) gets STOP_GRACE_S to
write those errors, then the error comes out of the block.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import TYPE_CHECKING, TypeVar

import attrs
import trio

from pipeline.core.client import EngineClient
from pipeline.core.reply import describe
from stages.media.fetch import MediaSettings
from stages import account, admit, detokenize, emit, parse, render
from stages.admit import Admission
from stages.api.chat import MAX_CHOICES
from stages.replies import Replies
from stages.stream_interval import StreamInterval
from stages.render import RenderContext

if TYPE_CHECKING:   # the engine core's side brings torch; a frontend process never loads it
    from pipeline.core.config import EngineConfig
    from pipeline.core.events import EventLog
    from pipeline.core.parts import Built

log = logging.getLogger("tailrace")

STOP_GRACE_S = 2.0      # after a failure, how long the body may run on (see `running`)

C = TypeVar("C", bound=EngineClient)
Stage = Callable[[str], object]     # an event log's stage logger, by stage name


def _stage_events(events: EventLog | None) -> Stage:
    return events.stage if events is not None else (lambda name: None)


# -- sizes ---------------------------------------------------------------------------------------
@attrs.frozen
class Buffers:
    """The channels' sizes. Stage to stage they are 0 or 1 (one message per engine step in
    flight); these are the three that depend on the request limits."""
    requests: int        # web -> render: the requests waiting to be rendered
    max_admitted: int    # requests admitted at once (admit's limit)
    inbox: int           # schedule's inbox

    @classmethod
    def of(cls, max_queued_requests: int, max_num_seqs: int) -> Buffers:
        """At most max_queued_requests + max_num_seqs requests are admitted at once (a
        request counts until its last byte is sent), each putting at most one request, one
        Abort and one FinishRequest per choice (<= MAX_CHOICES) into schedule's inbox: the
        back-edges never block."""
        max_admitted = max_queued_requests + max_num_seqs
        return cls(requests=max_queued_requests, max_admitted=max_admitted,
                   inbox=(2 + MAX_CHOICES) * max_admitted + 16)


# -- the request side: render, and detokenize -> parse -> account -> emit -------------------------
@attrs.frozen
class RequestSideSpec:
    """What a request side's stages are made from: plain data, which the engine process
    hands each frontend process (pipeline/layouts/wire.py FrontendSetup)."""
    render_context: RenderContext
    reasoning_parser: str | None
    stream_interval: int
    max_queued_requests: int
    # the prefix cache's block size (0: no prefix caching): usage's created_cache_tokens
    cache_block: int = 0

    @classmethod
    def of(cls, cfg: EngineConfig, built: Built) -> RequestSideSpec:
        """Made where the model was built (the engine core's process)."""
        from pipeline.core.startup import chat_template_source, generation_defaults

        loaded = built.loaded
        if built.pooling is not None:   # a pooling model (pipeline/core/pooling.py)
            tok = loaded.tokenizer
            ctx = RenderContext(tokenizer=tok, served_model_names=built.model_names,
                                max_model_len=built.max_model_len,
                                vocab_size=tok.vocab_size if tok is not None else None,
                                chat_template=chat_template_source(cfg.chat_template),
                                pooling=built.pooling)
            return cls(render_context=ctx, reasoning_parser=None, stream_interval=1,
                       max_queued_requests=cfg.max_queued_requests)
        ctx = RenderContext(
            tokenizer=loaded.tokenizer, served_model_names=built.model_names,
            max_model_len=built.max_model_len,
            default_sampling=generation_defaults(cfg, loaded.generation_config),
            reasoning=built.parsers.reasoning_parser is not None,
            vocab_size=loaded.config.vocab_size,
            chat_template=chat_template_source(cfg.chat_template),
            max_tokens_ceiling=cfg.override_generation_config.get("max_new_tokens"),
            force_include_usage=cfg.enable_force_include_usage,
            per_request_metrics=cfg.enable_per_request_metrics,
            priority_scheduling=cfg.scheduling_policy == "priority",
            think_tags=built.scheduler.think_ids is not None,
            tools=built.parsers.tools, harmony=built.parsers.harmony, loras=built.loras,
            mistral=cfg.tokenizer_mode == "mistral" and loaded.tokenizer is not None,
            vision=loaded.vision_spec, prompt_tokens_details=cfg.enable_prompt_tokens_details,
            max_logprobs=cfg.max_logprobs,
            kv_transfer=cfg.kv_transfer_config,
            media=MediaSettings(allowed_domains=tuple(cfg.allowed_media_domains),
                                allowed_local_path=cfg.allowed_local_media_path,
                                limits=tuple(sorted(cfg.limit_mm_per_prompt.items())),
                                fetch_timeout_s=cfg.media_fetch_timeout,
                                max_bytes=cfg.max_media_bytes,
                                max_redirects=cfg.media_max_redirects))
        return cls(render_context=ctx, reasoning_parser=built.parsers.reasoning_parser,
                   stream_interval=cfg.stream_interval,
                   max_queued_requests=cfg.max_queued_requests,
                   cache_block=built.blocks.block_size if built.blocks.prefix_caching else 0)


@attrs.frozen(eq=False)
class RequestSide:
    """A started request side: what its client holds."""
    render_in: trio.MemorySendChannel     # web -> render
    replies: Replies                      # each request's reply channel (render, emit)
    accountant: account.Accountant | account.EngineAccounts


def start_request_side(nursery: trio.Nursery, spec: RequestSideSpec, *,
                       requests: trio.MemorySendChannel, steps: trio.MemoryReceiveChannel,
                       back_edges: trio.MemorySendChannel,
                       events: EventLog | None, engines: int = 1) -> RequestSide:
    """Start render (its requests go to `requests`) and the stages after schedule (its
    Steps come from `steps`; detokenize's FinishRequests go to `back_edges`). `engines`:
    data parallel's, each accounted apart (account.EngineAccounts)."""
    ev = _stage_events(events)
    ctx = spec.render_context
    tok = ctx.tokenizer
    replies = Replies(ctx.max_model_len + 4)
    accountant = (account.Accountant(ctx.max_model_len, spec.cache_block) if engines == 1
                  else account.EngineAccounts(ctx.max_model_len, engines, spec.cache_block))
    render_in, render_out = trio.open_memory_channel(spec.max_queued_requests)
    parse_in, parse_out = trio.open_memory_channel(1)
    acct_in, acct_out = trio.open_memory_channel(1)
    emit_in, emit_out = trio.open_memory_channel(1)
    held = StreamInterval(spec.stream_interval) if spec.stream_interval > 1 else None
    nursery.start_soon(render.run, render_out, requests, replies, ctx, ev("render"))
    if ctx.pooling is not None:     # pooled vectors: nothing to detokenize or parse
        nursery.start_soon(account.run, steps, emit_in, accountant, ev("account"))
    else:
        nursery.start_soon(detokenize.run, steps, parse_in, back_edges,
                           detokenize.Detokenizer(tok), ev("detokenize"))
        nursery.start_soon(parse.run, parse_out, acct_in,
                           parse.Parser(spec.reasoning_parser, tok), ev("parse"))
        nursery.start_soon(account.run, acct_out, emit_in, accountant, ev("account"))
    nursery.start_soon(emit.run, emit_out, replies, emit.Emitter(), ev("emit"), held)
    return RequestSide(render_in=render_in, replies=replies, accountant=accountant)


# -- the engine core: admit, schedule <=> gpu step ------------------------------------------------
def core_admission(cfg: EngineConfig, built: Built, admitted: Callable[[], int]) -> Admission:
    """admit's limits: `admitted` counts the requests in flight over every request side."""
    from gpu.worker.grammar import check as check_grammar     # xgrammar, torch: the core's process
    return Admission(max_admitted=Buffers.of(cfg.max_queued_requests, cfg.max_num_seqs).max_admitted,
                     kv_capacity_tokens=built.blocks.num_blocks * cfg.block_size,
                     admitted=admitted, grammar_check=check_grammar)


def start_engine_core(nursery: trio.Nursery, cfg: EngineConfig, built: Built, *, replies,
                      admission: Admission, requests: trio.MemoryReceiveChannel,
                      inbox: tuple[trio.MemorySendChannel, trio.MemoryReceiveChannel],
                      steps: trio.MemorySendChannel, events: EventLog | None,
                      watch: Callable[[], object] | None = None) -> None:
    """Start admit (reading `requests`, answering through `replies`: stages.replies.
    Replies in one process, the engine process's EngineReplies), schedule (its inbox
    `inbox`, whose send end admit gets a clone of; its Steps to `steps`) and the GPU step.
    `watch`: a task that raises when a tensor-parallel worker rank exits."""
    from gpu.kernels.cpu.openmp import release_team
    from stages import gpu_step, schedule   # torch: only where the core runs

    ev = _stage_events(events)
    inbox_send, inbox_receive = inbox
    plan_in, plan_out = trio.open_memory_channel(0)
    result_in, result_out = trio.open_memory_channel(0)
    nursery.start_soon(admit.run, requests, inbox_send.clone(), replies, admission, ev("admit"))
    # the scheduler's class says whether it plans ahead (startup.build: cfg.async_scheduling)
    nursery.start_soon(schedule.run, inbox_receive, plan_in, result_out, steps,
                       built.scheduler, ev("schedule"), built.sleeper)
    nursery.start_soon(partial(gpu_step.run, plan_out, result_in, built.runner, ev("gpu_step"),
                               faults=cfg.fault_step_kinds, release_team=release_team))
    if built.kv_connector is not None:   # --kv-transfer-config: the side channel, NIXL's notes
        from pipeline.core import kv_task
        nursery.start_soon(kv_task.run, built.kv_connector, inbox_send.clone(), built.scheduler)
    if watch is not None:
        nursery.start_soon(watch)


def inbox_channel(cfg: EngineConfig) -> tuple[trio.MemorySendChannel, trio.MemoryReceiveChannel]:
    """schedule's inbox, sized so that no back-edge ever blocks (Buffers)."""
    return trio.open_memory_channel(Buffers.of(cfg.max_queued_requests, cfg.max_num_seqs).inbox)


# -- failure: one rule ---------------------------------------------------------------------------
async def _supervise(start: Callable[[trio.Nursery], C], *, task_status) -> None:
    client: C | None = None
    try:
        async with trio.open_nursery() as nursery:
            client = start(nursery)
            task_status.started(client)
    except Exception as exc:
        if client is None:
            raise
        log.error("the engine stopped: %s", describe(exc))
        client.stop(exc)
        await trio.sleep(STOP_GRACE_S)
        raise


@contextlib.asynccontextmanager
async def running(start: Callable[[trio.Nursery], C]) -> AsyncIterator[C]:
    """Start a layout's stages with ``start(nursery)``, which returns their client, and
    yield it; leaving the block cancels them. A stage that raises stops the client (see
    the module's docstring) and its error comes out of the block, whether the body
    finished within the grace or was cancelled."""
    client: C | None = None
    body_error: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            client = await nursery.start(_supervise, start)
            try:
                yield client
            except BaseException as exc:
                body_error = exc
                raise
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        if client is not None and client.failure is not None:
            raise client.failure from None     # the cause, whatever the body did meanwhile
        # The body's own error alone (the stages were only cancelled): raise it unwrapped.
        if body_error is not None and list(group.exceptions) == [body_error]:
            raise body_error from None
        raise
    if client.failure is not None:   # the body finished within the grace: the failure stands
        raise client.failure
