"""The quantized-weight GEMMs of pre-quantized checkpoints (gpu/kernels/triton/wna16_gemm.py,
fp8_gemm.py, int8_gemm.py) against their torch references, and against the product with the
dequantized weight in fp32, within the bound the activation quantization allows. Tiny, odd
shapes (N not a multiple of BLOCK_N, M not of BLOCK_M): each call is ~1 s under the
interpreter."""

import pytest
import torch

from gpu.kernels.triton.fp8_gemm import expand_block_scales, fp8_gemm, fp8_gemm_ref
from gpu.kernels.triton.int8_gemm import int8_gemm, int8_gemm_ref
from gpu.kernels.triton.wna16_gemm import unpack, wna16_gemm, wna16_gemm_ref
from gpu.quantization.awq import pack_columns


def _relative(got, want):
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.parametrize("bits,group,dtype,bias", [(4, 32, torch.bfloat16, False), (8, 64, torch.float32, True)],
                         ids=["w4-g32-bf16 (groups inside a K tile)", "w8-g64-fp32-bias (one group a K tile)"])
def test_wna16_matches_the_dequantized_weights(device, tol, bits, group, dtype, bias):
    M, K, N = 5, 128, 48
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 2 ** bits, (K, N), generator=g)
    qweight = pack_columns(q.t().contiguous(), bits).t().contiguous()        # packed along K: [K*b/32, N]
    scales = torch.rand(K // group, N, generator=g) * 0.02 + 0.01
    zeros = torch.randint(0, 2 ** bits, (K // group, N), generator=g).to(torch.uint8)
    x = torch.randn(M, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    z = zeros.long().repeat_interleave(group, 0)
    w = ((q - z).float() * scales.repeat_interleave(group, 0)).t()           # [N, K], from the integers
    assert torch.equal(unpack(qweight, scales, zeros, group, bits), w)
    d = lambda t: None if t is None else t.to(device)  # noqa: E731
    got = wna16_gemm(d(x), d(qweight), d(scales), d(zeros), group, bits, bias=d(b)).cpu()
    want = wna16_gemm_ref(x, qweight, scales, zeros, group, bits, bias=b)
    assert got.shape == (M, N) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), **tol(dtype))


@pytest.mark.parametrize("block,N", [((128, 128), 200), ((1, 10 ** 9), 48)], ids=["128x128 blocks", "per-channel"])
def test_fp8_block_scaled(device, tol, block, N):
    """K = 320: two whole activation groups and a partial one; N = 200 with 128-row blocks: a
    partial weight block too."""
    from gpu.quantization.fp8 import quantize_blocks

    M, K = 3, 320
    g = torch.Generator().manual_seed(1)
    dense = torch.randn(N, K, generator=g) * 0.05
    if block == (128, 128):
        w, ws = quantize_blocks(dense, block)
    else:
        ws = dense.abs().amax(1, keepdim=True) / 448.0
        w = (dense / ws).to(torch.float8_e4m3fn)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    got = fp8_gemm(x.to(device), w.to(device), ws.contiguous().to(device), block).cpu()
    want = fp8_gemm_ref(x, w, ws, block)
    torch.testing.assert_close(got.float(), want.float(), **tol(torch.bfloat16))
    # against the dequantized model (bf16 activations, unquantized): e4m3's 3-bit mantissa on
    # the activations costs a relative 2^-4 an element at most, ~2% on a long sum
    exact = x.float() @ (w.float() * expand_block_scales(ws, (N, K), block)).t()
    assert _relative(got, exact) < 0.04


def test_int8_per_channel_per_token(device, tol):
    M, K, N = 5, 160, 40
    g = torch.Generator().manual_seed(2)
    w = torch.randint(-127, 128, (N, K), generator=g).to(torch.int8)
    ws = torch.rand(N, generator=g) * 1e-3 + 1e-4
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    x[1] *= 40                                                               # rows of other scales
    b = torch.randn(N, generator=g).to(torch.bfloat16)
    got = int8_gemm(x.to(device), w.to(device), ws.to(device), bias=b.to(device)).cpu()
    want = int8_gemm_ref(x, w, ws, bias=b)
    torch.testing.assert_close(got.float(), want.float(), **tol(torch.bfloat16))
    exact = x.float() @ (w.float() * ws[:, None]).t() + b.float()
    assert _relative(got, exact) < 0.02                                      # 8-bit activations: ~0.5%


def test_static_activation_scales(device, tol):
    """A checkpoint's input_scale (FP8 `activation_scheme: static`, compressed-tensors
    `dynamic: false`): every token quantized by the one scale, clipped where it overflows
    (the scale below is half the batch's largest, so the largest rows saturate), against
    torch's rounding with that scale, and unlike the dynamic scales' result."""
    M, K, N = 4, 160, 40
    g = torch.Generator().manual_seed(3)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    x[2] *= 8
    dense = torch.randn(N, K, generator=g) * 0.05
    ws8 = dense.abs().amax(1, keepdim=True) / 448.0
    w8 = (dense / ws8).to(torch.float8_e4m3fn)
    xs = (x.float().abs().amax() / 448.0 / 2).reshape(1)
    got = fp8_gemm(x.to(device), w8.to(device), ws8.contiguous().to(device), (1, 10 ** 9), xs=xs.to(device)).cpu()
    xq = (x.float() / xs).clamp(-448, 448).to(torch.float8_e4m3fn).float() * xs
    want = xq @ (w8.float() * ws8).t()
    torch.testing.assert_close(got.float(), want, **tol(torch.bfloat16))
    torch.testing.assert_close(got, fp8_gemm_ref(x, w8, ws8, (1, 10 ** 9), xs=xs), **tol(torch.bfloat16))
    assert _relative(got, fp8_gemm_ref(x, w8, ws8, (1, 10 ** 9))) > 0.01     # the clipped rows differ

    wi = torch.randint(-127, 128, (N, K), generator=g).to(torch.int8)
    wsi = torch.rand(N, generator=g) * 1e-3 + 1e-4
    xs = (x.float().abs().amax() / 127.0 / 2).reshape(1)
    got = int8_gemm(x.to(device), wi.to(device), wsi.to(device), xs=xs.to(device)).cpu()
    xq = torch.round(x.float() / xs).clamp(-128, 127)
    want = (xq.double() @ wi.double().t()).float() * xs * wsi[None, :]
    torch.testing.assert_close(got.float(), want, **tol(torch.bfloat16))
    assert _relative(got, int8_gemm_ref(x, wi, wsi)) > 0.01
