"""RMSNorm and residual-add + RMSNorm.

    rms_norm(x [N, D], weight [D], eps) -> x * rsqrt(mean(x^2) + eps) * weight
    fused_add_rms_norm(x, residual, weight, eps) -> (rms_norm(s), s), s = x + residual

All math in fp32, cast on store.  In the fused form the sum s is rounded to the
input dtype first and the norm is taken of the rounded sum, as a model that adds
the residual in its own dtype would (Hugging Face Llama).  Gemma-style (1 + w)
weights are the caller's business (pass weight + 1).

One program normalizes BLOCK_N rows held whole in one [BLOCK_N, BLOCK_D] tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n_rows"])  # the row count changes every step
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr,
    n_rows, eps,
    stride_x, stride_res, stride_out, stride_sum,
    D: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]

    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * stride_res + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + rows[:, None] * stride_sum + cols[None, :], s, mask=mask)
        x = s.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)

    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)
    y = x * rstd[:, None] * w[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def _pick_blocks(d: int) -> dict:
    block_d = triton.next_power_of_2(d)
    block_n = max(1, min(16, 4096 // block_d))
    num_warps = 4 if block_d * block_n <= 4096 else 8
    return dict(BLOCK_N=block_n, BLOCK_D=block_d, num_warps=num_warps)


def _launch(x, residual, weight, eps):
    N, D = x.shape
    assert weight.shape == (D,) and weight.is_contiguous(), f"weight {tuple(weight.shape)} vs x {tuple(x.shape)}"
    assert x.stride(1) == 1, "rows must be contiguous"
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    total = None
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1
        total = torch.empty_like(out)
    if N == 0:
        return out, total
    cfg = _pick_blocks(D)
    grid = (triton.cdiv(N, cfg["BLOCK_N"]),)
    _rms_norm_kernel[grid](
        x, residual if residual is not None else x, weight, out, total if total is not None else out,
        N, eps,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        total.stride(0) if total is not None else 0,
        D=D, HAS_RESIDUAL=residual is not None, **cfg,
    )
    return out, total


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual), both new tensors."""
    return _launch(x, residual, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    total = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(total, weight, eps), total
