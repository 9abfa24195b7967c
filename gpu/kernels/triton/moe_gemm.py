"""Fused-MoE grouped GEMM over expert-sorted rows, for experts held in the model dtype (bf16 on
CUDA): Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3, GLM-4.5, Llama 4 (gpu/layers/moe.py, its CUDA
default). The dense sibling of gpu/kernels/triton/mxfp4_moe.py: the same tile map and epilogue
(gpu/kernels/triton/moe_common.py), only the weights' K tiles read differently:

    out[r] = epilogue(a[a_rows[r]] @ W[e(r)]^T)      for every routed row r (sorted by expert)

W [E, N, K] as the layer stores it (gate_up's rows interleaved: gate 2j, up 2j + 1). offs [E]
int32 holds each expert's segment end. Epilogues: a bias, SwiGLU or gpt-oss's clamped SwiGLU
over the interleaved (gate, up) columns (N -> N/2), a per-row scale (the routing weight), and
the scatter of the output rows back to (token, slot) order, so gate_up is one launch (gather
+ GEMM + SwiGLU) and down another (GEMM + weight + scatter). Grid: (tiles, N / BLOCK_N), a
tile BLOCK_M rows of one expert (device-only tile map); an expert with no rows costs no
tile, and no weight of an unrouted expert is read. Compiled for sm_90 by
scripts/check_triton_compile.py and tested under the interpreter (tests/kernels/test_moe_gemm.py);
not yet timed on a GPU against torch's F.grouped_mm (scripts/bench_moe.py --gpu).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from gpu.kernels.triton.moe_common import activation_args, activation_ref, moe_epilogue, pick_blocks, tile_map

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit(do_not_specialize=["n_rows"])
def _moe_gemm_kernel(
    a_ptr, a_rows_ptr, w_ptr, bias_ptr, offs_ptr, tile_expert_ptr, tile_row_ptr, row_scale_ptr, out_rows_ptr,
    out_ptr, n_rows, N, K, stride_am, stride_we, stride_wn, stride_bias, stride_om, alpha, limit,
    GATHER_A: tl.constexpr, SCATTER_OUT: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    ROW_SCALE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
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
        e64 = expert.to(tl.int64)
        w_rows = w_ptr + e64 * stride_we + cols.to(tl.int64) * stride_wn                      # [BN]
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
        moe_epilogue(acc, e64, rows, row_mask, cols, col_mask, pid_n, N, bias_ptr, stride_bias, row_scale_ptr,
                     out_rows_ptr, out_ptr, stride_om, alpha, limit, HAS_BIAS, ACTIVATION, ROW_SCALE, SCATTER_OUT,
                     BLOCK_M, BLOCK_N)


def moe_gemm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *, bias: torch.Tensor | None = None,
             a_rows: torch.Tensor | None = None, swiglu=None, row_scale: torch.Tensor | None = None,
             out_rows: torch.Tensor | None = None, n_rows: int | None = None) -> torch.Tensor:
    """Grouped GEMM. a [M, K]; w [E, N, K]; offs [E] int32 segment ends over the routed rows
    (n_rows: a_rows' length, else M); bias [E, N]; a_rows [n_rows]: the row of a each routed
    row reads; swiglu: True for N/2 output columns of silu(gate) * up over interleaved (gate,
    up), (alpha, limit) for gpt-oss's clamped SwiGLU; row_scale [n_rows]; out_rows [n_rows]:
    where each routed row is written. -> [n_rows, N or N/2] in a.dtype."""
    E, N, K = w.shape
    assert a.dim() == 2 and a.shape[1] == K and a.stride(1) == 1, f"a {tuple(a.shape)} must be [M, {K}], rows contiguous"
    assert w.stride(2) == 1 and offs.shape == (E,) and offs.dtype == torch.int32
    assert bias is None or (bias.shape == (E, N) and bias.stride(1) == 1)
    act, alpha, limit = activation_args(swiglu)
    assert not act or N % 2 == 0
    if n_rows is None:
        n_rows = a_rows.shape[0] if a_rows is not None else a.shape[0]
    out = torch.empty(n_rows, N // 2 if act else N, dtype=a.dtype, device=a.device)
    if n_rows == 0:
        return out
    cfg = pick_blocks(n_rows, E, N, 64 if K >= 64 else 32, _INTERPRET)
    tile_expert, tile_row = tile_map(offs, n_rows, cfg["BLOCK_M"])
    dummy = offs
    grid = (tile_expert.shape[0], triton.cdiv(N, cfg["BLOCK_N"]))
    _moe_gemm_kernel[grid](
        a, a_rows if a_rows is not None else dummy, w, bias if bias is not None else dummy, offs,
        tile_expert, tile_row, row_scale if row_scale is not None else dummy,
        out_rows if out_rows is not None else dummy, out,
        n_rows, N, K, a.stride(0), w.stride(0), w.stride(1), bias.stride(0) if bias is not None else 0,
        out.stride(0), alpha, limit,
        GATHER_A=a_rows is not None, SCATTER_OUT=out_rows is not None, HAS_BIAS=bias is not None,
        ACTIVATION=act, ROW_SCALE=row_scale is not None, UPCAST=_INTERPRET or a.dtype == torch.float32, **cfg)
    return out


def moe_gemm_ref(a, w, offs, *, bias=None, a_rows=None, swiglu=None, row_scale=None, out_rows=None, n_rows=None):
    """Each expert's segment times its weights in fp32; the same epilogues."""
    x = (a[a_rows.long()] if a_rows is not None else a).float()
    if n_rows is not None:
        x = x[:n_rows]
    y = x.new_zeros(x.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        y[start:end] = x[start:end] @ w[e].float().T + (bias[e].float() if bias is not None else 0.0)
        start = end
    y = activation_ref(y, swiglu)
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
