"""A verify pass's chunks (the last token and its drafts, after a cached context) attend as
decode rows in the decode rows' batched call (gpu/layers/attention.py SHORT_CHUNK): the outputs
equal those of one SDPA call per chunk, with a window and sinks too, beside plain decodes,
a long chunk and a new prompt; the cache ends the same."""
from __future__ import annotations

import random

import pytest
import torch

from gpu.kernels.cpu import ops as cpu_kernels
from gpu.layers.attention import KVCache, TorchPagedAttention
from gpu.interface import SeqChunk
from gpu.worker.staging import prepare_step

BS = 16


def _chunks(mixed: bool | str) -> tuple[SeqChunk, ...]:
    if mixed == "as many rows as sequences":     # one short chunk of 2 and one long one
        return (SeqChunk("s0", (5, 6), 37, (3, 9, 4), True, 1),
                SeqChunk("p0", (1,) * 12, 20, (7, 8), True))
    rng = random.Random(3)
    blocks = list(range(40))
    rng.shuffle(blocks)
    out, take = [], 0
    for i, (ctx, q) in enumerate([(37, 4), (1, 1), (16, 4), (50, 2), (5, 1), (30, 8)]):
        n = -(-(ctx + q) // BS)
        out.append(SeqChunk(f"s{i}", tuple(range(5, 5 + q)), ctx, tuple(blocks[take:take + n]),
                            True, q - 1))
        take += n
    if mixed:      # a chunk too long for the short path, and a new prompt
        out.insert(2, SeqChunk("p0", (1,) * 12, 20, tuple(blocks[take:take + 2]), True))
        out.append(SeqChunk("p1", (7,) * 9, 0, (blocks[take + 2],), True))
    return tuple(out)


def _run(chunks, short: int, kernels: bool, dtype, window, sinks, seed=9):
    T = sum(len(c.token_ids) for c in chunks)
    hq, hkv, D = 9, 3, 64
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, hq, D, generator=g).to(dtype)
    k = torch.randn(T, hkv, D, generator=g).to(dtype)
    v = torch.randn(T, hkv, D, generator=g).to(dtype)
    cache = KVCache(1, 40, BS, hkv, D, dtype, "cpu")
    cache.k[0].copy_(torch.randn(40, BS, hkv, D, generator=g).to(dtype))
    cache.v[0].copy_(torch.randn(40, BS, hkv, D, generator=g).to(dtype))
    attn = TorchPagedAttention(cache, D ** -0.5, cpu_kernels=kernels)
    attn.SHORT_CHUNK = short
    _, _, meta, _ = prepare_step(chunks, BS, torch.device("cpu"))
    attn.prepare(meta)
    out = attn.forward(0, q, k, v, sinks=None if sinks is None else sinks.to(dtype), window=window)
    return out, cache.k[0], cache.v[0]


KERNELS = [False] + ([True] if cpu_kernels.kernels() is not None else [])


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("mixed", [False, True, "as many rows as sequences"])
def test_short_chunks_attend_as_one_sdpa_call_per_chunk_does(mixed, kernels):
    chunks = _chunks(mixed)
    for window, sinks in ((None, None), (24, torch.randn(9, generator=torch.Generator().manual_seed(1)))):
        got = _run(chunks, TorchPagedAttention.SHORT_CHUNK, kernels, torch.float32, window, sinks)
        want = _run(chunks, 0, False, torch.float32, window, sinks)
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
        torch.testing.assert_close(got[0], want[0], rtol=0.0, atol=1e-5)
