"""W4A16 (and W8A16) GEMM: integer weights packed along K with per-group scales and zero
points, activations in the serving dtype. AWQ, GPTQ and compressed-tensors' pack-quantized
W4A16 all arrive here in one layout, made at load by gpu/quantization/cuda_linear.py:

    qweight int32 [K * BITS / 32, N]   word r of column n holds rows r*PER .. r*PER+PER-1
                                       (PER = 32 / BITS), row r*PER + i in bits i*BITS ..
    scales  fp32  [K / g, N]           the group's scale
    zeros   uint8 [K / g, N]           the group's zero point, q - z in the format's integers
    w[n, k] = (q[k, n] - zeros[k // g, n]) * scales[k // g, n]

    out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n])

Each weight tile is dequantized in registers to the activations' dtype, one fp32 product
and one rounding a weight, the very value the dequantized-at-load weight holds, so the
GEMM is the dequantized model's up to the summation order. A 4-bit weight moves K*N/2
bytes instead of bf16's 2*K*N (plus K*N/g * 5 bytes of scales and zeros: 1/26 more at
g = 128), which is what decode, bandwidth-bound, pays for.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit(do_not_specialize=["M"])
def _wna16_gemm_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, M, N, K, group, stride_xm, stride_om,
    BITS: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, GROUP_ALIGNED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    PER: tl.constexpr = 32 // BITS
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)                     # [BM, BK]
        wmask = k_mask[:, None] & col_mask[None, :]
        words = tl.load(qw_ptr + (ks // PER)[:, None].to(tl.int64) * N + cols[None, :], mask=wmask, other=0)
        q = (words >> ((ks % PER) * BITS)[:, None]) & ((1 << BITS) - 1)                       # [BK, BN]
        if GROUP_ALIGNED:   # the tile lies in one group: one scale and zero a column
            g = (k0 // group).to(tl.int64) * N + cols
            s = tl.load(s_ptr + g, mask=col_mask, other=0.0)[None, :]
            z = tl.load(z_ptr + g, mask=col_mask, other=0).to(tl.int32)[None, :]
        else:
            g = (ks // group)[:, None].to(tl.int64) * N + cols[None, :]
            s = tl.load(s_ptr + g, mask=wmask, other=0.0)
            z = tl.load(z_ptr + g, mask=wmask, other=0).to(tl.int32)
        w = ((q - z).to(tl.float32) * s).to(a.dtype)                                         # [BK, BN]
        if UPCAST:
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def _pick_blocks(m: int, n: int, k: int) -> dict:
    """Decode (a few rows): thin M tiles, wide K; prefill: square-ish tiles."""
    small = m <= 16
    return dict(BLOCK_M=16 if small else 64, BLOCK_N=64 if n >= 64 else 32,
                BLOCK_K=64 if k >= 64 else 32, num_warps=4,
                num_stages=1 if _INTERPRET else 3)


def wna16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
               bits: int = 4, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] in x.dtype; the layout in the module docstring."""
    M, K = x.shape
    N = qweight.shape[1]
    per = 32 // bits
    assert bits in (4, 8) and K % per == 0 and qweight.shape == (K // per, N), \
        f"qweight {tuple(qweight.shape)} for K={K}, {bits} bits"
    assert K % group == 0 and scales.shape == zeros.shape == (K // group, N), f"scales {tuple(scales.shape)}"
    assert x.stride(1) == 1 and qweight.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    cfg = _pick_blocks(M, N, K)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"]))
    _wna16_gemm_kernel[grid](
        x, qweight, scales, zeros, bias if bias is not None else scales, out, M, N, K, group,
        x.stride(0), out.stride(0), BITS=bits, HAS_BIAS=bias is not None, GROUP_ALIGNED=group % cfg["BLOCK_K"] == 0,
        UPCAST=_INTERPRET or x.dtype == torch.float32, **cfg)
    return out


def unpack(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int, bits: int = 4) -> torch.Tensor:
    """The layout -> the dense weight [N, K] in fp32 (the reference, and what the kernel computes)."""
    per = 32 // bits
    words = qweight.to(torch.int64)                                            # [K/per, N]
    q = (words[:, None, :] >> (torch.arange(per, device=qweight.device) * bits)[None, :, None]) & ((1 << bits) - 1)
    q = q.reshape(-1, qweight.shape[1])                                        # [K, N]
    z = zeros.to(torch.int64).repeat_interleave(group, 0)
    return ((q - z).float() * scales.repeat_interleave(group, 0)).t()


def wna16_gemm_ref(x, qweight, scales, zeros, group, bits=4, bias=None):
    """The weight dequantized to x.dtype (as the kernel rounds it), the product in fp32."""
    w = unpack(qweight, scales, zeros, group, bits).to(x.dtype)
    y = x.float() @ w.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def aot_cases():
    """scripts/check_triton_compile.py's launches: Qwen3-8B's gate_up (K 4096, N 2 * 12288) and
    down (K 12288, N 4096) in 4-bit group 128, bf16, a decode of 4 tokens and a prefill of 2048;
    an 8-bit case, and groups of 32."""
    for tokens in (4, 2048):
        for proj, (k, n) in (("gate_up", (4096, 24576)), ("down", (12288, 4096))):
            def launch(tokens=tokens, k=k, n=n):
                wna16_gemm(torch.zeros(tokens, k, dtype=torch.bfloat16), torch.zeros(k // 8, n, dtype=torch.int32),
                           torch.zeros(k // 128, n), torch.zeros(k // 128, n, dtype=torch.uint8), 128)
            yield f"wna16_gemm[qwen3-8b,w4 g128,bf16,{proj},{tokens} tokens]", ["_wna16_gemm_kernel"], launch

    def launch8():
        wna16_gemm(torch.zeros(4, 4096, dtype=torch.bfloat16), torch.zeros(1024, 4096, dtype=torch.int32),
                   torch.zeros(32, 4096), torch.zeros(32, 4096, dtype=torch.uint8), 128, bits=8,
                   bias=torch.zeros(4096, dtype=torch.bfloat16))
    yield "wna16_gemm[w8 g128 + bias,bf16,4 tokens]", ["_wna16_gemm_kernel"], launch8

    def launch_g32():     # groups smaller than a K tile: scales gathered per row
        wna16_gemm(torch.zeros(4, 4096, dtype=torch.bfloat16), torch.zeros(512, 4096, dtype=torch.int32),
                   torch.zeros(128, 4096), torch.zeros(128, 4096, dtype=torch.uint8), 32)
    yield "wna16_gemm[w4 g32,bf16,4 tokens]", ["_wna16_gemm_kernel"], launch_g32
