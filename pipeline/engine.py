"""The engine: loads the model, wires the eight stages into one nursery, and is the
only thing web talks to (submit, Reply, stats).

    web -> render -> admit -> schedule <=> gpu step
                                 |
           web <- emit <- account <- parse <- detokenize

Back-edges go into schedule's inbox only: aborts (web) and stop-string finishes
(detokenize), through cloned send channels.
"""
from __future__ import annotations

import logging
import math
import time
import uuid

import torch
import trio

from gpu.attention import KVCache
from gpu.runner import ModelRunner
from pipeline.config import EngineConfig
from pipeline.events import EventLog
from stages import account, admit, detokenize, emit, gpu_step, parse, render, schedule
from stages.admit import Accepted, Admission
from stages.blocks import BlockManager
from stages.render import RenderContext, RequestError, Submission
from stages.replies import Replies
from stages.schedule import Abort, Scheduler

log = logging.getLogger("tailrace")

_CPU_KV_DEFAULT_BYTES = 1 << 30


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
        async for item in self._receive:
            if isinstance(item, emit.ReplyEnd):
                self.status = item.status
                self.finished = True
                continue
            yield item
        self.finished = True

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self])

    async def aclose(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)
        await self._receive.aclose()


class Engine:
    def __init__(self, config: EngineConfig, loaded=None) -> None:
        """``loaded`` (a gpu.loader.LoadedModel) skips loading: tests share one model."""
        self.config = config
        self.device = pick_device(config.device)
        self.model_names: tuple[str, ...] = tuple(config.served_model_name)
        self.max_model_len = 0
        self.ready = trio.Event()
        self.loaded = loaded
        self.runner: ModelRunner | None = None
        self.blocks: BlockManager | None = None
        self.scheduler: Scheduler | None = None
        self.accountant: account.Accountant | None = None
        self.replies: Replies | None = None
        self.events: EventLog | None = None
        self._render_in: trio.MemorySendChannel | None = None
        self._schedule_in: trio.MemorySendChannel | None = None

    # -- start-up ------------------------------------------------------------------------
    def load(self) -> None:
        """Synchronous part of start-up: weights, tokenizer, KV cache, runner, cores."""
        from gpu.loader import load_model

        cfg = self.config
        t0 = time.perf_counter()
        loaded = self.loaded or load_model(cfg.model, load_format=cfg.load_format, dtype=cfg.dtype,
                                           device=str(self.device), seed=cfg.seed)
        self.loaded = loaded
        mc = loaded.config
        self.model_names = self.model_names or (loaded.name,)
        self.max_model_len = cfg.max_model_len or min(loaded.max_model_len, mc.max_position_embeddings)
        if cfg.max_model_len is not None and cfg.max_model_len > mc.max_position_embeddings:
            log.warning("--max-model-len %d exceeds the model's max_position_embeddings %d",
                        cfg.max_model_len, mc.max_position_embeddings)
        num_blocks = self._num_kv_blocks(loaded)
        cache = KVCache(mc.num_hidden_layers, num_blocks, cfg.block_size, mc.num_key_value_heads,
                        mc.head_dim, loaded.model.dtype, self.device)
        use_triton = self.device.type == "cuda"
        self.runner = ModelRunner(loaded.model, cache, device=self.device, seed=cfg.seed,
                                  use_triton=use_triton, max_model_len=self.max_model_len,
                                  cuda_graph_max_bs=0 if cfg.enforce_eager else min(cfg.max_num_seqs, 512))
        # EOS: the tokenizer's and the model config's (generation_config.json merged in)
        tok_eos = tuple(loaded.tokenizer.eos_token_ids) if loaded.tokenizer else ()
        eos = tuple(dict.fromkeys((*tok_eos, *mc.eos_token_ids)))
        budget = cfg.max_num_batched_tokens or max(2048, cfg.max_num_seqs)
        self.blocks = BlockManager(num_blocks, cfg.block_size, enable_prefix_caching=cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=budget,
                                   max_model_len=self.max_model_len, eos_token_ids=eos)
        if num_blocks * cfg.block_size < self.max_model_len:
            log.warning("the KV cache holds %d tokens, fewer than --max-model-len %d: longer requests "
                        "will be refused; raise --kv-cache-memory-bytes / --gpu-memory-utilization "
                        "or lower --max-model-len", num_blocks * cfg.block_size, self.max_model_len)
        self.accountant = account.Accountant()
        self.replies = Replies(self.max_model_len + 4)
        log.info("loaded %s (%s, %s) in %.1fs; KV cache %d blocks x %d tokens",
                 self.model_names[0], mc.architecture, self.device, time.perf_counter() - t0,
                 num_blocks, cfg.block_size)

    def _num_kv_blocks(self, loaded) -> int:
        cfg, mc = self.config, loaded.config
        if cfg.num_gpu_blocks_override:
            return cfg.num_gpu_blocks_override
        per_block = KVCache.bytes_per_block(mc.num_hidden_layers, cfg.block_size,
                                            mc.num_key_value_heads, mc.head_dim, loaded.model.dtype)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            reserve = 2 << 30  # activations, CUDA graphs and the allocator's slack
            budget = int(total * cfg.gpu_memory_utilization) - (total - free) - reserve
            if budget <= per_block:
                raise ValueError("no GPU memory left for the KV cache; raise --gpu-memory-utilization")
            return budget // per_block
        if cfg.kv_cache_memory_bytes:
            return max(1, cfg.kv_cache_memory_bytes // per_block)
        # CPU default: 1 GiB, or less when that is more than every sequence could use.
        enough = cfg.max_num_seqs * math.ceil(self.max_model_len / cfg.block_size)
        return max(1, min(_CPU_KV_DEFAULT_BYTES // per_block, enough))

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Load, start every stage in one nursery, report ready, run until cancelled."""
        await trio.to_thread.run_sync(self.load)
        cfg = self.config
        if cfg.event_log:
            self.events = EventLog(cfg.event_log)
        ev = self.events.stage if self.events else (lambda name: None)
        tok = self.loaded.tokenizer
        if tok is None:
            log.warning("the model has no tokenizer: only token-id prompts are accepted and "
                        "replies carry no text (like vLLM's --skip-tokenizer-init)")
        ctx = RenderContext(tokenizer=tok, served_model_names=self.model_names,
                            max_model_len=self.max_model_len,
                            default_sampling=dict(self.loaded.generation_config or {}),
                            reasoning=cfg.reasoning_parser is not None,
                            vocab_size=self.loaded.config.vocab_size)
        # In flight at once: at most max_waiting + max_num_seqs requests (admission counts a
        # request until emit has sent its last byte), each putting at most one request, one
        # Abort and one FinishRequest into schedule's inbox: the back-edges never block.
        inbox_size = 3 * (cfg.max_waiting + cfg.max_num_seqs) + 16
        render_in, render_out = trio.open_memory_channel(cfg.max_waiting)
        admit_in, admit_out = trio.open_memory_channel(0)
        sched_in, sched_out = trio.open_memory_channel(inbox_size)
        plan_in, plan_out = trio.open_memory_channel(0)
        result_in, result_out = trio.open_memory_channel(0)
        detok_in, detok_out = trio.open_memory_channel(1)
        parse_in, parse_out = trio.open_memory_channel(1)
        acct_in, acct_out = trio.open_memory_channel(1)
        emit_in, emit_out = trio.open_memory_channel(1)
        self._render_in = render_in
        self._schedule_in = sched_in.clone()
        admission = Admission(max_in_flight=cfg.max_waiting + cfg.max_num_seqs,
                              kv_capacity_tokens=self.blocks.num_blocks * cfg.block_size,
                              in_flight=lambda: len(self.replies))
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(render.run, render_out, admit_in, self.replies, ctx, ev("render"))
                nursery.start_soon(admit.run, admit_out, sched_in.clone(), self.replies, admission, ev("admit"))
                nursery.start_soon(schedule.run, sched_out, plan_in, result_out, detok_in,
                                   self.scheduler, ev("schedule"))
                nursery.start_soon(gpu_step.run, plan_out, result_in, self.runner, ev("gpu_step"))
                nursery.start_soon(detokenize.run, detok_out, parse_in, sched_in,
                                   detokenize.Detokenizer(tok), ev("detokenize"))
                nursery.start_soon(parse.run, parse_out, acct_in, parse.Parser(cfg.reasoning_parser),
                                   ev("parse"))
                nursery.start_soon(account.run, acct_out, emit_in, self.accountant, ev("account"))
                nursery.start_soon(emit.run, emit_out, self.replies, emit.Emitter(), ev("emit"))
                self.ready.set()
                task_status.started()
        finally:
            if self.events:
                self.events.close()

    # -- requests ------------------------------------------------------------------------
    async def submit(self, api: str, body: object, request_id: str | None = None) -> Reply:
        """Render and admit one request. Raises RequestError before anything is streamed."""
        await self.ready.wait()
        rid = request_id or uuid.uuid4().hex
        if rid in self.replies:
            rid = f"{rid}-{uuid.uuid4().hex[:8]}"
        receive = self.replies.open(rid)
        accepted = False
        try:
            await self._render_in.send(Submission(rid, api, body, time.monotonic()))
            first = await receive.receive()
            if isinstance(first, RequestError):
                raise first
            assert isinstance(first, Accepted), first
            accepted = True
            return Reply(self, rid, first.stream, receive)
        finally:
            if not accepted:  # refused (already released), or cancelled on the way in
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """The client is gone. Its request keeps its admission slot until emit releases it."""
        if request_id not in self.replies:
            return  # already refused or finished: nothing downstream holds it
        self.replies.detach(request_id)
        try:
            self._schedule_in.send_nowait(Abort(request_id))  # sized to never block (see run)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # the engine is shutting down

    def stats(self) -> dict:
        s, a = self.scheduler, self.accountant
        if s is None:
            return {"ready": False}
        return {
            "ready": self.ready.is_set(),
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
            "requests_finished_total": dict(a.finished_total),
            "steps_total": s.step,
        }
