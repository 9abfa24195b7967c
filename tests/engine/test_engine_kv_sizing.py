"""How start-up sizes the KV cache from the flags (pipeline/core/startup.py num_kv_blocks):
--num-gpu-blocks-override, then --kv-cache-memory-bytes on every device, then the CPU
default. Only the model's shape and dtype matter, so a stand-in carries them. (Profiling
a step for the CUDA budget: tests/kernels/test_kv_sizing.py.)"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from gpu.layers.attention import KVCache
from pipeline.core.config import EngineConfig
from pipeline.core.startup import _CPU_KV_DEFAULT_BYTES
from pipeline.core.startup import num_kv_blocks as _num_kv_blocks

# tests/kernels' tiny Qwen3: 2 layers, 2 KV heads of 16, fp32
LOADED = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=2, num_kv_layers=2, num_key_value_heads=2,
                                                head_dim=16, kv_cache_head_dim=16, kv_cache_latent=0),
                         model=SimpleNamespace(dtype=torch.float32, local_kv_heads=2))
PER_BLOCK = KVCache.bytes_per_block(2, 16, 2, 16, torch.float32)


def test_kv_cache_memory_bytes_is_honoured_on_cuda_too():
    """Before any CUDA call: the flag decides (this machine may have no GPU at all)."""
    cfg = EngineConfig(kv_cache_memory_bytes=1 << 20, block_size=16)
    assert _num_kv_blocks(cfg, LOADED, torch.device("cuda"), 128, 2048) == (1 << 20) // PER_BLOCK


def test_the_override_wins_over_the_memory_flag():
    cfg = EngineConfig(num_gpu_blocks_override=7, kv_cache_memory_bytes=1 << 20)
    assert _num_kv_blocks(cfg, LOADED, torch.device("cuda"), 128, 2048) == 7


def test_the_cpu_default_is_what_every_sequence_can_use_up_to_a_cap():
    few = EngineConfig(max_num_seqs=4, block_size=16)
    assert _num_kv_blocks(few, LOADED, torch.device("cpu"), 100, 2048) == 4 * 7   # ceil(100/16)
    many = EngineConfig(max_num_seqs=256, block_size=16)
    assert _num_kv_blocks(many, LOADED, torch.device("cpu"), 1 << 17, 2048) == (
        _CPU_KV_DEFAULT_BYTES // PER_BLOCK)


def test_a_drafts_pool_comes_on_top_of_the_cpu_default_and_inside_a_set_budget():
    """A draft model's KV (as many blocks as the target's, `extra_per_block` bytes each):
    the CPU default's 1 GiB is the target's alone, so a draft never halves the sequences
    that fit; a budget the flags set (--kv-cache-memory-bytes, the GPU's) holds both."""
    many = EngineConfig(max_num_seqs=256, block_size=16)
    alone = _num_kv_blocks(many, LOADED, torch.device("cpu"), 1 << 17, 2048)
    assert _num_kv_blocks(many, LOADED, torch.device("cpu"), 1 << 17, 2048, PER_BLOCK) == alone
    set_ = EngineConfig(kv_cache_memory_bytes=1 << 20)
    assert _num_kv_blocks(set_, LOADED, torch.device("cpu"), 128, 2048, PER_BLOCK) == (
        (1 << 20) // (2 * PER_BLOCK))
