"""Decode attention through gpu/kernels/cpu/ops.c against a dense float64 reference and against
TorchPagedAttention's gather + SDPA path.

Bounds: fp32 within 1e-5 of the float64 reference (the kernel sums in fp32); bf16 within one
bf16 rounding of it (rtol 2^-8: the inputs are the same bf16 values, the kernel computes in
fp32 and rounds its output once).
"""
from __future__ import annotations

import random

import pytest
import torch

from gpu.kernels.cpu import ops as cpu_kernels
from gpu.layers.attention import KVCache, TorchPagedAttention
from gpu.interface import SeqChunk
from gpu.worker.staging import prepare_step

KERNELS = cpu_kernels.kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C compiler (TAILRACE_CPU_KERNELS=0 or cc missing)")

BOUNDS = {torch.float32: dict(rtol=0.0, atol=1e-5), torch.bfloat16: dict(rtol=2.0 ** -8, atol=1e-5)}


def reference(q, kc, vc, tables, lens, scale, sinks=None, window=None):
    """[B, Hq, D] float64: sequence b's query against its first lens[b] cached tokens."""
    B, Hq, D = q.shape
    nb, bs, hkv, _ = kc.shape
    out = torch.empty(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        n = int(lens[b])
        slots = torch.tensor([int(tables[b][t // bs]) * bs + t % bs for t in range(n)])
        k = kc.reshape(-1, hkv, D)[slots].double().repeat_interleave(Hq // hkv, dim=1)  # [n, Hq, D]
        v = vc.reshape(-1, hkv, D)[slots].double().repeat_interleave(Hq // hkv, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].double(), k) * scale                       # [Hq, n]
        if window is not None:
            s[:, : max(0, n - window)] = float("-inf")
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None]], dim=1)
        p = s.softmax(-1)[:, :n]
        out[b] = torch.einsum("hn,nhd->hd", p, v)
    return out


def scattered(B, max_len, bs, hkv, D, dtype, seed):
    """A cache whose blocks are shuffled among the sequences, and random lengths."""
    g = torch.Generator().manual_seed(seed)
    nblk = -(-max_len // bs)
    num_blocks = B * nblk + 3
    kc = torch.randn(num_blocks, bs, hkv, D, generator=g).to(dtype)
    vc = torch.randn(num_blocks, bs, hkv, D, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[: B * nblk].view(B, nblk).to(torch.int32)
    lens = torch.randint(1, max_len + 1, (B,), generator=g).to(torch.int64)
    lens[0] = 1          # a first token
    lens[-1] = max_len   # a full table
    return kc, vc, tables, lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,hq,hkv,D,bs", [
    (5, 9, 3, 64, 16),     # SmolLM2's heads, few sequences: heads split among items
    (17, 8, 2, 128, 16),   # many sequences: one item per sequence; 4-head tiles, two d-chunks
    (3, 10, 2, 64, 8),     # 5 query heads per KV head: a 4-tile and a 1-tile
    (4, 4, 4, 32, 16),     # head_dim not a multiple of 64: the plain loops
    (3, 6, 3, 24, 4),      # nor of 16
])
def test_kernel_matches_dense_reference(dtype, B, hq, hkv, D, bs):
    kc, vc, tables, lens = scattered(B, 45, bs, hkv, D, dtype, seed=B * D)
    q = torch.randn(B, hq, D, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = torch.full_like(q, float("nan"))
    scale = D ** -0.5
    assert KERNELS.paged_decode_attention(q, torch.arange(B), out, kc, vc, tables, lens, scale)
    torch.testing.assert_close(out.double(), reference(q, kc, vc, tables, lens, scale), **BOUNDS[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sinks_window_and_query_rows(dtype):
    """gpt-oss's sinks and sliding window; queries at scattered rows of a wider batch, whose
    other rows the kernel leaves alone."""
    B, hq, hkv, D, bs = 6, 8, 2, 64, 16
    kc, vc, tables, lens = scattered(B, 70, bs, hkv, D, dtype, seed=3)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2 * B + 1, hq, D, generator=g).to(dtype)
    rows = torch.arange(1, 2 * B + 1, 2)
    sinks = torch.randn(hq, generator=g) * 3
    out = torch.full_like(q, 7.0)
    scale = D ** -0.5
    for window in (None, 20):
        assert KERNELS.paged_decode_attention(q, rows, out, kc, vc, tables, lens, scale, sinks=sinks,
                                              window=window)
        ref = reference(q[rows], kc, vc, tables, lens, scale, sinks=sinks, window=window)
        torch.testing.assert_close(out[rows].double(), ref, **BOUNDS[dtype])
        untouched = torch.ones(2 * B + 1, dtype=torch.bool)
        untouched[rows] = False
        assert (out[untouched] == 7.0).all()


def test_writes_the_new_kv_first():
    """With new_kv, each sequence's k/v land in its slot before it is read (its own token
    counts); slot -1 writes nothing."""
    B, hq, hkv, D, bs = 4, 6, 2, 64, 16
    kc, vc, tables, lens = scattered(B, 40, bs, hkv, D, torch.float32, seed=5)
    g = torch.Generator().manual_seed(6)
    qkv = torch.randn(B, (hq + 2 * hkv) * D, generator=g)
    q, k, v = qkv.split([hq * D, hkv * D, hkv * D], dim=-1)   # strided rows, as the model has them
    q, k, v = q.reshape(B, hq, D), k.reshape(B, hkv, D), v.reshape(B, hkv, D)
    last = [int(tables[b][(lens[b] - 1) // bs]) * bs + int(lens[b] - 1) % bs for b in range(B)]
    slots = torch.tensor(last[:-1] + [-1])
    before = kc.clone()
    want_k, want_v = kc.clone(), vc.clone()
    for b in range(B - 1):
        want_k.view(-1, hkv, D)[last[b]] = k[b]
        want_v.view(-1, hkv, D)[last[b]] = v[b]
    out = torch.empty(B, hq, D)
    assert KERNELS.paged_decode_attention(q, torch.arange(B), out, kc, vc, tables, lens, D ** -0.5,
                                          new_kv=(k, v), slots=slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    assert torch.equal(kc.view(-1, hkv, D)[last[-1]], before.view(-1, hkv, D)[last[-1]])
    torch.testing.assert_close(out.double(), reference(q, kc, vc, tables, lens, D ** -0.5), **BOUNDS[torch.float32])


def test_declines_a_block_out_of_range():
    B, hq, hkv, D, bs = 2, 4, 2, 64, 16
    kc, vc, tables, lens = scattered(B, 30, bs, hkv, D, torch.float32, seed=7)
    tables[1, 0] = kc.shape[0]
    out = torch.full((B, hq, D), 3.0)
    q = torch.randn(B, hq, D)
    assert not KERNELS.paged_decode_attention(q, torch.arange(B), out, kc, vc, tables, lens, 0.125)
    assert (out == 3.0).all()


def _run_backend(dtype, cpu_kernels_on, chunks, q, k, v, layer_cache, window=None, sinks=None):
    bs = 16
    cache = KVCache(1, 40, bs, k.shape[1], k.shape[2], dtype, "cpu")
    cache.k[0].copy_(layer_cache[0])
    cache.v[0].copy_(layer_cache[1])
    attn = TorchPagedAttention(cache, q.shape[-1] ** -0.5, cpu_kernels=cpu_kernels_on)
    # the attention kernel is AVX-512 only: on an AVX2 CPU both runs are gather + SDPA
    assert (attn.kernels is not None) == (cpu_kernels_on and bool(KERNELS.vector_width))
    _, _, meta, _ = prepare_step(chunks, bs, torch.device("cpu"))
    attn.prepare(meta)
    out = attn.forward(0, q, k, v, sinks=sinks, window=window)
    return out, cache.k[0], cache.v[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mixed", [False, True])
def test_backend_paths_agree(dtype, mixed):
    """TorchPagedAttention with the kernel against its gather + SDPA path, on a decode-only
    step and on a step where a prefill (with a cached prefix) and a new prompt share the
    batch; the cache ends up the same."""
    hq, hkv, D = 9, 3, 64
    rng = random.Random(8)
    blocks = list(range(40))
    rng.shuffle(blocks)
    chunks, take = [], 0
    for i, ctx in enumerate([37, 1, 16, 50]):        # decodes: ctx tokens cached before
        n = -(-(ctx + 1) // 16)
        chunks.append(SeqChunk(f"d{i}", (5,), ctx, tuple(blocks[take:take + n]), True))
        take += n
    if mixed:
        chunks.insert(1, SeqChunk("p0", (1, 2, 3, 4, 5), 20, tuple(blocks[take:take + 2]), True))
        chunks.append(SeqChunk("p1", (7,) * 9, 0, (blocks[take + 2],), True))
    T = sum(len(c.token_ids) for c in chunks)
    g = torch.Generator().manual_seed(9)
    q = torch.randn(T, hq, D, generator=g).to(dtype)
    k = torch.randn(T, hkv, D, generator=g).to(dtype)
    v = torch.randn(T, hkv, D, generator=g).to(dtype)
    layer = (torch.randn(40, 16, hkv, D, generator=g).to(dtype), torch.randn(40, 16, hkv, D, generator=g).to(dtype))
    for window, sinks in ((None, None), (24, torch.randn(hq, generator=g).to(dtype))):
        got = _run_backend(dtype, True, tuple(chunks), q, k, v, layer, window, sinks)
        want = _run_backend(dtype, False, tuple(chunks), q, k, v, layer, window, sinks)
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
        bound = BOUNDS[dtype] if dtype == torch.float32 else dict(rtol=2.0 ** -7, atol=2e-3)
        torch.testing.assert_close(got[0].float(), want[0].float(), **bound)
