"""What the two fused-MoE grouped GEMMs share (gpu/kernels/triton/moe_gemm.py for experts in
the model dtype, gpu/kernels/triton/mxfp4_moe.py for MXFP4-packed ones): the tile map over
expert-sorted rows and the epilogue. They differ only in how a K tile of the weights is read.

    out[dst(r)] = row_scale[r] * act(acc[r] + bias[e(r)])      for every routed row r

act: none, SwiGLU silu(gate) * up, or gpt-oss's clamped SwiGLU (up clamped to ±limit, gate
below limit, (up + 1) * gate * sigmoid(alpha gate)), over interleaved (gate, up) columns
(N -> N/2). dst(r) is out_rows[r] with a scatter (back to (token, slot) order), else r.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# the epilogue's ACTIVATION constexpr
NO_ACTIVATION, SWIGLU, CLAMPED_SWIGLU = 0, 1, 2


def activation_args(swiglu) -> tuple[int, float, float]:
    """A launcher's `swiglu` (None; True: SwiGLU; (alpha, limit): gpt-oss's clamped SwiGLU)
    -> (ACTIVATION, alpha, limit)."""
    if swiglu is None or swiglu is False:
        return NO_ACTIVATION, 0.0, 0.0
    if swiglu is True:
        return SWIGLU, 0.0, 0.0
    alpha, limit = swiglu
    return CLAMPED_SWIGLU, float(alpha), float(limit)


def activation_ref(y: torch.Tensor, swiglu) -> torch.Tensor:
    """The references' activation over interleaved (gate, up) columns, in fp32."""
    act, alpha, limit = activation_args(swiglu)
    if act == SWIGLU:
        return torch.nn.functional.silu(y[:, ::2]) * y[:, 1::2]
    if act == CLAMPED_SWIGLU:
        gate, up = y[:, ::2].clamp(max=limit), y[:, 1::2].clamp(-limit, limit)
        return (up + 1) * gate * torch.sigmoid(gate * alpha)
    return y


@triton.jit
def moe_epilogue(acc, e64, rows, row_mask, cols, col_mask, pid_n, N,
                 bias_ptr, stride_bias, row_scale_ptr, out_rows_ptr, out_ptr, stride_om, alpha, limit,
                 HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, ROW_SCALE: tl.constexpr,
                 SCATTER_OUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Stores a [BLOCK_M, BLOCK_N] fp32 tile of expert e64's rows `rows` and columns `cols`."""
    if HAS_BIAS:
        bias = tl.load(bias_ptr + e64 * stride_bias + cols, mask=col_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if ACTIVATION > 0:
        gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))   # interleaved columns
        if ACTIVATION == 2:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            y = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
        else:
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


def tile_map(offs: torch.Tensor, n_rows: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert [tiles], first row [tiles]) int32 on offs' device, -1 past the last tile; built
    with device ops only (no host sync). A tile is block_m rows of one expert; an expert with
    no rows has none. tiles = min(n_rows, n_rows / block_m + E)."""
    E = offs.shape[0]
    ends = offs.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    tiles = (counts + block_m - 1) // block_m
    tile_end = tiles.cumsum(0)
    max_tiles = min(n_rows, triton.cdiv(n_rows, block_m) + E)
    ids = torch.arange(max_tiles, device=offs.device)
    expert = torch.searchsorted(tile_end, ids, right=True)                 # E past the end
    e = expert.clamp(max=E - 1)
    first = (ends - counts)[e] + (ids - (tile_end - tiles)[e]) * block_m
    return torch.where(expert < E, expert, -1).to(torch.int32), first.to(torch.int32)


def pick_blocks(n_rows: int, num_experts: int, n: int, block_k: int, interpret: bool) -> dict:
    """Two tile shapes by the mean rows an expert (decode: a few; prefill: many), so a run
    compiles two variants at most."""
    return dict(BLOCK_M=16 if n_rows < 16 * num_experts else 64, BLOCK_N=64 if n >= 64 else 32,
                BLOCK_K=block_k, num_warps=4, num_stages=1 if interpret else 3)
