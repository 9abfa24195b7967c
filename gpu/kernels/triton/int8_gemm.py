"""INT8 W8A8 GEMM: per-channel weight scales, dynamic per-token activation scales
(compressed-tensors' int-quantized W8A8, RedHat's "-quantized.w8a8" builds):

    w   int8 [N, K], ws fp32 [N]: w_real[n, k] = w[n, k] * ws[n] (symmetric)
    x   [M, K] in the serving dtype, quantized in the kernel per token: sa = max_k |x[m, k]| / 127,
        xq = round(x / sa) (half away from zero) in [-127, 127]; or, with a static scale xs [1] (a
        checkpoint's input_scale, symmetric), sa = xs for every token, xq = round(x / xs) in [-128, 127]

    out[m, n] = sa[m] * ws[n] * sum_k xq[m, k] * w[n, k]      (int32 sums, exact)

Two passes over each program's rows of x: the row maxima, then the int8 tensor-core GEMM
(sm_80+). x is small at decode (a few rows); the weights, one byte each instead of bf16's two,
are read once.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit(do_not_specialize=["M"])
def _int8_gemm_kernel(
    x_ptr, w_ptr, ws_ptr, xs_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_om,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, STATIC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    if STATIC:
        sa = tl.zeros((BLOCK_M,), dtype=tl.float32) + tl.load(xs_ptr)                          # [BM]
        lo = -128.0
    else:
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & (ks < K)[None, :], other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(a), axis=1))
        sa = tl.maximum(amax, 1e-12) / 127.0                                                 # [BM]
        lo = -127.0
    if UPCAST:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        v = a / sa[:, None]
        aq = tl.clamp(tl.where(v >= 0, tl.floor(v + 0.5), tl.ceil(v - 0.5)), lo, 127.0).to(tl.int8)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * K + ks[:, None],
                    mask=k_mask[:, None] & col_mask[None, :], other=0)                        # [BK, BN] int8
        if UPCAST:   # the interpreter: fp32 sums of int8 products, exact below 2^24
            acc = tl.dot(aq.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(aq, w, acc)
    ws = tl.load(ws_ptr + cols, mask=col_mask, other=0.0)
    y = acc.to(tl.float32) * sa[:, None] * ws[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def _pick_blocks(m: int, n: int, k: int) -> dict:
    small = m <= 16
    return dict(BLOCK_M=16 if small else 64, BLOCK_N=64 if n >= 64 else 32,
                BLOCK_K=128 if k >= 128 else 32, num_warps=4,
                num_stages=1 if _INTERPRET else (4 if small else 3))


def int8_gemm(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None = None,
              xs: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K]; w int8 [N, K]; ws fp32 [N]; xs: a static activation scale, fp32 [1] (None:
    dynamic per token) -> [M, N] in x.dtype."""
    M, K = x.shape
    N = w.shape[0]
    assert w.dtype == torch.int8 and w.shape == (N, K) and w.is_contiguous(), f"w {w.dtype} {tuple(w.shape)}"
    assert ws.shape == (N,) and ws.dtype == torch.float32 and x.stride(1) == 1
    assert xs is None or (xs.numel() == 1 and xs.dtype == torch.float32), "xs: one fp32 activation scale"
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    cfg = _pick_blocks(M, N, K)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"]))
    _int8_gemm_kernel[grid](x, w, ws, xs if xs is not None else ws, bias if bias is not None else ws, out, M, N, K,
                            x.stride(0), out.stride(0), HAS_BIAS=bias is not None, UPCAST=_INTERPRET,
                            STATIC=xs is not None, **cfg)
    return out


def quantize_tokens(x: torch.Tensor, xs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], scales fp32 [M]): the kernel's activations (xs: static)."""
    xf = x.float()
    sa = xf.abs().amax(-1).clamp(min=1e-12) / 127.0 if xs is None else xs.float().reshape(1).expand(x.shape[0])
    v = xf / sa[:, None]
    q = torch.where(v >= 0, torch.floor(v + 0.5), torch.ceil(v - 0.5)).clamp(-127 if xs is None else -128, 127)
    return q.to(torch.int8), sa


def int8_gemm_ref(x, w, ws, bias=None, xs=None):
    """The kernel's integer sums in float64 (exact), scaled in fp32."""
    xq, sa = quantize_tokens(x, xs)
    y = (xq.double() @ w.double().t()).float() * sa[:, None] * ws.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def aot_cases():
    """scripts/check_triton_compile.py's launches: a W8A8 Qwen3-8B's gate_up and down, bf16
    activations, a decode of 4 tokens and a prefill of 2048."""
    for tokens in (4, 2048):
        for proj, (k, n) in (("gate_up", (4096, 24576)), ("down", (12288, 4096))):
            def launch(tokens=tokens, k=k, n=n):
                int8_gemm(torch.zeros(tokens, k, dtype=torch.bfloat16), torch.zeros(n, k, dtype=torch.int8),
                          torch.zeros(n))
            yield f"int8_gemm[qwen3-8b-w8a8,bf16,{proj},{tokens} tokens]", ["_int8_gemm_kernel"], launch

    def static():
        int8_gemm(torch.zeros(4, 4096, dtype=torch.bfloat16), torch.zeros(6144, 4096, dtype=torch.int8),
                  torch.zeros(6144), xs=torch.ones(1))
    yield "int8_gemm[static activation scale,bf16,4 tokens]", ["_int8_gemm_kernel"], static
