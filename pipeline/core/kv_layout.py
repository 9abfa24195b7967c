"""Start-up's choices for a model whose layers do not all keep K/V for every position:
the sliding-window layers' pool (gpt-oss, `hybrid_kv`) and a hybrid linear-attention
model's per-sequence state pool (Qwen3-Next, Qwen3.5: `linear_states`, `check_hybrid`)."""
from __future__ import annotations

import logging

import torch

from gpu.config.model import ModelConfig
from pipeline.core.config import EngineConfig

log = logging.getLogger("tailrace")


def hybrid_kv(cfg: EngineConfig, mc: ModelConfig, num_blocks: int, budget: int) -> tuple[int, tuple[int, ...], int]:
    """The KV sizing of a model with sliding-window layers (gpt-oss): the memory of
    `num_blocks` plain blocks as (full-layer blocks, sliding layers, sliding slots)
    (gpu/layers/attention.py hybrid_layout); unchanged without them or with
    --disable-hybrid-kv-cache-manager. With --num-gpu-blocks-override the full layers get
    that many blocks. budget: the tokens one step may schedule."""
    from gpu.layers.attention import hybrid_layout

    if cfg.disable_hybrid_kv_cache_manager:
        return num_blocks, (), 0
    full, sliding, slots = hybrid_layout(mc, num_blocks, cfg.block_size, cfg.max_num_seqs, budget)
    if sliding:
        log.info("hybrid KV cache: %d blocks for the %d full-attention layers, %d for the %d "
                 "sliding-window ones (%d plain blocks' memory)", full,
                 sum(s is not None for s in mc.kv_layer_shapes) - len(sliding) if getattr(mc, "kv_layer_shapes", None)
                 else mc.num_hidden_layers - len(sliding),
                 slots, len(sliding), num_blocks)
        if cfg.num_gpu_blocks_override:
            full = num_blocks
    return full, sliding, slots


def check_hybrid(cfg: EngineConfig, mc: ModelConfig) -> None:
    """What a hybrid linear-attention model is not served with yet: a clear start-up error
    naming the flag."""
    if not mc.num_linear_layers:
        return
    refused = (("--speculative-config", cfg.speculative_config is not None,
                "verification would have to roll each sequence's linear-attention state back "
                "to its last accepted token"),
               ("--enable-lora", cfg.enable_lora, "the adapters do not target its layers yet"),
               ("--kv-transfer-config", cfg.kv_transfer_config is not None,
                "a remote prefill would have to send the states as well"))
    for flag, on, why in refused:
        if on:
            raise ValueError(f"{flag} is not supported for {mc.architecture}, a hybrid "
                             f"linear-attention model: {why}")
    size = cfg.tensor_parallel_size
    if size > 1:    # each rank holds whole heads (gpu/models/hybrid.py)
        for name in ("linear_num_key_heads", "linear_num_value_heads", "num_attention_heads"):
            if getattr(mc, name) % size:
                raise ValueError(f"--tensor-parallel-size {size} does not divide {mc.architecture}'s "
                                 f"{name} ({getattr(mc, name)}): a hybrid linear-attention model "
                                 "splits its heads evenly over the ranks")


def linear_states(cfg: EngineConfig, mc: ModelConfig, dtype: torch.dtype, device: torch.device,
                  tp=None):
    """A hybrid model's StatePool (gpu/layers/linear_attention.py), --max-num-seqs slots,
    reported at start-up; None for other models. Allocated before the KV cache is sized,
    so that a CUDA profile sees it; --kv-cache-memory-bytes counts it (`reserved_bytes`).
    tp: this rank's (gpu/parallel.py TP): its pool holds its own heads' states, under the
    scheduler's slot numbers (the same on every rank)."""
    if not mc.num_linear_layers:
        return None
    from gpu.layers.linear_attention import LinearDims, StatePool
    from gpu.parallel import SINGLE

    tp = tp or SINGLE
    per_seq = StatePool.bytes_per_slot(mc, dtype, tp)
    pool = StatePool(mc.num_linear_layers, cfg.max_num_seqs + state_snapshots(cfg, mc),
                     LinearDims.of(mc, tp), dtype, device)
    if tp.first:
        log_state_pool(cfg, mc, per_seq, tp.size, str(dtype).removeprefix("torch.") + " conv state")
    return pool


def log_state_pool(cfg: EngineConfig, mc: ModelConfig, per_seq: int, tp_size: int, how: str) -> None:
    """The start-up line of a hybrid model's state pool: its slots, what a sequence's costs,
    and whether prefix caching is on and what its snapshots take from the KV budget."""
    snapshots = state_snapshots(cfg, mc)
    if snapshots:
        cache = (f"prefix caching on: + {snapshots} snapshots (a state at a cached prefix's end) = "
                 f"{per_seq * snapshots / 2**20:.1f} MiB more, taken from the KV cache's budget")
    else:
        why = "off" if cfg.enable_prefix_caching is False else "off (the default for a hybrid model, as vLLM)"
        cache = (f"prefix caching {why}: --enable-prefix-caching would add {cfg.max_num_seqs} state "
                 f"snapshots, {per_seq * cfg.max_num_seqs / 2**20:.1f} MiB of the KV cache's budget")
    log.info("linear-attention state pool: %d slots (--max-num-seqs) x %.2f MiB a sequence (conv + "
             "recurrent state of %d Gated DeltaNet layers, %s, fp32 recurrent state%s) = %.1f MiB; %s; "
             "K/V kept for the %d full-attention layers only; CUDA graphs off", cfg.max_num_seqs,
             per_seq / 2**20, mc.num_linear_layers, how,
             f", this rank's 1/{tp_size} of the heads" if tp_size > 1 else "",
             per_seq * cfg.max_num_seqs / 2**20, cache, mc.num_kv_layers)


def prefix_caching(cfg: EngineConfig, mc: ModelConfig) -> bool:
    """--enable-prefix-caching as the engine runs it: as given, else on except for a hybrid
    linear-attention model, whose cached prefixes each need a state snapshot (as vLLM)."""
    if cfg.enable_prefix_caching is not None:
        return cfg.enable_prefix_caching
    return not mc.num_linear_layers


def state_snapshots(cfg: EngineConfig, mc: ModelConfig) -> int:
    """A hybrid model's prefix-cache state snapshots (stages/schedule/state_slots.py): as many
    as --max-num-seqs with prefix caching on, none without."""
    return cfg.max_num_seqs if prefix_caching(cfg, mc) else 0


def reserved_bytes(pool) -> int:
    """The memory a StatePool takes from the KV cache's budget."""
    if pool is None:
        return 0
    return pool.conv.numel() * pool.conv.element_size() + pool.recurrent.numel() * 4

def kv_layout(mc) -> dict:
    """KVCache's per-layer shapes and shared-KV sources where the model's layers differ
    (Gemma 4: ModelConfig.kv_layer_shapes), else nothing."""
    if getattr(mc, "kv_layer_shapes", None) is None:
        return {}
    return dict(layer_shapes=mc.kv_layer_shapes,
                kv_sources=tuple(mc.kv_source(i) for i in range(mc.num_hidden_layers)))


def check_kv_layout(cfg: EngineConfig, mc: ModelConfig) -> None:
    """What a model whose layers keep K/V in different shapes, or read another layer's
    (Gemma 4: ModelConfig.kv_layer_shapes), is not served with yet: a clear start-up error."""
    if getattr(mc, "kv_layer_shapes", None) is None:
        return
    refused = (("--tensor-parallel-size", cfg.tensor_parallel_size > 1, "its heads are not split over ranks yet"),
               ("--speculative-config", cfg.speculative_config is not None,
                "the drafters take one KV shape a layer"),
               ("--enable-lora", cfg.enable_lora, "the adapters assume one q/k/v shape a layer"),
               ("--kv-transfer-config", cfg.kv_transfer_config is not None,
                "the connector's layouts assume one KV shape a layer"))
    for flag, on, why in refused:
        if on:
            raise ValueError(f"{flag} is not supported for {mc.architecture}, whose layers keep K/V "
                             f"in per-layer shapes or share another layer's: {why}")
