"""Fused-MoE grouped GEMM over expert-sorted rows, for experts held in the model dtype (bf16 on
CUDA): Qwen3-MoE, Mixtral, DeepSeek-V3, GLM-4.5 (gpu/layers/moe.py). The dense sibling of
gpu/kernels/triton/mxfp4_moe.py, with the same tiling and epilogues:

    out[r] = epilogue(a[a_rows[r]] @ W[e(r)]^T)      for every routed row r (sorted by expert)

W [E, N, K] as the layer stores it (gate_up's rows interleaved: gate 2j, up 2j + 1). offs [E]
int32 holds each expert's segment end. Epilogues: SwiGLU over the interleaved (gate, up)
columns (N -> N/2), a per-row scale (the routing weight), and the scatter of the output rows
back to (token, slot) order, so gate_up is one launch (gather + GEMM + SwiGLU) and down
another (GEMM + weight + scatter). Grid: (tiles, N / BLOCK_N), a tile BLOCK_M rows of one
expert (mxfp4_moe.tile_map, device-only); an expert with no rows costs no tile, and no
weight of an unrouted expert is read.

Not yet the CUDA default: gpu/layers/moe.py keeps torch's F.grouped_mm (cuBLAS/CUTLASS
grouped GEMM) there until scripts/bench_moe.py --gpu times the two; this kernel is compiled
for sm_90 by scripts/check_triton_compile.py and tested under the interpreter
(tests/kernels/test_moe_gemm.py).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from gpu.kernels.triton.mxfp4_moe import tile_map

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit(do_not_specialize=["n_rows"])
def _moe_gemm_kernel(
    a_ptr, a_rows_ptr, w_ptr, offs_ptr, tile_expert_ptr, tile_row_ptr, row_scale_ptr, out_rows_ptr, out_ptr,
    n_rows, N, K, stride_am, stride_we, stride_wn, stride_om,
    GATHER_A: tl.constexpr, SCATTER_OUT: tl.constexpr, SWIGLU: tl.constexpr, ROW_SCALE: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + pid_m)
    if expert >= 0:
        row0 = tl.load(tile_row_ptr + pid_m)
        row_end = tl.load(offs_ptr + expert)
        rows = row0 + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        if GATHER_A:
            a_rows = tl.load(a_rows_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        else:
            a_rows = rows.to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        w_rows = w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64) * stride_wn     # [BN]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :],
                        mask=row_mask[:, None] & k_mask[None, :], other=0.0)                # [BM, BK]
            w = tl.load(w_rows[None, :] + ks[:, None], mask=col_mask[None, :] & k_mask[:, None],
                        other=0.0)                                                            # [BK, BN]
            if UPCAST:
                acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
        if SWIGLU:
            gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))   # interleaved columns
            y = gate * tl.sigmoid(gate) * up
            out_cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            out_mask = out_cols < N // 2
        else:
            y = acc
            out_cols = cols
            out_mask = col_mask
        if ROW_SCALE:
            y = y * tl.load(row_scale_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
        if SCATTER_OUT:
            dst = tl.load(out_rows_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        else:
            dst = rows.to(tl.int64)
        tl.store(out_ptr + dst[:, None] * stride_om + out_cols[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & out_mask[None, :])


def _pick_blocks(n_rows: int, num_experts: int, n: int, k: int) -> dict:
    """Two tile shapes by the mean rows an expert (decode: a few; prefill: many)."""
    block_m = 16 if n_rows < 16 * num_experts else 64
    return dict(BLOCK_M=block_m, BLOCK_N=64 if n >= 64 else 32, BLOCK_K=64 if k >= 64 else 32, num_warps=4,
                num_stages=1 if _INTERPRET else 3)


def moe_gemm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *, a_rows: torch.Tensor | None = None,
             swiglu: bool = False, row_scale: torch.Tensor | None = None, out_rows: torch.Tensor | None = None,
             n_rows: int | None = None) -> torch.Tensor:
    """Grouped GEMM. a [M, K]; w [E, N, K]; offs [E] int32 segment ends over the routed rows
    (n_rows: a_rows' length, else M); a_rows [n_rows]: the row of a each routed row reads;
    swiglu: N/2 output columns of silu(gate) * up over interleaved (gate, up); row_scale
    [n_rows]; out_rows [n_rows]: where each routed row is written. -> [n_rows, N or N/2] in a.dtype."""
    E, N, K = w.shape
    assert a.dim() == 2 and a.shape[1] == K and a.stride(1) == 1, f"a {tuple(a.shape)} must be [M, {K}], rows contiguous"
    assert w.stride(2) == 1 and offs.shape == (E,) and offs.dtype == torch.int32
    assert not swiglu or N % 2 == 0
    if n_rows is None:
        n_rows = a_rows.shape[0] if a_rows is not None else a.shape[0]
    out = torch.empty(n_rows, N // 2 if swiglu else N, dtype=a.dtype, device=a.device)
    if n_rows == 0:
        return out
    cfg = _pick_blocks(n_rows, E, N, K)
    tile_expert, tile_row = tile_map(offs, n_rows, cfg["BLOCK_M"])
    dummy = offs
    grid = (tile_expert.shape[0], triton.cdiv(N, cfg["BLOCK_N"]))
    _moe_gemm_kernel[grid](
        a, a_rows if a_rows is not None else dummy, w, offs, tile_expert, tile_row,
        row_scale if row_scale is not None else dummy, out_rows if out_rows is not None else dummy, out,
        n_rows, N, K, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        GATHER_A=a_rows is not None, SCATTER_OUT=out_rows is not None, SWIGLU=swiglu,
        ROW_SCALE=row_scale is not None, UPCAST=_INTERPRET or a.dtype == torch.float32, **cfg)
    return out


def moe_gemm_ref(a, w, offs, *, a_rows=None, swiglu=False, row_scale=None, out_rows=None, n_rows=None):
    """Each expert's segment times its weights in fp32; the same epilogues."""
    x = (a[a_rows.long()] if a_rows is not None else a).float()
    if n_rows is not None:
        x = x[:n_rows]
    y = x.new_zeros(x.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        y[start:end] = x[start:end] @ w[e].float().T
        start = end
    if swiglu:
        y = torch.nn.functional.silu(y[:, ::2]) * y[:, 1::2]
    if row_scale is not None:
        y = y * row_scale.float()[:, None]
    if out_rows is not None:
        y = torch.empty_like(y).index_copy_(0, out_rows.long(), y)
    return y.to(a.dtype)


def aot_cases():
    """scripts/check_triton_compile.py's launches: Qwen3-30B-A3B's experts (128, top 8, hidden
    2048, intermediate 768), gate_up (+ gather, SwiGLU) and down (+ weight, scatter), bf16, a
    decode of 4 tokens and a prefill of 2048."""
    for tokens in (4, 2048):
        for proj in ("gate_up", "down"):
            def launch(tokens=tokens, proj=proj, E=128, k=8, D=2048, inter=768):
                n, kk = (2 * inter, D) if proj == "gate_up" else (D, inter)
                rows = tokens * k
                a = torch.zeros(tokens if proj == "gate_up" else rows, kk, dtype=torch.bfloat16)
                offs = torch.linspace(rows / E, rows, E).to(torch.int32)
                order = torch.arange(rows)
                kw = dict(a_rows=order // k, swiglu=True) if proj == "gate_up" else \
                    dict(row_scale=torch.zeros(rows, dtype=torch.float32), out_rows=order)
                moe_gemm(a, torch.zeros(E, n, kk, dtype=torch.bfloat16), offs, n_rows=rows, **kw)
            yield f"moe_gemm[qwen3-30b-a3b,bf16,{proj},{tokens} tokens]", ["_moe_gemm_kernel"], launch
