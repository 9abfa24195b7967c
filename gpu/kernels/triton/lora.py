"""LoRA shrink and expand over a row -> adapter index (issue 33; the Punica / S-LoRA design,
as vLLM's lora/ops/triton_ops): one launch each for every adapter of a step.

    shrink: h[t, :]  = x[t, :] @ A[idx[t]]^T          x [T, K], A [L, R, K] -> h [T, R] (fp32)
    expand: out[t, :] += h[t, :] @ B[idx[t]]^T        h [T, R], B [L, N, R], out [T, N]

Adapters are stacked in slots of the largest rank R; `ranks` [L] says how many rows of A /
columns of B each slot holds, and only those are read (what lies past them is never loaded,
so a slot need not be zeroed). The scale is folded into B. A row whose index is -1 (the base model) is skipped: its h is zero and its
out untouched. Grid: (rows, R / BLOCK_R) and (rows, N / BLOCK_N); each program reduces over
K (or R) in blocks, in fp32.

Byte counts (the expected cost on a GPU, decode of T rows over L' distinct adapters of rank
r): shrink reads T*K activations and L'*r*K of A; expand reads T*r and L'*N*r of B and
reads/writes T*N of out. For SmolLM2's qkv (K 576, N 960) at r 16, 4 adapters, T 32 in bf16:
A 74 KB + B 123 KB + out 123 KB, about 0.35 MB per linear, ~50 MB per 30-layer step for all
seven targets: ~10 us at H200's 4.8 TB/s, against the base step's ~270 MB of weights.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n_rows"])
def _shrink_kernel(x_ptr, a_ptr, idx_ptr, rank_ptr, h_ptr, n_rows, K, R,
                   stride_x, stride_al, stride_ar, stride_h,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    rs = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    lora = tl.load(idx_ptr + t).to(tl.int64)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    rank = tl.load(rank_ptr + tl.maximum(lora, 0))
    if (lora >= 0) & (tl.program_id(1) * BLOCK_R < rank):
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + t * stride_x + ks, mask=ks < K, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + lora * stride_al + rs[:, None] * stride_ar + ks[None, :],
                        mask=(rs < rank)[:, None] & (ks < K)[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
    tl.store(h_ptr + t * stride_h + rs, acc, mask=rs < R)


@triton.jit(do_not_specialize=["n_rows"])
def _expand_kernel(h_ptr, b_ptr, idx_ptr, rank_ptr, out_ptr, n_rows, N, R,
                   stride_h, stride_bl, stride_bn, stride_out,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    lora = tl.load(idx_ptr + t).to(tl.int64)
    if lora >= 0:
        rank = tl.load(rank_ptr + lora)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            rs = r0 + tl.arange(0, BLOCK_R)
            h = tl.load(h_ptr + t * stride_h + rs, mask=rs < rank, other=0.0)
            b = tl.load(b_ptr + lora * stride_bl + ns[:, None] * stride_bn + rs[None, :],
                        mask=(ns < N)[:, None] & (rs < rank)[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(b * h[None, :], axis=1)
        ptrs = out_ptr + t * stride_out + ns
        old = tl.load(ptrs, mask=ns < N, other=0.0).to(tl.float32)
        tl.store(ptrs, (old + acc).to(out_ptr.dtype.element_ty), mask=ns < N)


def _ranks(ranks: torch.Tensor | None, L: int, R: int, device) -> torch.Tensor:
    if ranks is None:
        return torch.full((L,), R, dtype=torch.int32, device=device)
    assert ranks.shape == (L,) and ranks.dtype == torch.int32
    return ranks


def lora_shrink(x: torch.Tensor, a: torch.Tensor, idx: torch.Tensor,
                ranks: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K], a [L, R, K], idx [T] int (-1: no adapter) -> h [T, R] fp32. ranks [L] int32:
    each adapter's rank, the rows of A read (default R); h past it is zero."""
    T, K = x.shape
    L, R, K2 = a.shape
    assert K == K2 and idx.shape == (T,) and x.stride(1) == 1 and a.stride(2) == 1
    ranks = _ranks(ranks, L, R, x.device)
    h = torch.empty(T, R, dtype=torch.float32, device=x.device)
    if T == 0:
        return h
    block_r = min(64, triton.next_power_of_2(R))
    grid = (T, triton.cdiv(R, block_r))
    _shrink_kernel[grid](x, a, idx, ranks, h, T, K, R, x.stride(0), a.stride(0), a.stride(1), h.stride(0),
                         BLOCK_R=block_r, BLOCK_K=128)
    return h


def lora_expand(h: torch.Tensor, b: torch.Tensor, idx: torch.Tensor, out: torch.Tensor,
                ranks: torch.Tensor | None = None) -> torch.Tensor:
    """out [T, N] += h [T, R] @ b[idx]^T (b [L, N, R]), in place; rows with idx -1 untouched.
    ranks [L] int32: the columns of B read per adapter (default R)."""
    T, R = h.shape
    L, N, R2 = b.shape
    assert R == R2 and out.shape == (T, N) and out.stride(1) == 1 and b.stride(2) == 1
    ranks = _ranks(ranks, L, R, out.device)
    if T == 0:
        return out
    h = h.float().contiguous()
    block_n = 128
    grid = (T, triton.cdiv(N, block_n))
    _expand_kernel[grid](h, b, idx, ranks, out, T, N, R, h.stride(0), b.stride(0), b.stride(1),
                         out.stride(0), BLOCK_N=block_n, BLOCK_R=min(64, triton.next_power_of_2(R)))
    return out


def lora_ref(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, idx: torch.Tensor,
             out: torch.Tensor) -> torch.Tensor:
    """The torch reference: row by row, out[t] + (x[t] A^T) B^T in fp32."""
    res = out.float().clone()
    for t, lora in enumerate(idx.tolist()):
        if lora >= 0:
            res[t] += (x[t].float() @ a[lora].float().T) @ b[lora].float().T
    return res.to(out.dtype)


def aot_cases():
    """scripts/check_triton_compile.py's launches (compiled for the device, none run): the
    slot stacks gpu/lora/adapters.py builds for SmolLM2's qkv and gate_up at --max-lora-rank 64,
    4 slots, a 32-row bf16 decode."""
    for name, k, n, parts in (("qkv", 576, 960, 3), ("gate_up", 576, 3072, 2)):
        def launch(k=k, n=n, parts=parts):
            r, s, t = 64 * parts, 4, 32
            x = torch.zeros(t, k, dtype=torch.bfloat16)
            idx = torch.zeros(t, dtype=torch.int32)
            ranks = torch.full((s,), r, dtype=torch.int32)
            h = lora_shrink(x, torch.zeros(s, r, k, dtype=torch.bfloat16), idx, ranks)
            lora_expand(h, torch.zeros(s, n, r, dtype=torch.bfloat16), idx,
                        torch.zeros(t, n, dtype=torch.bfloat16), ranks)
        yield f"lora[smollm2-135m,bf16,{name},rank 64 x {parts}]", ["_shrink_kernel", "_expand_kernel"], launch
