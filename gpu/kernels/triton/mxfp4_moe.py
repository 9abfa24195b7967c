"""Grouped GEMM over MXFP4-packed experts, for gpt-oss's mixture of experts.

    out[r] = epilogue(a[r] @ W[e(r)]^T + bias[e(r)])      for every routed row r

Rows come sorted by expert; offs [E] int32 holds each expert's segment end (cumulative row
counts, as torch's grouped_mm takes them). The weights stay packed as the checkpoint stores
them (gpu/quantization/mxfp4.py):
    blocks [E, N, K/2] uint8   two e2m1 codes a byte, element 2j in the low nibble
    scales [E, N, K/32] uint8  e8m0 exponent s per 32 elements, scale 2^(s - 127)
The K loop loads packed bytes (a quarter of bf16's), splits the nibbles, decodes e2m1 in
registers, applies the group scale and feeds tl.dot (bf16 operands, fp32 accumulation on
the GPU; fp32 "ieee" under the interpreter and for fp32 models). Epilogues (shared with the
dense sibling gpu/kernels/triton/moe_gemm.py: gpu/kernels/triton/moe_common.py): the bias;
gpt-oss's clamped SwiGLU over interleaved (gate, up) output columns (N -> N/2); a per-row
scale (the router weight); a gather of a's rows (token of each routed row) and a scatter of
the output rows (back to (token, slot) order), so the MoE needs no index_select/index_copy.

Grid: (tiles, N / BLOCK_N). A tile is BLOCK_M rows of one expert; the tile -> (expert, first
row) map is built on the device from offs (no host sync); tiles past the last one exit.
The tile count is bounded by min(rows, rows / BLOCK_M + E) (each tile holds a row).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from gpu.kernels.triton.moe_common import activation_args, activation_ref, moe_epilogue, pick_blocks, tile_map

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _e2m1_to_f32(codes):
    """uint8 codes 0..15 -> fp32, built from bits: sign(1) exponent(2) mantissa(1), bias 1;
    exponent 0 is subnormal (0 or 0.5)."""
    c = codes.to(tl.int32)
    e = (c >> 1) & 3
    m = c & 1
    normal = ((e + 126) << 23) | (m << 22)            # (1 + m/2) * 2^(e - 1)
    bits = tl.where(e == 0, m * (126 << 23), normal)  # 0.5 * m
    bits = bits | ((c & 8) << 28)                     # sign to bit 31
    return bits.to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["n_rows"])  # the row count changes every step
def _mxfp4_moe_kernel(
    a_ptr, a_rows_ptr,                 # a [*, K]; a_rows [rows] int (read only with GATHER_A)
    blocks_ptr, scales_ptr, bias_ptr,  # [E, N, K/2] u8, [E, N, K/32] u8, [E, N]
    offs_ptr, tile_expert_ptr, tile_row_ptr,
    row_scale_ptr, out_rows_ptr, out_ptr,
    n_rows, N, K,
    stride_am, stride_be, stride_bn, stride_se, stride_sn, stride_bias, stride_om,
    alpha, limit,
    GATHER_A: tl.constexpr, SCATTER_OUT: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr, ROW_SCALE: tl.constexpr, UPCAST: tl.constexpr, DOT_SCALED: tl.constexpr,
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
        b_rows = blocks_ptr + e64 * stride_be + cols.to(tl.int64) * stride_bn   # [BN] row starts
        s_base = scales_ptr + e64 * stride_se + cols[:, None].to(tl.int64) * stride_sn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :],
                        mask=row_mask[:, None] & (ks < K)[None, :], other=0.0)
            kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            s = tl.load(s_base + kg[None, :], mask=col_mask[:, None] & (kg < K // 32)[None, :], other=127)
            if DOT_SCALED:  # Triton's own MXFP4 operand: [BK/2, BN] bytes packed along K, scales [BN, BK/32]
                packed_t = tl.load(b_rows[None, :] + kb[:, None], mask=col_mask[None, :] & (kb < K // 2)[:, None],
                                   other=0)
                acc = tl.dot_scaled(a, None, "bf16", packed_t, s, "e2m1", acc)
            else:
                packed = tl.load(b_rows[:, None] + kb[None, :], mask=col_mask[:, None] & (kb < K // 2)[None, :],
                                 other=0)
                codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_N, BLOCK_K))  # [BN, BK]
                scale = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)          # 2^(s - 127)
                scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, BLOCK_K // 32, 32)),
                                   (BLOCK_N, BLOCK_K))
                w = _e2m1_to_f32(codes) * scale                                       # [BN, BK] fp32
                if UPCAST:
                    acc = tl.dot(a.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc)
        moe_epilogue(acc, e64, rows, row_mask, cols, col_mask, pid_n, N, bias_ptr, stride_bias, row_scale_ptr,
                     out_rows_ptr, out_ptr, stride_om, alpha, limit, HAS_BIAS, ACTIVATION, ROW_SCALE, SCATTER_OUT,
                     BLOCK_M, BLOCK_N)


def mxfp4_moe_matmul(a: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, offs: torch.Tensor, *,
                     bias: torch.Tensor | None = None, a_rows: torch.Tensor | None = None,
                     swiglu: tuple[float, float] | None = None, row_scale: torch.Tensor | None = None,
                     out_rows: torch.Tensor | None = None, n_rows: int | None = None,
                     dot_scaled: bool = False) -> torch.Tensor:
    """Grouped MXFP4 GEMM. a [M, K]; blocks [E, N, K/2], scales [E, N, K/32] uint8; offs [E]
    int32 segment ends over the routed rows (n_rows of them: a_rows' length, else M);
    a_rows [n_rows]: the row of a each routed row reads; swiglu (alpha, limit): output N/2
    columns of clamped SwiGLU over interleaved (gate, up); row_scale [n_rows]; out_rows
    [n_rows]: where each routed row is written (a permutation); dot_scaled: Triton's
    tl.dot_scaled on the packed operand instead of decoding it here (bf16 activations only;
    scripts/bench_moe.py --gpu times both). -> [n_rows, N or N/2] in a.dtype."""
    E, N, half_k = blocks.shape
    K = 2 * half_k
    assert a.dim() == 2 and a.shape[1] == K and a.stride(1) == 1, f"a {tuple(a.shape)} must be [M, {K}], rows contiguous"
    assert blocks.dtype == torch.uint8 and scales.dtype == torch.uint8 and K % 32 == 0
    assert tuple(scales.shape) == (E, N, K // 32) and blocks.stride(2) == 1 and scales.stride(2) == 1
    assert offs.shape == (E,) and offs.dtype == torch.int32
    if n_rows is None:
        n_rows = a_rows.shape[0] if a_rows is not None else a.shape[0]
    n_out = N // 2 if swiglu is not None else N
    assert swiglu is None or N % 2 == 0
    assert not dot_scaled or a.dtype == torch.bfloat16, "dot_scaled takes bf16 activations"
    out = torch.empty(n_rows, n_out, dtype=a.dtype, device=a.device)
    if n_rows == 0:
        return out
    # BLOCK_K 128 = four scale groups, 64 packed bytes a row
    cfg = pick_blocks(n_rows, E, N, 128 if K >= 128 else 32, _INTERPRET)
    tile_expert, tile_row = tile_map(offs, n_rows, cfg["BLOCK_M"])
    act, alpha, limit = activation_args(swiglu)
    dummy = offs
    grid = (tile_expert.shape[0], triton.cdiv(N, cfg["BLOCK_N"]))
    _mxfp4_moe_kernel[grid](
        a, a_rows if a_rows is not None else dummy, blocks, scales, bias if bias is not None else dummy,
        offs, tile_expert, tile_row,
        row_scale if row_scale is not None else dummy, out_rows if out_rows is not None else dummy, out,
        n_rows, N, K,
        a.stride(0), blocks.stride(0), blocks.stride(1), scales.stride(0), scales.stride(1),
        bias.stride(0) if bias is not None else 0, out.stride(0),
        alpha, limit,
        GATHER_A=a_rows is not None, SCATTER_OUT=out_rows is not None, HAS_BIAS=bias is not None,
        ACTIVATION=act, ROW_SCALE=row_scale is not None,
        UPCAST=_INTERPRET or a.dtype == torch.float32, DOT_SCALED=dot_scaled, **cfg)
    return out


def mxfp4_moe_matmul_ref(a, blocks, scales, offs, *, bias=None, a_rows=None, swiglu=None, row_scale=None,
                         out_rows=None, n_rows=None, dot_scaled=False) -> torch.Tensor:
    """Dequantise then multiply each expert's segment in fp32; the same epilogues."""
    from gpu.quantization.mxfp4 import dequantize_packed  # imports only torch

    w = dequantize_packed(blocks, scales, torch.float32)                       # [E, N, K]
    x = (a[a_rows.long()] if a_rows is not None else a).float()
    if n_rows is not None:
        x = x[:n_rows]
    y = x.new_zeros(x.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        y[start:end] = x[start:end] @ w[e].T + (bias[e].float() if bias is not None else 0.0)
        start = end
    y = activation_ref(y, swiglu)
    if row_scale is not None:
        y = y * row_scale.float()[:, None]
    if out_rows is not None:
        y = torch.empty_like(y).index_copy_(0, out_rows.long(), y)
    return y.to(a.dtype)
