"""Inputs of the fused QKV preparation kernel (moved from tests/kernels/test_qkv_prep.py, which
other test modules share)."""
from __future__ import annotations

import torch


def _inputs(T, hq, hkv, dh, page, qk_norm, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(T, (hq + 2 * hkv) * dh, generator=g) * 3).to(dtype)
    w = lambda: (1 + 0.5 * torch.randn(dh, generator=g)).to(dtype)  # noqa: E731
    qw, kw = (w(), w()) if qk_norm else (None, None)
    blocks = -(-T // page) + 3
    k_cache = torch.randn(blocks, page, hkv, dh, generator=g).to(dtype)
    v_cache = torch.randn(blocks, page, hkv, dh, generator=g).to(dtype)
    slots = torch.randperm(blocks * page, generator=g)[:T]
    if T > 2:
        slots[1] = -1                                   # a graph's padding row: not written
    pos = torch.randint(0, 200, (T,), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, dh, 2).float() / dh))
    f = torch.outer(torch.arange(256).float(), inv)
    cos_sin = torch.cat([f.cos(), f.sin()], dim=-1)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return [to(qkv), hq, hkv, dh, to(qw), to(kw), 1e-6, to(pos), to(cos_sin), to(k_cache), to(v_cache), to(slots)]
