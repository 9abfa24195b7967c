"""Start-up: everything the engine needs made before its stages run, synchronously (in a
worker thread, see pipeline.core.engine.open_engine): the device, the weights and tokenizer,
the parsers, the KV cache sized to the memory left, the runner (warmed up on CUDA), the
block manager and scheduler; then the render context's templates and sampling defaults,
and the event log's header."""
from __future__ import annotations

import gc
import json
import logging
import math
import os
import time
from pathlib import Path

import attrs
import jinja2
import torch

from gpu.layers.attention import KVCache
from gpu.worker.grammar import GrammarCompiler
from gpu.interface import TPLost
from gpu.loader.decoder import LoadedModel
from gpu.kernels.cpu.openmp import release_team
from gpu.parallel import SINGLE, TP
from gpu.worker.runner import ModelRunner
from gpu.worker.simulate import GPUS, CostModel, SimulatedRunner, StandInDraft, ordinary_token_ids
from pipeline.core.config import EngineConfig
from pipeline.core.parts import Built, Parsers, Ranks, RunnerParts, pick_device, step_budget  # noqa: F401
from pipeline.core.pooling import build_pooling
from pipeline.core.events import EventLog, make_header
from pipeline.core.kv_layout import (check_hybrid, check_kv_layout, hybrid_kv, kv_layout, linear_states,
                                     log_state_pool, prefix_caching, reserved_bytes, state_snapshots)
from stages.schedule.blocks import BlockManager
from stages.schedule.drafter import make_drafter
from stages.schedule.state_slots import StateSlots
from stages.api.harmony import HARMONY_REASONING_PARSER
from stages.parse import markers
from stages.schedule import AsyncScheduler, Scheduler

log = logging.getLogger("tailrace")

_CPU_KV_DEFAULT_BYTES = 1 << 30


def join_ranks(cfg: EngineConfig, device: torch.device, rank: int, init_method: str,
               timeout_s: float, local_size: int | None = None) -> Ranks:
    """Join the TP group as `rank` (every rank, in the same order). On the CPU each rank
    gets its share of the cores (unless OMP_NUM_THREADS says): N ranks each with every
    core would fight over them."""
    from gpu.worker.tp import join

    size = cfg.tensor_parallel_size
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (local_size or size)))
    tp, plan = join(rank, size, device, init_method, timeout_s)
    return Ranks(tp, plan)


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """A rank's device: cuda:(rank 0's index + local rank), or the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + local_rank)


def check_tensor_parallel(cfg: EngineConfig, device: torch.device) -> None:
    """--tensor-parallel-size N on CUDA needs N devices from rank 0's on."""
    n = cfg.tensor_parallel_size
    if n > 1 and device.type == "cuda":
        have = torch.cuda.device_count() - (device.index or 0)
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or n)
        if local > have:
            raise ValueError(f"--tensor-parallel-size {n} needs {local} CUDA devices on this "
                             f"host from {device} on; torch sees {have}")


def load_weights(cfg: EngineConfig, device: torch.device, tp: TP = SINGLE) -> LoadedModel:
    """The model's weights (this rank's shard under tensor parallelism) and tokenizer."""
    from gpu.loader.decoder import choose_dtype, choose_residual_dtype, cpu_threads, load_model

    dtype, why = choose_dtype(cfg.dtype, device)
    residual, rwhy = choose_residual_dtype(cfg.residual_dtype, dtype, device)
    log.info("dtype %s (%s), residual stream %s (%s)%s", str(dtype).removeprefix("torch."), why,
             str(residual).removeprefix("torch."), rwhy,
             f"; {cpu_threads()}" if device.type == "cpu" else "")
    loaded = load_model(cfg.model, load_format=cfg.load_format, dtype=cfg.dtype if cfg.dtype == "auto" else dtype,
                        device=str(device), seed=cfg.seed, residual_dtype=residual, tp=tp,
                        quantization=cfg.quantization, hf_overrides=cfg.hf_overrides)
    log.info("weights: %s", loaded.weights)
    return loaded


def resolve_max_model_len(cfg: EngineConfig, loaded: LoadedModel) -> int:
    return cfg.max_model_len or min(loaded.max_model_len, loaded.config.max_position_embeddings)


def build_runner(cfg: EngineConfig, loaded: LoadedModel, device: torch.device, max_model_len: int,
                 ranks: Ranks | None = None, floating: bool = False) -> RunnerParts:
    """The KV cache (this rank's heads; under tensor parallelism as many blocks as the
    smallest rank's memory holds), the KV connector on it (--kv-transfer-config) and the
    runner over both, with its drafter. Every rank runs it, in step: the CUDA profiling,
    the connector's layouts and graph capture run collectives. floating: n-gram drafts
    planned ahead with async scheduling (rank 0's runner fills them: floating_drafts)."""
    from gpu.worker.tp import StepBroadcast, min_over_ranks

    mc = loaded.config
    draft = load_draft(cfg, loaded, device)
    head = load_eagle_head(cfg, loaded, device)
    extra = 0 if draft is None else KVCache.bytes_per_block(
        draft.config.num_hidden_layers, cfg.block_size, draft.model.local_kv_heads,
        draft.config.head_dim, draft.model.dtype)
    if head is not None:
        from gpu.worker.spec_decode.eagle import head_kv_bytes_per_block
        extra = head_kv_bytes_per_block(head.spec, cfg.block_size, head.fc.weight.dtype)
    lora = lora_manager(cfg, loaded, device)    # before sizing: the Triton path's slots are memory
    states = linear_states(cfg, mc, loaded.model.dtype, device, getattr(loaded.model, "tp", None))     # a hybrid model's, also before
    num_blocks = num_kv_blocks(cfg, loaded, device, max_model_len, step_budget(cfg), extra,
                               reserved_bytes(states))
    if ranks is not None:
        num_blocks = min_over_ranks(num_blocks, ranks.plan)
    num_blocks, sliding_layers, sliding_slots = hybrid_kv(cfg, mc, num_blocks, step_budget(cfg))
    cache = KVCache(mc.num_kv_layers, num_blocks, cfg.block_size, kv_heads(loaded), mc.kv_cache_head_dim,
                    KVCache.dtype_for(cfg.kv_cache_dtype, loaded.model.dtype, device), device, sliding_layers=sliding_layers,
                    num_sliding_blocks=sliding_slots, latent=mc.kv_cache_latent, **kv_layout(mc))
    if cfg.kv_cache_dtype != "auto":
        cache.set_scales(loaded.kv_scales)
    broadcast = StepBroadcast(ranks.plan) if ranks is not None and ranks.tp.first else None
    connector, runner_connector = make_kv_connector(cfg, cache, broadcast, ranks)
    drafting = None
    if draft is not None:
        from gpu.worker.spec_decode.draft import DraftModel
        dc = draft.config
        drafting = DraftModel(draft.model, KVCache(
            dc.num_hidden_layers, num_blocks, cfg.block_size, draft.model.local_kv_heads,
            dc.head_dim, draft.model.dtype, device), device, use_triton=device.type == "cuda",
            cost=dc.macs_per_token / mc.macs_per_token, chunk=step_budget(cfg))
        log.info("draft model %s (%s, %s): its own KV cache of %d blocks, %.1f MiB; %.2fx the "
                 "target's multiply-adds a token", draft.name, dc.architecture,
                 str(draft.model.dtype).removeprefix("torch."), num_blocks, extra * num_blocks / 2**20,
                 drafting.cost)
    if head is not None:
        from gpu.worker.spec_decode.eagle import EagleDrafter
        hc = head.config
        dtype = head.fc.weight.dtype
        drafting = EagleDrafter(head, KVCache(
            hc.num_hidden_layers, num_blocks, cfg.block_size, hc.num_key_value_heads,
            hc.head_dim, dtype, device), device, use_triton=device.type == "cuda")
        log.info("%s head %s: %d layer(s), hidden %d, draft vocabulary %d%s; its own KV cache "
                 "of %d blocks, %.1f MiB; the target's auxiliary hidden states are an output of "
                 "its CUDA graphs", head.kind.upper(), head.spec.path, hc.num_hidden_layers,
                 hc.hidden_size, head.spec.draft_vocab_size,
                 f", target layers {list(head.spec.aux_layer_ids)}" if head.spec.aux_layer_ids else "",
                 num_blocks, extra * num_blocks / 2**20)
    runner = ModelRunner(loaded.model, cache, device=device, seed=cfg.seed,
                         use_triton=device.type == "cuda", max_model_len=max_model_len,
                         cuda_graph_max_bs=0 if cfg.enforce_eager or states is not None else min(cfg.max_num_seqs, 512),
                         broadcast=broadcast, vision=loaded.vision,
                         encoder_cache_size=cfg.encoder_cache_size,
                         lora=lora, draft=drafting, verify_tokens=verify_graph_tokens(cfg),
                         kv_connector=runner_connector, floating=floating,
                         ngram=floating_drafter(cfg) if floating else None,
                         state_pool=states)
    return RunnerParts(runner=runner, cache=cache, num_blocks=num_blocks, kv_connector=connector,
                       draft_cost=drafting.cost if drafting is not None else None)


def floating_drafter(cfg: EngineConfig):
    """What fills floating chunks' drafts in the runner: the prompt lookup (or the
    stand-in's drafter); None where the draft model or head fills them."""
    spec = cfg.speculative_config
    stand_in = cfg.simulate_draft_acceptance is not None
    return make_drafter(spec, stand_in=stand_in) if spec.method == "ngram" or stand_in else None


def verify_graph_tokens(cfg: EngineConfig) -> int:
    """Tokens a sequence of the verify steps' CUDA graphs (gpu/worker/cuda_graphs.py VerifyGraphs,
    which the stand-in prices alike): K + 1 with speculation and graphs on, else 0."""
    spec = cfg.speculative_config
    return 0 if spec is None or cfg.enforce_eager else spec.num_speculative_tokens + 1


def lora_manager(cfg: EngineConfig, loaded: LoadedModel, device: torch.device):
    """--enable-lora: the runner's gpu.lora.adapters.LoRAManager (hooks on the model's linears)."""
    if not cfg.enable_lora:
        return None
    from gpu.lora.adapters import LoRAManager
    from gpu.loader.decoder import resolve_dtype

    dtype = loaded.model.dtype if cfg.lora_dtype == "auto" else resolve_dtype(cfg.lora_dtype, device)
    return LoRAManager(loaded.model, max_loras=cfg.max_loras,
                       max_cpu_loras=cfg.max_cpu_loras or cfg.max_loras,
                       max_rank=cfg.max_lora_rank, dtype=dtype, device=device)


def lora_registry(cfg: EngineConfig, loaded: LoadedModel, base_name: str, runner):
    """--enable-lora: the served adapters, each --lora-modules folder checked (its config
    against the model and --max-lora-rank, its tensors' names and shapes) before serving."""
    if not cfg.enable_lora:
        return None
    from gpu.lora.adapters import load_adapter, read_adapter_config
    from gpu.lora.spec import LoRARegistry

    registry = LoRARegistry(base_name, cfg.max_loras)
    manager = getattr(runner, "lora", None)
    for m in cfg.lora_modules:
        try:
            adapter_cfg = read_adapter_config(m.path, loaded.config, cfg.max_lora_rank)
            served = registry.add(m.name, adapter_cfg.path, m.base_model_name)
            load_adapter(served.ref, adapter_cfg, loaded.model, torch.float32, torch.device("cpu"))
        except ValueError as exc:
            raise ValueError(f"--lora-modules {m.name}: {exc}") from None
        log.info("LoRA adapter %s: rank %d, scale %g, %s (%s)", m.name, adapter_cfg.r,
                 adapter_cfg.scale, ",".join(sorted(adapter_cfg.targets)), m.path)
    if manager is None:
        raise ValueError("--enable-lora needs the model runner")
    return registry


def load_draft(cfg: EngineConfig, loaded: LoadedModel, device: torch.device) -> LoadedModel | None:
    """method draft_model's draft (gpu/worker/spec_decode/draft.py), checked against the target: a missing
    path or another vocabulary is a start-up error that names it."""
    spec = cfg.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    from gpu.worker.spec_decode.draft import check_draft
    from gpu.loader.decoder import load_model

    path = Path(spec.model).expanduser()
    if not path.exists():
        raise ValueError(f"--speculative-config: the draft model {spec.model} does not exist")
    dtype = spec.dtype if spec.dtype not in (None, "auto") else loaded.model.dtype
    try:
        draft = load_model(path, dtype=dtype, device=str(device), seed=cfg.seed, progress=False)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"--speculative-config: cannot load the draft model {spec.model}: "
                         f"{exc}") from exc
    check_draft(loaded.config, draft.config, spec.model)
    return draft


def load_eagle_head(cfg: EngineConfig, loaded: LoadedModel, device: torch.device):
    """methods eagle and eagle3: the head (gpu/worker/spec_decode/eagle.py), checked against the target: a
    missing folder or file, another vocabulary or hidden size is a start-up error that
    names it."""
    spec = cfg.speculative_config
    if spec is None or spec.method not in ("eagle", "eagle3"):
        return None
    from gpu.worker.spec_decode.eagle import load_head
    from gpu.loader.decoder import resolve_dtype

    dtype = (loaded.model.dtype if spec.dtype in (None, "auto")
             else resolve_dtype(spec.dtype, device))
    return load_head(spec.model, spec.method, loaded.model, dtype, device)


def make_kv_connector(cfg: EngineConfig, cache: KVCache, broadcast, ranks: Ranks | None):
    """--kv-transfer-config: (this rank's gpu/kv_transfer/connector.py KVConnector on its
    cache shard, the connector its runner drives), (None, None) without the flag. Every
    rank calls it, in the same order (build_runner, before any step): under tensor
    parallelism the ranks' layouts are gathered to rank 0, whose side channel serves them
    all, and rank 0's runner gets the TPKVConnector that starts and polls the reads on
    every rank; a worker's drives its NIXL agent from a thread of its own on the CPU
    (`drive`), where NIXL's progress thread is off."""
    tp = ranks.tp if ranks is not None else SINGLE
    if tp.size > 1:   # a worker started by hand without the flag would be out of step
        from gpu.worker.tp import same_on_every_rank

        same_on_every_rank(cfg.kv_transfer_config is not None, ranks.plan,
                           "--kv-transfer-config")
    if cfg.kv_transfer_config is None:
        return None, None
    from gpu.kv_transfer.connector import KVConnector, TPKVConnector

    connector = KVConnector(cfg.kv_transfer_config, cache, tp.rank, tp.size)
    driven = connector
    if tp.size > 1:
        from gpu.worker.tp import gather_layouts

        layouts = gather_layouts(connector.own_layout, ranks.plan)
        if tp.rank == 0:     # served under rank 0's engine id, whatever a worker was given
            connector.serve_layouts(layouts)
            driven = TPKVConnector(connector, broadcast.kv_exchange)
        elif not connector.progress_thread:
            connector.drive()
    return connector, driven


def kv_heads(loaded: LoadedModel) -> int:
    """The KV heads this rank's cache holds (every head without tensor parallelism)."""
    return loaded.model.local_kv_heads


def build(cfg: EngineConfig, device: torch.device, loaded: LoadedModel | None,
          ranks: Ranks | None = None) -> Built:
    """Weights, tokenizer, KV cache, runner, scheduler. `ranks`: rank 0's place among the
    tensor-parallel ranks, whose workers build their shard alongside (pipeline/layouts/tp_worker.py)."""
    from gpu.loader.decoder import load_shell, merge_eos_ids
    from gpu.tokenizers.files import implied_tokenizer, load_tokenizer

    if cfg.pooling:
        return build_pooling(cfg, device)
    t0 = time.perf_counter()
    if loaded is None and cfg.simulate_gpu:
        loaded = load_shell(cfg.model, load_format=cfg.load_format, hf_overrides=cfg.hf_overrides)
        log.info("simulating a %s: no weights loaded, the forward is a timed wait",
                 GPUS[cfg.simulate_gpu].name)
    elif loaded is None:
        loaded = load_weights(cfg, device, ranks.tp if ranks is not None else SINGLE)
    tok = None
    if cfg.tokenizer_mode == "mistral" and not cfg.skip_tokenizer_init:
        from gpu.tokenizers.mistral import MistralTokenizer
        tok = MistralTokenizer(cfg.tokenizer or cfg.model)
    elif cfg.tokenizer:
        tok = load_tokenizer(cfg.tokenizer)
    parsers = Parsers.of(cfg, loaded.config)
    if tok is None and parsers.harmony and loaded.tokenizer is None and not cfg.skip_tokenizer_init:
        tok = implied_tokenizer(loaded.config)  # a dummy gpt-oss config ships no tokenizer.json: o200k
    if tok is not None:
        loaded = attrs.evolve(loaded, tokenizer=tok, eos_token_ids=merge_eos_ids(
            tok, loaded.config, loaded.generation_config))
    if cfg.skip_tokenizer_init:
        loaded = attrs.evolve(loaded, tokenizer=None)
    mc = loaded.config
    check_hybrid(cfg, mc)
    check_kv_layout(cfg, mc)
    model_names = tuple(cfg.served_model_name) or (loaded.name,)
    max_model_len = resolve_max_model_len(cfg, loaded)
    if cfg.max_model_len is not None and cfg.max_model_len > mc.max_position_embeddings:
        log.warning("--max-model-len %d exceeds the model's max_position_embeddings %d",
                    cfg.max_model_len, mc.max_position_embeddings)
    budget = step_budget(cfg)
    # drafts with async scheduling: a step with drafts is planned ahead as well, its chunks
    # floating (gpu/worker/staging.py float_chunks), which the runner fills
    floating = cfg.async_scheduling and cfg.speculative_config is not None
    if cfg.simulate_gpu:
        cost = CostModel.of(mc, GPUS[cfg.simulate_gpu], weights=loaded.weight_format,
                            kv_elem_bytes=1 if cfg.kv_cache_dtype != "auto" else 2)
        num_blocks = cfg.num_gpu_blocks_override or cost.kv_blocks(
            cfg.block_size, cfg.gpu_memory_utilization,
            cfg.max_num_seqs + state_snapshots(cfg, mc) if mc.num_linear_layers else 0)
        if mc.num_linear_layers:
            log_state_pool(cfg, mc, cost.linear.state_bytes, 1, "H200 stand-in, bf16 conv state")
        cost = attrs.evolve(cost, verify_tokens=verify_graph_tokens(cfg))
        stand_in_draft = StandInDraft.of(cfg.speculative_config, mc, GPUS[cfg.simulate_gpu])
        runner = SimulatedRunner(cost, cfg.block_size,
                                 ordinary_token_ids(loaded.tokenizer, mc.vocab_size), cfg.seed,
                                 draft_acceptance=cfg.simulate_draft_acceptance or 0.0,
                                 draft=stand_in_draft, floating=floating,
                                 ngram=floating_drafter(cfg) if floating else None)
        kv_connector = None           # refused with --kv-transfer-config (EngineConfig)
        draft_cost = stand_in_draft.cost if stand_in_draft is not None else None
    else:
        # the connector's layouts are gathered before the warm-up, before the worker ranks
        # follow steps
        parts = build_runner(cfg, loaded, device, max_model_len, ranks, floating=floating)
        runner, cache, num_blocks = parts.runner, parts.cache, parts.num_blocks
        kv_connector, draft_cost = parts.kv_connector, parts.draft_cost
        if device.type == "cuda":  # compile what the first steps would, before any request
            try:
                runner.warm_up(budget, cfg.max_num_seqs)
            except TPLost:            # the ranks are out of step: nothing can run
                raise
            except Exception as exc:  # the first real step will say more; do not hide it
                log.error("warm-up failed: %s", exc, exc_info=exc)
            log.info("CUDA graphs %s (%.1fs); warm-up %.1fs",
                     f"captured for {runner.cuda_graph_sizes}" if runner.cuda_graphs else "off",
                     runner.cuda_graph_capture_s, runner.warmup_s)
    hybrid = not cfg.simulate_gpu and bool(cache.sliding_layers)
    linear = bool(mc.num_linear_layers)     # a hybrid linear-attention model: state slots too
    blocks = BlockManager(num_blocks, cfg.block_size, enable_prefix_caching=prefix_caching(cfg, mc),
                          sliding=(cache.num_sliding_blocks, mc.sliding_window) if hybrid else None)
    grammars = (GrammarCompiler(loaded.tokenizer, mc.vocab_size, loaded.eos_token_ids)
                if loaded.tokenizer is not None else None)
    spec = cfg.speculative_config
    # async scheduling plans a step ahead (EngineConfig turns it off with speculation)
    scheduler_class = AsyncScheduler if cfg.async_scheduling else Scheduler
    scheduler = scheduler_class(
        blocks, max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=budget,
        max_model_len=max_model_len, eos_token_ids=loaded.eos_token_ids, grammars=grammars,
        think_ids=_think_ids(parsers.reasoning_parser, loaded.tokenizer),
        drafter=make_drafter(spec, stand_in=cfg.simulate_draft_acceptance is not None),
        num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
        spec_disable_by_batch_size=spec.disable_by_batch_size if spec else None,
        spec_draft_cost=draft_cost,
        policy=cfg.scheduling_policy, max_loras=cfg.max_loras,
        spec_adaptive=spec.adaptive if spec else False, kv_transfer=cfg.kv_transfer_config,
        kv_port=kv_connector.port if kv_connector is not None else None,
        kv_tp_size=kv_connector.tp_size if kv_connector is not None else 1,
        state_slots=StateSlots(cfg.max_num_seqs, state_snapshots(cfg, mc), cfg.block_size) if linear else None,
        **({"floating": True} if floating else {}))
    if kv_connector is not None:
        log.info("KV connector %s (%s): engine %s, side channel %s:%d%s, held blocks freed "
                 "after %g s unread", cfg.kv_transfer_config.kv_connector,
                 cfg.kv_transfer_config.kv_role, cfg.kv_transfer_config.engine_id,
                 cfg.kv_transfer_config.side_channel_host, kv_connector.port,
                 f" (every one of {kv_connector.tp_size} TP ranks' layouts)"
                 if kv_connector.tp_size > 1 else "", cfg.kv_transfer_config.abort_timeout_s)
    loras = lora_registry(cfg, loaded, model_names[0], runner)
    if num_blocks * cfg.block_size < max_model_len:
        log.warning("the KV cache holds %d tokens, fewer than --max-model-len %d: longer requests "
                    "will be refused; raise --kv-cache-memory-bytes / --gpu-memory-utilization "
                    "or lower --max-model-len", num_blocks * cfg.block_size, max_model_len)
    if cfg.speculative_config is not None:
        spec = cfg.speculative_config
        how = (f"lookup {spec.prompt_lookup_min}-{spec.prompt_lookup_max}" if spec.method == "ngram"
               else f"draft {spec.model}")
        log.log(logging.WARNING if scheduler.speculation.futile else logging.INFO,
                "speculative decoding: %s, %d tokens, %s, %s; %s", spec.method,
                spec.num_speculative_tokens, how, scheduler.speculation.mode(),
                "async scheduling on, steps with drafts planned ahead too (the runner fills "
                "their drafts)" if floating else
                "async scheduling on for steps without drafts" if cfg.async_scheduling else
                "async scheduling off (drafts need each sequence's last token)")
    if loaded.tokenizer is None:
        log.warning("the model has no tokenizer: only token-id prompts are accepted and "
                    "replies carry no text (like vLLM's --skip-tokenizer-init)")
    log.info("loaded %s (%s, %s) in %.1fs; KV cache %d blocks x %d tokens, %s", model_names[0], mc.architecture,
             device, time.perf_counter() - t0, num_blocks, cfg.block_size, str(loaded.model.dtype).removeprefix("torch.")
             if cfg.kv_cache_dtype == "auto" else "float8_e4m3fn (--kv-cache-dtype fp8: half a bf16 cache's bytes; "
             + (f"the checkpoint's k/v scales for {len(loaded.kv_scales)} layers" if loaded.kv_scales else "scale 1.0")
             + ", upcast where read)")
    # this thread's OpenMP team would throttle the runner thread's (gpu/kernels/cpu/openmp.py)
    release_team()
    sleeper = None
    if cfg.enable_sleep_mode:
        from gpu.worker.sleep import Sleeper
        sleeper = Sleeper(runner, None if cfg.simulate_gpu else
                          lambda: load_weights(cfg, device).model)
    return Built(loaded=loaded, model_names=model_names, max_model_len=max_model_len,
                 runner=runner, blocks=blocks, scheduler=scheduler, parsers=parsers,
                 sleeper=sleeper, loras=loras, kv_connector=kv_connector)


def _think_ids(reasoning_parser: str | None, tokenizer) -> tuple[int, int] | None:
    """With a reasoning parser of markers (<think>, Magistral's [THINK]), constrained output
    starts after the closing one: the markers' ids, when each is one token. (Harmony's
    constrained output is the whole answer.)"""
    if reasoning_parser in (None, HARMONY_REASONING_PARSER) or tokenizer is None:
        return None
    marks = markers(reasoning_parser)
    ids = tuple(tokenizer.hf.token_to_id(t) for t in (marks.opens[0], marks.closes[0]))
    if None in ids:
        log.warning("--reasoning-parser %s: %r and %r are not single tokens of this tokenizer; "
                    "constrained output is constrained from its first token", reasoning_parser,
                    marks.opens[0], marks.closes[0])
        return None
    return ids




def num_kv_blocks(cfg: EngineConfig, loaded: LoadedModel, device: torch.device,
                  max_model_len: int, step_tokens: int, extra_per_block: int = 0,
                  reserved: int = 0) -> int:
    """KV cache blocks: the override, --kv-cache-memory-bytes, what a profiled full-size
    step leaves of --gpu-memory-utilization on CUDA, else the CPU default.
    extra_per_block: a draft's KV bytes per block (as many blocks; not in the CPU default).
    reserved: bytes of --kv-cache-memory-bytes already taken (a hybrid model's state pool)."""
    mc = loaded.config
    if cfg.num_gpu_blocks_override:
        return cfg.num_gpu_blocks_override
    target_per_block = KVCache.bytes_per_block(mc.num_kv_layers, cfg.block_size, kv_heads(loaded), mc.kv_cache_head_dim,
                                               KVCache.dtype_for(cfg.kv_cache_dtype, loaded.model.dtype, device),
                                               mc.kv_cache_latent, getattr(mc, "kv_layer_shapes", None))
    per_block = target_per_block + extra_per_block
    if cfg.kv_cache_memory_bytes:  # on every device
        return max(1, (cfg.kv_cache_memory_bytes - reserved) // per_block)
    if device.type == "cuda":
        from gpu.worker.profiling import kv_budget_bytes, profile_step_bytes

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
    # CPU default: 1 GiB of the target's KV (a draft's on top), or what every sequence can use
    enough = cfg.max_num_seqs * math.ceil(max_model_len / cfg.block_size)
    return max(1, min(_CPU_KV_DEFAULT_BYTES // target_per_block, enough))


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


def event_log_header(cfg: EngineConfig, built: Built) -> dict:
    """The event log's header line (docs/events.md): every process's file starts with it."""
    from gpu.tokenizers.files import default_model_path

    return make_header(
        cfg, model_path=str(cfg.model or built.loaded.path or default_model_path()),
        model_name=built.loaded.name, tokenizer=built.loaded.tokenizer,
        served_model_names=built.model_names, max_model_len=built.max_model_len,
        kv_blocks_total=built.blocks.num_blocks, block_size=cfg.block_size,
        parsers=built.parsers,
        cache_block=built.blocks.block_size if built.blocks.prefix_caching else 0)


def open_event_log(cfg: EngineConfig, built: Built,
                   secrets: frozenset[str] = frozenset()) -> EventLog:
    """The event log, its header line written; `secrets` (the API keys) are never written."""
    events = EventLog(cfg.event_log, max_bytes=cfg.event_log_max_bytes,
                      backup_count=cfg.event_log_backup_count, secrets=secrets)
    events.write_header(event_log_header(cfg, built))
    return events


def freeze_heap() -> None:
    """Once loaded, move everything alive (the model, the tokenizer, the modules) out of
    the cyclic garbage collector's sight, as vLLM does: otherwise every full collection
    while serving walks those hundreds of thousands of objects, a stall of about 0.15 s
    on the GIL the engine steps need (docs/benchmarks.md, "garbage collector").
    open_engine unfreezes on exit."""
    gc.collect()
    gc.freeze()
