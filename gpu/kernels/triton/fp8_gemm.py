"""FP8 (e4m3) block-scaled GEMM with dynamic per-token-group activation scales: DeepSeek-V3's
and Qwen3-*-FP8's recipe, and the per-tensor / per-channel FP8 checkpoints' weights too.

    w       e4m3 [N, K] (passed as its uint8 bytes), ws fp32 [ceil(N / bo), ceil(K / bi)]:
            w_real[n, k] = w[n, k] * ws[n // bo, k // bi]; 128x128 blocks (bo = bi = 128),
            per channel (bo = 1, bi >= K) or per tensor (bo >= N, bi >= K); bi a multiple of
            GROUP = 128 or at least K, so one weight scale covers each K tile
    x       [M, K] in the serving dtype, quantized in the kernel per token and per group of
            GROUP columns: sa = max|x[m, group]| / 448, xq = e4m3(x / sa); or, with a static
            scale xs [1] (a checkpoint's input_scale), sa = xs for every token and group,
            xq = e4m3(clamp(x / xs, -448, 448))

    out[m, n] = sum over groups g of sa[m, g] * ws[n // bo, g // bi] * (xq[m, g] . w[n, g])

The dot products run on the tensor cores in fp8 with fp32 accumulation (sm_89+); every program
quantizes the rows it reads (the same numbers in every column tile: no extra launch, and no
activation copy). Weights move 1 byte each instead of bf16's 2.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from gpu.kernels.triton.fp8_kv import round_e4m3

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
GROUP = 128
E4M3_MAX = 448.0


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    x_ptr, w_ptr, ws_ptr, xs_ptr, bias_ptr, out_ptr, M, N, K, bo, bi, ws_cols, stride_xm, stride_om,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, STATIC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    ws_rows = (cols // bo).to(tl.int64) * ws_cols
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)      # [BM, BK]
        if STATIC:
            sa = tl.zeros((BLOCK_M,), dtype=tl.float32) + tl.load(xs_ptr)                      # [BM]
        else:
            sa = tl.maximum(tl.max(tl.abs(a), axis=1), 1e-12) / 448.0                         # [BM]
        v = tl.clamp(a / sa[:, None], -448.0, 448.0)
        if UPCAST:
            aq = round_e4m3(v)
        else:
            aq = v.to(tl.float8e4nv)
        wb = tl.load(w_ptr + cols[None, :].to(tl.int64) * K + ks[:, None],
                     mask=k_mask[:, None] & col_mask[None, :], other=0)                       # [BK, BN] bytes
        w = wb.to(tl.float8e4nv, bitcast=True)
        ws = tl.load(ws_ptr + ws_rows + k0 // bi, mask=col_mask, other=0.0)                  # [BN]
        if UPCAST:
            d = tl.dot(aq.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            d = tl.dot(aq, w)
        acc += d * sa[:, None] * ws[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def _pick_blocks(m: int, n: int) -> dict:
    small = m <= 16
    return dict(BLOCK_M=16 if small else 64, BLOCK_N=64 if n >= 64 else 32, BLOCK_K=GROUP, num_warps=4,
                num_stages=1 if _INTERPRET else (4 if small else 3))


def fp8_gemm(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, block: tuple[int, int],
             bias: torch.Tensor | None = None, xs: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K]; w float8_e4m3fn [N, K]; ws fp32 [ceil(N/bo), ceil(K/bi)]; block (bo, bi);
    xs: a static activation scale, fp32 [1] (None: dynamic per token and group) -> [M, N] in x.dtype."""
    M, K = x.shape
    N = w.shape[0]
    bo, bi = block
    assert w.dtype == torch.float8_e4m3fn and w.shape == (N, K) and w.is_contiguous(), f"w {w.dtype} {tuple(w.shape)}"
    assert bi % GROUP == 0 or bi >= K, f"weight scale blocks of {bi} columns: not a multiple of {GROUP}"
    assert ws.shape == (-(-N // bo), -(-K // bi)) and ws.dtype == torch.float32 and ws.is_contiguous(), \
        f"ws {tuple(ws.shape)} for [{N}, {K}] in {bo}x{bi} blocks"
    assert x.stride(1) == 1
    assert xs is None or (xs.numel() == 1 and xs.dtype == torch.float32), "xs: one fp32 activation scale"
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    cfg = _pick_blocks(M, N)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"]))
    _fp8_gemm_kernel[grid](
        x, w.view(torch.uint8), ws, xs if xs is not None else ws, bias if bias is not None else ws, out, M, N, K,
        min(bo, N), min(bi, K + GROUP), ws.shape[1], x.stride(0), out.stride(0), HAS_BIAS=bias is not None,
        UPCAST=_INTERPRET, STATIC=xs is not None, **cfg)
    return out


def quantize_groups(x: torch.Tensor, xs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], scales fp32 [M, ceil(K / GROUP)]): the kernel's activations
    (xs: the static scale of every group)."""
    M, K = x.shape
    pad = -K % GROUP
    xf = torch.nn.functional.pad(x.float(), (0, pad)).reshape(M, -1, GROUP)
    sa = (xf.abs().amax(-1).clamp(min=1e-12) / E4M3_MAX if xs is None
          else xs.float().reshape(1, 1).expand(M, xf.shape[1]))
    q = (xf / sa[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(M, -1)[:, :K], sa


def expand_block_scales(ws: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """ws [ceil(N/bo), ceil(K/bi)] -> the [N, K] fp32 multiplier of each weight."""
    n, k = shape
    bo, bi = min(block[0], n), min(block[1], k)
    return ws.float().repeat_interleave(bo, 0)[:n].repeat_interleave(bi, 1)[:, :k]


def fp8_gemm_ref(x, w, ws, block, bias=None, xs=None):
    """The kernel's sum in fp32 from torch's own e4m3 rounding of the activations."""
    xq, sa = quantize_groups(x, xs)
    K = x.shape[1]
    xr = xq.float() * sa.repeat_interleave(GROUP, 1)[:, :K]
    y = xr @ (w.float() * expand_block_scales(ws, w.shape, block)).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def aot_cases():
    """scripts/check_triton_compile.py's launches: Qwen3-8B-FP8's gate_up and down in 128x128
    blocks, bf16 activations, a decode of 4 tokens and a prefill of 2048; a per-tensor case."""
    for tokens in (4, 2048):
        for proj, (k, n) in (("gate_up", (4096, 24576)), ("down", (12288, 4096))):
            def launch(tokens=tokens, k=k, n=n):
                fp8_gemm(torch.zeros(tokens, k, dtype=torch.bfloat16), torch.zeros(n, k, dtype=torch.float8_e4m3fn),
                         torch.zeros(n // 128, k // 128), (128, 128))
            yield f"fp8_gemm[qwen3-8b-fp8,128x128,bf16,{proj},{tokens} tokens]", ["_fp8_gemm_kernel"], launch

    def per_tensor():
        fp8_gemm(torch.zeros(4, 4096, dtype=torch.bfloat16), torch.zeros(6144, 4096, dtype=torch.float8_e4m3fn),
                 torch.zeros(1, 1), (6144, 4096), bias=torch.zeros(6144, dtype=torch.bfloat16))
    yield "fp8_gemm[per-tensor + bias,bf16,4 tokens]", ["_fp8_gemm_kernel"], per_tensor

    def static():
        fp8_gemm(torch.zeros(4, 4096, dtype=torch.bfloat16), torch.zeros(6144, 4096, dtype=torch.float8_e4m3fn),
                 torch.zeros(1, 1), (6144, 4096), xs=torch.ones(1))
    yield "fp8_gemm[per-tensor, static activation scale,bf16,4 tokens]", ["_fp8_gemm_kernel"], static
