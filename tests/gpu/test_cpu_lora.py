"""The grouped LoRA shrink/expand C kernel (gpu/kernels/cpu/lora.c) against its fp32 torch reference:
rows sorted by adapter in uneven groups, base rows between them left untouched, ranks 8/16 and
ranks that are no multiple of the vector (4, 12, 40: the scalar and one-vector tails), an
adapter that does not patch the linear, fp32 and bf16 activations, outputs and weights."""
from __future__ import annotations

import pytest
import torch

from gpu.kernels.cpu import lora as cpu_lora

K_ = cpu_lora.kernels()
pytestmark = pytest.mark.skipif(K_ is None, reason="no C compiler (TAILRACE_CPU_KERNELS=0?)")


def _case(T, K, N, ranks, groups, dtype, wdtype, seed=0):
    """groups: per adapter the rows it owns (the rest are base rows); ranks[g] 0: not patched."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g).to(dtype)
    out = torch.randn(T, N, generator=g).to(dtype)
    weights, perm, bounds = [], [], [0]
    for r, rows in zip(ranks, groups):
        weights.append(None if not r else ((torch.randn(K, r, generator=g) / K ** 0.5).to(wdtype),
                                           (torch.randn(r, N, generator=g) * 0.5).to(wdtype)))
        perm.extend(rows)
        bounds.append(len(perm))
    return x, out, weights, torch.tensor(perm, dtype=torch.int64), bounds


def _run(x, out, weights, perm, bounds, wdtype, key=1, n_keys=3):
    """The kernel through a step table of n_keys linears, this one at row `key`."""
    G = len(weights)
    table = torch.zeros(G, n_keys, 3, dtype=torch.int64)
    keep = []
    for gi, w in enumerate(weights):
        table[gi, 0] = 7   # another linear's row: must not be read for this key
        if w is not None:
            packed = K_.pack({"k": w})
            keep.append(packed)
            table[gi, key] = cpu_lora.LoRAKernels.pointers(packed, ["k"])[0]
    got = out.clone()
    assert K_.apply(x, got, perm, torch.tensor(bounds, dtype=torch.int64), table, key, wdtype)
    return got


@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                          (torch.float32, torch.bfloat16)], ids=str)
@pytest.mark.parametrize("T,K,N,ranks,groups", [
    (11, 64, 96, [8, 16, 0], [[0, 3], [5, 6, 7, 8, 9], [10]]),      # base rows 1, 2, 4 between
    (9, 96, 80, [16, 8], [[8, 1, 2, 3, 4, 5], [0]]),                # a group of more than 4 rows
    (6, 40, 28, [4, 12, 40], [[5], [0, 1], [3, 2]]),                # tails past the vectors
])
def test_grouped_kernel_matches_the_reference(T, K, N, ranks, groups, dtype, wdtype):
    x, out, weights, perm, bounds = _case(T, K, N, ranks, groups, dtype, wdtype, seed=T * K)
    got = _run(x, out, weights, perm, bounds, wdtype)
    want = cpu_lora.reference(x, out, perm, bounds, weights)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:   # fp32 sums, the output rounded once to bf16
        torch.testing.assert_close(got, want.to(dtype), atol=0, rtol=2 ** -8)
    lora_rows = {r for rows in groups for r in rows}
    base = [t for t in range(T) if t not in lora_rows]
    assert torch.equal(got[base], out[base])
    unpatched = [r for rank, rows in zip(ranks, groups) if not rank for r in rows]
    assert torch.equal(got[unpatched], out[unpatched])
    patched = sorted(lora_rows - set(unpatched))
    assert (got[patched].float() - out[patched].float()).abs().max() > 0.1


def test_kernel_declines_what_it_does_not_take():
    x, out, weights, perm, bounds = _case(4, 16, 8, [8], [[0, 1]], torch.float32, torch.float32)
    table = torch.zeros(1, 1, 3, dtype=torch.int64)
    b = torch.tensor(bounds, dtype=torch.int64)
    assert not K_.apply(x.T, out, perm, b, table, 0, torch.float32)                 # strided columns
    assert not K_.apply(x.half(), out, perm, b, table, 0, torch.float32)            # fp16
    assert not K_.apply(x[:, None], out, perm, b, table, 0, torch.float32)          # 3-d


def test_scalar_build_matches_the_reference(monkeypatch, tmp_path):
    """The fallback without AVX2 (-march=x86-64: no vector path, panels of 32 columns)."""
    from gpu.kernels.cpu import ops as cpu_kernels

    monkeypatch.setenv(cpu_kernels.MARCH_ENV, "x86-64")
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path))
    lib = cpu_kernels.load_library(cpu_lora._SOURCE)
    assert lib is not None
    scalar = cpu_lora.LoRAKernels(lib)
    assert scalar.vector_width == 0 and scalar.panel == 32
    x, out, weights, perm, bounds = _case(7, 40, 50, [8, 16], [[6, 0, 1], [3, 4]], torch.bfloat16,
                                          torch.float32, seed=3)
    table = torch.zeros(2, 1, 3, dtype=torch.int64)
    packed = [scalar.pack({0: w}) for w in weights]
    for gi, p in enumerate(packed):
        table[gi] = cpu_lora.LoRAKernels.pointers(p, [0])
    got = out.clone()
    assert scalar.apply(x, got, perm, torch.tensor(bounds), table, 0, torch.float32)
    want = cpu_lora.reference(x, out, perm, bounds, weights)
    torch.testing.assert_close(got, want.to(got.dtype), atol=0, rtol=2 ** -8)
