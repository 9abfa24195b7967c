"""KV cache sizing on CUDA: the peak memory of one full-size step, measured, and the bytes
left for the KV cache (--gpu-memory-utilization)."""
from __future__ import annotations

import torch

from gpu.layers.attention import KVCache
from gpu.interface import SamplingOptions, SeqChunk, SeqStart, StepPlan
from gpu.worker.runner import ModelRunner


def profile_plan(token_budget: int, max_seqs: int, block_size: int) -> tuple[StepPlan, int]:
    """One full-size step for memory profiling: token_budget prompt tokens over
    min(max_seqs, token_budget) sequences, every one sampled (so the logits are as wide as
    a full decode batch's), on blocks 0..n-1. Returns (plan, blocks it needs)."""
    n = max(1, min(max_seqs, token_budget))
    lens = [token_budget // n + (i < token_budget % n) for i in range(n)]
    chunks, starts, next_block = [], [], 0
    greedy = SamplingOptions(temperature=0.0)
    for i, length in enumerate(lens):
        nblk = -(-length // block_size)
        table = tuple(range(next_block, next_block + nblk))
        next_block += nblk
        chunks.append(SeqChunk(f"__profile__{i}", (0,) * length, 0, table, True))
        starts.append(SeqStart(f"__profile__{i}", (0,) * length, greedy))
    return StepPlan(-100, tuple(chunks), tuple(starts)), next_block


def profile_step_bytes(model, *, block_size: int, max_tokens: int, max_seqs: int,
                       device: torch.device, use_triton: bool = True) -> int:
    """CUDA: the peak memory one full-size step allocates beyond the weights (activations,
    logits, sampling), measured by running it on a throwaway KV cache of just its size.
    Also compiles the prefill kernels, before anything is timed."""
    c = model.config
    plan, nblocks = profile_plan(max_tokens, max_seqs, block_size)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    cache = KVCache(c.num_hidden_layers, nblocks, block_size, model.local_kv_heads, c.kv_cache_head_dim,
                    model.dtype, device, latent=c.kv_cache_latent, layer_shapes=c.kv_layer_shapes,
                    kv_sources=tuple(c.kv_source(i) for i in range(c.num_hidden_layers)))
    cache_bytes = torch.cuda.memory_allocated(device) - base
    torch.cuda.reset_peak_memory_stats(device)
    runner = ModelRunner(model, cache, device=device, use_triton=use_triton)
    runner.execute(plan)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base - cache_bytes
    del runner, cache
    torch.cuda.empty_cache()
    return max(0, peak)


def kv_budget_bytes(*, total: int, free: int, step_peak: int, utilization: float,
                    reserve: int = 512 << 20) -> int:
    """KV cache bytes on a GPU: the share of its memory this server may use
    (--gpu-memory-utilization), less what is in use now (the weights, other processes),
    the profiled peak of one full-size step, and a reserve for CUDA graphs and the
    allocator's slack."""
    return int(total * utilization) - (total - free) - step_peak - reserve
