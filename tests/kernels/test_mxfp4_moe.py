"""The MXFP4 grouped GEMM against dequantise-then-matmul, on random packed experts with uneven
row counts (experts with zero rows among them), with each epilogue."""

import pytest
import torch

from gpu.quantization import mxfp4
from gpu.quantization.mxfp4 import dequantize_packed
from gpu.kernels.triton.mxfp4_moe import mxfp4_moe_matmul, mxfp4_moe_matmul_ref, tile_map


def _experts(E, N, K, seed=0):
    """Random packed experts: every code, scales 2^-3..2^0 (values up to 6)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (E, N, K // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(124, 128, (E, N, K // 32), generator=g, dtype=torch.uint8)
    bias = torch.randn(E, N, generator=g)
    return blocks, scales, bias


def _offs(counts, device):
    return torch.tensor(counts, device=device).cumsum(0).to(torch.int32)


def test_tile_map_covers_every_row_once():
    counts = [5, 0, 17, 0, 1, 16]
    ex, first = tile_map(_offs(counts, "cpu"), sum(counts), 16)
    seen = []
    for e, r in zip(ex.tolist(), first.tolist()):
        if e >= 0:
            end = sum(counts[:e + 1])
            seen += [(e, row) for row in range(r, min(r + 16, end))]
    want = [(e, row) for e, c in enumerate(counts) for row in range(sum(counts[:e]), sum(counts[:e]) + c)]
    assert seen == want
    assert ex.shape[0] == min(39, 39 // 16 + 1 + 6) and (ex[5:] == -1).all()   # 5 tiles, the rest idle


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[3, 0, 20, 1, 0], [0, 0, 1, 0, 0], [0, 0, 0, 0, 0]], ids=["uneven", "one", "none"])
def test_plain_matches_dequantise_then_matmul(device, tol, dtype, counts):
    E, N, K = 5, 48, 160             # N not a multiple of BLOCK_N, K not of BLOCK_K
    blocks, scales, bias = (t.to(device) for t in _experts(E, N, K))
    rows = sum(counts)
    a = torch.randn(rows, K, device=device).to(dtype)
    offs = _offs(counts, device)
    got = mxfp4_moe_matmul(a, blocks, scales, offs, bias=bias.to(dtype))
    want = mxfp4_moe_matmul_ref(a, blocks, scales, offs, bias=bias.to(dtype))
    assert got.shape == (rows, N) and got.dtype == dtype
    scale = max([1.0] + want.float().abs().flatten().tolist())
    torch.testing.assert_close(got.float() / scale, want.float() / scale, **tol(dtype))


def test_swiglu_gather_matches_reference(device, tol):
    """gate/up: rows gathered from the tokens (top 2 of 4 experts), clamped SwiGLU epilogue."""
    E, N, K, T = 4, 64, 64, 9
    blocks, scales, bias = (t.to(device) for t in _experts(E, N, K, seed=1))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, K, generator=g).to(device)
    experts = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)]).to(device)   # [T, 2]
    experts[:, :] = experts.clamp(max=2)           # expert 3 gets no rows
    experts[:, 1] = torch.where(experts[:, 1] == experts[:, 0], (experts[:, 0] + 1) % 3, experts[:, 1])
    by_expert, order = experts.flatten().sort(stable=True)
    offs = torch.searchsorted(by_expert, torch.arange(1, E + 1, device=device), out_int32=True)
    assert offs.tolist()[-1] == offs.tolist()[-2] == 2 * T
    kw = dict(bias=bias, a_rows=order // 2, swiglu=(1.702, 7.0))
    got = mxfp4_moe_matmul(x, blocks, scales, offs, **kw)
    want = mxfp4_moe_matmul_ref(x, blocks, scales, offs, **kw)
    assert got.shape == (2 * T, N // 2)
    assert (want.abs() > 1).any() and (want.abs() < 100).all()
    torch.testing.assert_close(got, want, **tol(torch.float32))


def test_row_scale_and_scatter_match_reference(device, tol):
    """down: router weight per row, rows written back to (token, slot) order."""
    E, N, K, rows = 3, 32, 64, 11
    blocks, scales, bias = (t.to(device) for t in _experts(E, N, K, seed=2))
    g = torch.Generator().manual_seed(4)
    a = torch.randn(rows, K, generator=g).to(device)
    offs = _offs([4, 0, 7], device)
    row_scale = torch.rand(rows, generator=g).to(device)
    out_rows = torch.randperm(rows, generator=g).to(device)
    kw = dict(bias=bias, row_scale=row_scale, out_rows=out_rows)
    got = mxfp4_moe_matmul(a, blocks, scales, offs, **kw)
    torch.testing.assert_close(got, mxfp4_moe_matmul_ref(a, blocks, scales, offs, **kw), **tol(torch.float32))
    plain = mxfp4_moe_matmul_ref(a, blocks, scales, offs, bias=bias)
    torch.testing.assert_close(got[out_rows.long()], plain * row_scale[:, None], **tol(torch.float32))


def test_decoding_covers_every_code_and_scale_extremes(device):
    """One expert, one row of ones: the output is the row sums of the dequantised weights, for
    every e2m1 code (both nibbles) and scales 2^-126 .. 2^123."""
    K = 32
    codes = torch.arange(16, dtype=torch.uint8)
    blocks = (codes | (codes.roll(1) << 4)).reshape(1, 1, 16).repeat(1, 4, 1)        # [1, 4, 16]
    scales = torch.tensor([[[127], [1], [130], [250]]], dtype=torch.uint8)
    w = dequantize_packed(blocks, scales, torch.float32)
    assert w[0, 0, :4].tolist() == [0.0, -6.0, 0.5, 0.0]         # low nibble code 0, high nibble code 15, ...
    a = torch.zeros(1, K)
    a[0, 3] = 1.0                                                  # picks element 3 (code 1's high nibble: 0)
    a[0, 4] = 1.0                                                  # element 4: code 2 -> 1.0
    out = mxfp4_moe_matmul(a.to(device), blocks.to(device), scales.to(device), _offs([1], device))
    want = (w[0] @ a[0]).unsqueeze(0)
    torch.testing.assert_close(out.cpu(), want, rtol=0, atol=0)


def test_packed_layout_is_the_checkpoints():
    w = torch.randn(2, 8, 64)
    blocks, scales = mxfp4.quantize(w)                               # [2, 8, 2, 16], [2, 8, 2]
    torch.testing.assert_close(dequantize_packed(blocks.flatten(-2), scales, torch.float32),
                               mxfp4.dequantize(blocks, scales, torch.float32))


def test_dot_scaled_variant_matches_reference(device, tol):
    """Triton's tl.dot_scaled on the packed operand (bf16 activations), every epilogue."""
    E, N, K, T = 4, 64, 160, 7
    blocks, scales, bias = (t.to(device) for t in _experts(E, N, K, seed=5))
    g = torch.Generator().manual_seed(6)
    x = torch.randn(T, K, generator=g).bfloat16().to(device)
    order = torch.arange(2 * T, device=device)
    offs = _offs([5, 0, 6, 3], device)
    kw = dict(bias=bias.bfloat16(), a_rows=order // 2, swiglu=(1.702, 7.0))
    got = mxfp4_moe_matmul(x, blocks, scales, offs, dot_scaled=True, **kw)
    want = mxfp4_moe_matmul_ref(x, blocks, scales, offs, **kw)
    scale = max([1.0] + want.float().abs().flatten().tolist())
    torch.testing.assert_close(got.float() / scale, want.float() / scale, **tol(torch.bfloat16))
    torch.testing.assert_close(got, mxfp4_moe_matmul(x, blocks, scales, offs, **kw), **tol(torch.bfloat16))
