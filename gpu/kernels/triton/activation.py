"""Gated MLP activations on x [N, 2*I] -> [N, I]:
    silu_and_mul:      silu(x[:, :I]) * x[:, I:]          (SwiGLU)
    gelu_tanh_and_mul: gelu_tanh(x[:, :I]) * x[:, I:]     (GeGLU, GELU's tanh approximation: Gemma)

Math in fp32, cast on store.  Grid: (rows / BLOCK_N, I / BLOCK_I).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n_rows"])  # the row count changes every step
def _silu_and_mul_kernel(
    x_ptr, out_ptr,
    n_rows, inter,
    stride_x, stride_out,
    BLOCK_N: tl.constexpr,
    BLOCK_I: tl.constexpr,
    GELU_TANH: tl.constexpr = False,
):
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < n_rows)[:, None] & (cols < inter)[None, :]
    gate_ptrs = x_ptr + rows[:, None] * stride_x + cols[None, :]
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + inter, mask=mask, other=0.0).to(tl.float32)
    if GELU_TANH:  # 0.5 g (1 + tanh(u)) = g * sigmoid(2u), u = sqrt(2/pi) (g + 0.044715 g^3)
        u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        y = gate / (1.0 + tl.exp(-2.0 * u)) * up
    else:
        y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def _pick_blocks(n_rows: int, inter: int) -> dict:
    block_i = min(1024, triton.next_power_of_2(inter))
    block_n = max(1, 4096 // block_i)  # not from n_rows: one compiled variant for every batch
    return dict(BLOCK_N=block_n, BLOCK_I=block_i, num_warps=4)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _gated(x, gelu_tanh=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _gated(x, gelu_tanh=True)


def _gated(x: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    N, two_i = x.shape
    assert two_i % 2 == 0 and x.stride(1) == 1, f"x {tuple(x.shape)} must be [N, 2*I] with contiguous rows"
    inter = two_i // 2
    out = torch.empty((N, inter), dtype=x.dtype, device=x.device)
    if N == 0:
        return out
    cfg = _pick_blocks(N, inter)
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(inter, cfg["BLOCK_I"]))
    _silu_and_mul_kernel[grid](x, out, N, inter, x.stride(0), out.stride(0), GELU_TANH=gelu_tanh, **cfg)
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.gelu(gate, approximate="tanh") * up).to(x.dtype)
