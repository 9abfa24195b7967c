"""KV cache sizing on the GPU side: on CUDA, the budget left after profiling one full-size
step (gpu/worker/runner.py profile_step_bytes, kv_budget_bytes). How start-up picks the number of
blocks from the flags: tests/engine/test_engine_kv_sizing.py."""
from __future__ import annotations

import pytest
import torch

from gpu.layers.attention import KVCache
from gpu.loader.decoder import load_model
from gpu.worker.profiling import kv_budget_bytes, profile_plan, profile_step_bytes
from gpu.worker.runner import ModelRunner


@pytest.fixture
def tiny(tiny_qwen3_dir):
    return load_model(tiny_qwen3_dir, load_format="dummy", dtype="float32", device="cpu", progress=False)


@pytest.mark.parametrize("tokens,seqs,n", [(2048, 256, 256), (100, 256, 100), (37, 4, 4)])
def test_profile_plan_is_one_full_size_step(tokens, seqs, n):
    plan, blocks = profile_plan(tokens, seqs, 16)
    assert len(plan.chunks) == n and all(c.sample and c.start_pos == 0 for c in plan.chunks)
    assert sum(len(c.token_ids) for c in plan.chunks) == tokens
    used = [b for c in plan.chunks for b in c.block_table]
    assert sorted(used) == list(range(blocks))                     # no block shared
    assert all(len(c.block_table) * 16 >= len(c.token_ids) for c in plan.chunks)


def test_the_profile_step_runs(tiny):
    plan, blocks = profile_plan(40, 8, 4)
    c = tiny.config
    cache = KVCache(c.num_hidden_layers, blocks, 4, c.num_key_value_heads, c.head_dim, torch.float32, "cpu")
    assert len(ModelRunner(tiny.model, cache, device=torch.device("cpu")).execute(plan).token_ids) == 8


def test_kv_budget_subtracts_what_is_used_and_the_step_peak():
    gib = 1 << 30
    assert kv_budget_bytes(total=100 * gib, free=90 * gib, step_peak=3 * gib, utilization=0.9,
                           reserve=gib) == 90 * gib - 10 * gib - 3 * gib - gib


@pytest.mark.skipif(not torch.cuda.is_available(), reason="memory profiling needs CUDA")
def test_profile_step_bytes_measures_a_peak(tiny):
    model = tiny.model.to("cuda")
    assert profile_step_bytes(model, block_size=16, max_tokens=256, max_seqs=16,
                              device=torch.device("cuda")) > 0


def test_profile_step_bytes_runs_its_step_here(tiny_qwen3_dir, device, monkeypatch):
    """torch.cuda's memory counters faked, the profiled step itself really runs, on the
    kernel tests' device: on CUDA the Triton kernels on the GPU, on CPU under the
    interpreter (without it, a Triton launch on CPU tensors raises: gpu_check's CUDA run
    does not set it, so the model and cache must be where the kernels run). The peak is what
    the counters say beyond the weights and the throwaway cache."""
    tiny = load_model(tiny_qwen3_dir, load_format="dummy", dtype="float32", device=device, progress=False)
    allocated = iter([1000, 1000 + 64])           # before, and after the throwaway cache
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: next(allocated))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 1000 + 64 + 500)
    ran = []
    execute = ModelRunner.execute
    monkeypatch.setattr(ModelRunner, "execute", lambda self, plan: ran.append(execute(self, plan)))
    peak = profile_step_bytes(tiny.model, block_size=4, max_tokens=24, max_seqs=6, device=torch.device(device))
    assert peak == 500 and len(ran[0].token_ids) == 6
