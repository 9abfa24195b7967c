"""The engine: loads the model, wires the eight stages into one nursery, and is the
only thing web talks to (submit, Reply, stats).

    web -> render -> admit -> schedule <=> gpu step
                                 |
           web <- emit <- account <- parse <- detokenize

Back-edges go into schedule's inbox only: aborts (web) and stop-string finishes
(detokenize), through cloned send channels.

Lifetime: ``async with open_engine(config) as engine:`` loads the model (in a worker
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
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import attrs
import jinja2
import torch
import trio

from gpu.attention import KVCache
from gpu.grammar import GrammarCompiler
from gpu.harmony import uses_harmony
from gpu.loader import LoadedModel
from gpu.runner import ModelRunner
from gpu.simulate import GPUS, CostModel, SimulatedRunner, ordinary_token_ids
from pipeline.config import EngineConfig
from pipeline.events import EventLog, make_header
from stages import account, admit, detokenize, emit, gpu_step, parse, render, schedule
from stages.admit import Accepted, Admission
from stages.api.chat import MAX_CHOICES
from stages.api.protocol import ToolSettings
from stages.api.framing import DONE, json_body, sse_data
from stages.api.protocol import server_error
from stages.blocks import BlockManager
from stages.harmony import HARMONY_REASONING_PARSER, HARMONY_TOOL_PARSER
from stages.render import RenderContext, RequestError, Submission
from stages.replies import Replies
from stages.schedule import Abort, Scheduler
from stages.stream_interval import StreamInterval

log = logging.getLogger("tailrace")

_CPU_KV_DEFAULT_BYTES = 1 << 30
STOP_GRACE_S = 2.0      # after a stage failure, how long the body may run on (see open_engine)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but torch sees no CUDA device")
    return torch.device(name)


class Reply:
    """One request's framed reply. Iterate for bytes; aclose() aborts if unfinished."""

    def __init__(self, engine: "Engine", request_id: str, stream: bool,
                 receive: trio.MemoryReceiveChannel) -> None:
        self.engine = engine
        self.request_id = request_id
        self.stream = stream
        self.status = 200
        self._receive = receive
        self.finished = False

    def __aiter__(self):
        return self._iter()

    async def _iter(self):
        # Whatever has piled up since the reader last ran goes out as one chunk: when the
        # event loop is busier than one step per read (hundreds of streams), each stream
        # costs one socket write per read instead of one per engine step.
        receive = self._receive
        async for item in receive:
            parts = []
            while True:
                if isinstance(item, emit.ReplyEnd):
                    self.status = item.status
                    self.finished = True
                else:
                    parts.append(item)
                try:
                    item = receive.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            if parts:
                yield parts[0] if len(parts) == 1 else b"".join(parts)
        if not self.finished:  # the channel closed before its last item: the engine stopped
            self.finished = True
            self.status = 500
            error = server_error(f"The engine stopped: {describe(self.engine.failure)}")
            yield sse_data(error) + DONE if self.stream else json_body(error)

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self])

    async def aclose(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)
        await self._receive.aclose()


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
    render_context: RenderContext           # what /tokenize and /detokenize use
    schedule_in: trio.MemorySendChannel     # aborts -> schedule's inbox
    event_log: EventLog | None = None       # --event-log (web/cli.py adds the API keys to hide)
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

    # -- shutdown (web/cli.py drives it) ------------------------------------------------------
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

    def stats(self) -> dict:
        s, a = self.scheduler, self.accountant
        return {
            "num_running": len(s.running),
            "num_waiting": len(s.waiting),
            "num_preemptions": s.num_preemptions,
            "kv_blocks_total": self.blocks.num_blocks,
            "kv_blocks_free": self.blocks.num_free,
            "kv_blocks_used": self.blocks.num_used,
            "kv_blocks_cached": len(self.blocks.cached),
            "prompt_tokens_total": a.prompt_tokens_total,
            "generation_tokens_total": a.generation_tokens_total,
            "cached_tokens_total": a.cached_tokens_total,
            "prefix_cache_queries_total": a.prefix_cache_queries_total,
            "prefix_cache_hits_total": a.prefix_cache_hits_total,
            "requests_finished_total": dict(a.finished_total),
            "steps_total": s.step,
            "latency": {"ttft": a.ttft, "itl": a.itl, "e2e": a.e2e, "queue": a.queue,
                        "prefill": a.prefill, "decode": a.decode},
        }


# -- start-up -------------------------------------------------------------------------------

@attrs.frozen
class Parsers:
    """The reasoning and tool parsers a model is served with: the flags', or Harmony's."""
    reasoning_parser: str | None
    tools: ToolSettings
    harmony: bool = False

    @classmethod
    def of(cls, cfg: EngineConfig, model_config) -> "Parsers":
        """gpt-oss (model_type gpt_oss) speaks only Harmony: --reasoning-parser
        openai_gptoss and --tool-call-parser openai (with auto tool choice) are implied, and
        tool_choice "none" leaves the tools out of the prompt. Those two parsers read
        Harmony tokens, so they serve no other model."""
        if not uses_harmony(model_config):
            if cfg.reasoning_parser == HARMONY_REASONING_PARSER:
                raise ValueError(f"--reasoning-parser {HARMONY_REASONING_PARSER} needs a gpt-oss "
                                 "model (Harmony format)")
            if cfg.tool_call_parser == HARMONY_TOOL_PARSER:
                raise ValueError(f"--tool-call-parser {HARMONY_TOOL_PARSER} needs a gpt-oss "
                                 "model (Harmony format)")
            return cls(cfg.reasoning_parser, ToolSettings(
                cfg.enable_auto_tool_choice, cfg.tool_call_parser,
                cfg.exclude_tools_when_tool_choice_none))
        if cfg.reasoning_parser not in (None, HARMONY_REASONING_PARSER):
            raise ValueError(f"--reasoning-parser {cfg.reasoning_parser}: gpt-oss models speak "
                             f"Harmony; use {HARMONY_REASONING_PARSER} (implied) or leave it out")
        if cfg.tool_call_parser not in (None, HARMONY_TOOL_PARSER):
            raise ValueError(f"--tool-call-parser {cfg.tool_call_parser}: gpt-oss models speak "
                             f"Harmony; use {HARMONY_TOOL_PARSER} (implied) or leave it out")
        return cls(HARMONY_REASONING_PARSER, ToolSettings(True, HARMONY_TOOL_PARSER, True),
                   harmony=True)


@attrs.frozen
class _Built:
    """What the synchronous part of start-up makes (in a worker thread)."""

    loaded: LoadedModel
    model_names: tuple[str, ...]
    max_model_len: int
    runner: ModelRunner | SimulatedRunner
    blocks: BlockManager
    scheduler: Scheduler
    parsers: Parsers


def _build(cfg: EngineConfig, device: torch.device, loaded: LoadedModel | None) -> _Built:
    """Weights, tokenizer, KV cache, runner, scheduler."""
    from gpu.loader import (choose_dtype, choose_residual_dtype, cpu_threads, implied_tokenizer,
                            load_model, load_shell, load_tokenizer, merge_eos_ids)

    t0 = time.perf_counter()
    if loaded is None and cfg.simulate_gpu:
        loaded = load_shell(cfg.model, load_format=cfg.load_format)
        log.info("simulating a %s: no weights loaded, the forward is a timed wait",
                 GPUS[cfg.simulate_gpu].name)
    elif loaded is None:
        dtype, why = choose_dtype(cfg.dtype, device)
        residual, rwhy = choose_residual_dtype(cfg.residual_dtype, dtype, device)
        log.info("dtype %s (%s), residual stream %s (%s)%s", str(dtype).removeprefix("torch."), why,
                 str(residual).removeprefix("torch."), rwhy,
                 f"; {cpu_threads()}" if device.type == "cpu" else "")
        loaded = load_model(cfg.model, load_format=cfg.load_format, dtype=dtype,
                            device=str(device), seed=cfg.seed, residual_dtype=residual)
    if cfg.tokenizer:
        tok = load_tokenizer(cfg.tokenizer)
        loaded = attrs.evolve(loaded, tokenizer=tok, eos_token_ids=merge_eos_ids(
            tok, loaded.config, loaded.generation_config))
    parsers = Parsers.of(cfg, loaded.config)
    if parsers.harmony and loaded.tokenizer is None and not cfg.skip_tokenizer_init:
        # a dummy gpt-oss config ships no tokenizer.json: Harmony's o200k, offline
        tok = implied_tokenizer(loaded.config)
        loaded = attrs.evolve(loaded, tokenizer=tok, eos_token_ids=merge_eos_ids(
            tok, loaded.config, loaded.generation_config))
    if cfg.skip_tokenizer_init:
        loaded = attrs.evolve(loaded, tokenizer=None)
    mc = loaded.config
    model_names = tuple(cfg.served_model_name) or (loaded.name,)
    max_model_len = cfg.max_model_len or min(loaded.max_model_len, mc.max_position_embeddings)
    if cfg.max_model_len is not None and cfg.max_model_len > mc.max_position_embeddings:
        log.warning("--max-model-len %d exceeds the model's max_position_embeddings %d",
                    cfg.max_model_len, mc.max_position_embeddings)
    if cfg.simulate_gpu:
        cost = CostModel.of(mc, GPUS[cfg.simulate_gpu])
        num_blocks = cfg.num_gpu_blocks_override or cost.kv_blocks(cfg.block_size,
                                                                   cfg.gpu_memory_utilization)
        runner = SimulatedRunner(cost, cfg.block_size,
                                 ordinary_token_ids(loaded.tokenizer, mc.vocab_size), cfg.seed)
    else:
        num_blocks = _num_kv_blocks(cfg, loaded, device, max_model_len, _step_budget(cfg))
        cache = KVCache(mc.num_hidden_layers, num_blocks, cfg.block_size, mc.num_key_value_heads,
                        mc.head_dim, loaded.model.dtype, device)
        runner = ModelRunner(loaded.model, cache, device=device, seed=cfg.seed,
                             use_triton=device.type == "cuda", max_model_len=max_model_len,
                             cuda_graph_max_bs=0 if cfg.enforce_eager else min(cfg.max_num_seqs, 512))
        if device.type == "cuda":  # compile what the first steps would, before any request
            try:
                runner.warm_up(_step_budget(cfg), cfg.max_num_seqs)
            except Exception as exc:  # the first real step will say more; do not hide it
                log.error("warm-up failed: %s", exc, exc_info=exc)
            log.info("CUDA graphs %s (%.1fs); warm-up %.1fs",
                     f"captured for {runner.cuda_graph_sizes}" if runner.cuda_graphs else "off",
                     runner.cuda_graph_capture_s, runner.warmup_s)
    budget = _step_budget(cfg)
    blocks = BlockManager(num_blocks, cfg.block_size, enable_prefix_caching=cfg.enable_prefix_caching)
    grammars = (GrammarCompiler(loaded.tokenizer, mc.vocab_size, loaded.eos_token_ids)
                if loaded.tokenizer is not None else None)
    scheduler = Scheduler(blocks, max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=budget,
                          max_model_len=max_model_len, eos_token_ids=loaded.eos_token_ids,
                          grammars=grammars,
                          think_ids=_think_ids(parsers.reasoning_parser, loaded.tokenizer))
    if num_blocks * cfg.block_size < max_model_len:
        log.warning("the KV cache holds %d tokens, fewer than --max-model-len %d: longer requests "
                    "will be refused; raise --kv-cache-memory-bytes / --gpu-memory-utilization "
                    "or lower --max-model-len", num_blocks * cfg.block_size, max_model_len)
    if loaded.tokenizer is None:
        log.warning("the model has no tokenizer: only token-id prompts are accepted and "
                    "replies carry no text (like vLLM's --skip-tokenizer-init)")
    log.info("loaded %s (%s, %s) in %.1fs; KV cache %d blocks x %d tokens",
             model_names[0], mc.architecture, device, time.perf_counter() - t0,
             num_blocks, cfg.block_size)
    return _Built(loaded=loaded, model_names=model_names, max_model_len=max_model_len,
                  runner=runner, blocks=blocks, scheduler=scheduler, parsers=parsers)


def _think_ids(reasoning_parser: str | None, tokenizer) -> tuple[int, int] | None:
    """With a <think> reasoning parser, constrained output starts after </think>: the tags'
    ids, when each is one token. (Harmony's constrained output is the whole answer.)"""
    if reasoning_parser in (None, HARMONY_REASONING_PARSER) or tokenizer is None:
        return None
    ids = tuple(tokenizer.hf.token_to_id(t) for t in ("<think>", "</think>"))
    if None in ids:
        log.warning("--reasoning-parser: <think>/</think> are not single tokens of this "
                    "tokenizer; constrained output is constrained from its first token")
        return None
    return ids


def _step_budget(cfg: EngineConfig) -> int:
    """Tokens one engine step may schedule."""
    return cfg.max_num_batched_tokens or max(2048, cfg.max_num_seqs)


def _num_kv_blocks(cfg: EngineConfig, loaded: LoadedModel, device: torch.device,
                   max_model_len: int, step_tokens: int) -> int:
    mc = loaded.config
    if cfg.num_gpu_blocks_override:
        return cfg.num_gpu_blocks_override
    per_block = KVCache.bytes_per_block(mc.num_hidden_layers, cfg.block_size,
                                        mc.num_key_value_heads, mc.head_dim, loaded.model.dtype)
    if cfg.kv_cache_memory_bytes:  # on every device
        return max(1, cfg.kv_cache_memory_bytes // per_block)
    if device.type == "cuda":
        from gpu.runner import kv_budget_bytes, profile_step_bytes

        peak = profile_step_bytes(loaded.model, block_size=cfg.block_size, max_tokens=step_tokens,
                                  max_seqs=cfg.max_num_seqs, device=device)
        free, total = torch.cuda.mem_get_info(device)
        budget = kv_budget_bytes(total=total, free=free, step_peak=peak,
                                 utilization=cfg.gpu_memory_utilization)
        log.info("profiled one full-size step (%d tokens, %d sequences): %.2f GiB at its peak; "
                 "KV cache budget %.2f GiB", step_tokens, cfg.max_num_seqs, peak / 2**30,
                 max(0, budget) / 2**30)
        if budget <= per_block:
            raise ValueError("no GPU memory left for the KV cache; raise --gpu-memory-utilization "
                             "or set --kv-cache-memory-bytes")
        return budget // per_block
    # CPU default: 1 GiB, or less when that is more than every sequence could use.
    enough = cfg.max_num_seqs * math.ceil(max_model_len / cfg.block_size)
    return max(1, min(_CPU_KV_DEFAULT_BYTES // per_block, enough))


def generation_defaults(cfg: EngineConfig, model_generation_config: dict | None) -> dict:
    """Sampling defaults for requests that leave a field out: --generation-config's source,
    then --override-generation-config on top (vLLM's two flags)."""
    source = cfg.generation_config
    if source == "auto":
        base = dict(model_generation_config or {})
    elif source == "vllm":
        base = {}
    else:
        path = Path(source) / "generation_config.json"
        try:
            base = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"--generation-config {source}: cannot read {path}: {exc}") from None
    return {**base, **cfg.override_generation_config}


def chat_template_source(value: str | None) -> str | None:
    """--chat-template: a file holding a Jinja template, or the template itself; checked
    for syntax at start-up rather than at the first request."""
    if value is None:
        return None
    path = Path(value)
    source = path.read_text() if len(value) < 4096 and path.is_file() else value
    try:
        jinja2.Environment().parse(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template does not parse: {exc}") from None
    return source


def _start(nursery: trio.Nursery, cfg: EngineConfig, device: torch.device, built: _Built,
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
                               async_scheduling=cfg.async_scheduling))
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


def _open_event_log(cfg: EngineConfig, built: _Built) -> EventLog:
    """The event log, its header line written (docs/events.md)."""
    from gpu.loader import default_model_path

    events = EventLog(cfg.event_log, max_bytes=cfg.event_log_max_bytes,
                      backup_count=cfg.event_log_backup_count)
    events.write_header(make_header(
        cfg, model_path=str(cfg.model or built.loaded.path or default_model_path()),
        model_name=built.loaded.name, tokenizer=built.loaded.tokenizer,
        served_model_names=built.model_names, max_model_len=built.max_model_len,
        kv_blocks_total=built.blocks.num_blocks, block_size=cfg.block_size,
        parsers=built.parsers))
    return events


def describe(exc: BaseException | None) -> str:
    """One line for an error (a group of one is its member)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return "unknown error" if exc is None else f"{type(exc).__name__}: {exc}"


async def _run_stages(cfg: EngineConfig, device: torch.device, built: _Built,
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


def _freeze_heap() -> None:
    """Once loaded, move everything alive (the model, the tokenizer, the modules) out of
    the cyclic garbage collector's sight, as vLLM does: otherwise every full collection
    while serving walks those hundreds of thousands of objects, a stall of about 0.15 s
    on the GIL the engine steps need (docs/benchmarks.md, "garbage collector").
    open_engine unfreezes on exit."""
    gc.collect()
    gc.freeze()


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
    built = await trio.to_thread.run_sync(partial(_build, config, device, loaded),
                                          abandon_on_cancel=True)
    events = _open_event_log(config, built) if config.event_log else None
    engine: Engine | None = None
    body_error: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            engine = await nursery.start(_run_stages, config, device, built, events)
            _freeze_heap()
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
