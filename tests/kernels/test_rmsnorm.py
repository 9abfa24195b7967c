import pytest
import torch

from gpu.kernels.triton.rmsnorm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(7, 576), (1, 72), (33, 128)]


def _inputs(n, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g).to(dtype).to(device)
    r = torch.randn(n, d, generator=g).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype).to(device)
    return x, r, w


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,d", SHAPES)
def test_rms_norm_matches_ref(n, d, dtype, device, tol):
    x, _, w = _inputs(n, d, dtype, device)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,d", SHAPES)
def test_fused_add_rms_norm_matches_ref(n, d, dtype, device, tol):
    x, r, w = _inputs(n, d, dtype, device, seed=1)
    x0, r0 = x.clone(), r.clone()
    normed, total = fused_add_rms_norm(x, r, w, 1e-5)
    normed_ref, total_ref = fused_add_rms_norm_ref(x, r, w, 1e-5)
    torch.testing.assert_close(total, total_ref, **tol(dtype))
    torch.testing.assert_close(normed, normed_ref, **tol(dtype))
    assert torch.equal(x, x0) and torch.equal(r, r0), "inputs must not be modified"


def test_rms_norm_strided_rows(device, tol):
    x, _, w = _inputs(5, 144, torch.float32, device)
    x_view = x[:, :72]  # row stride 144, D 72
    torch.testing.assert_close(rms_norm(x_view, w[:72], 1e-6), rms_norm_ref(x_view, w[:72], 1e-6),
                               **tol(torch.float32))


def test_rms_norm_ref_matches_torch():
    x, _, w = _inputs(4, 72, torch.float32, "cpu")
    expected = torch.nn.functional.rms_norm(x, (72,), w, 1e-6)
    torch.testing.assert_close(rms_norm_ref(x, w, 1e-6), expected)
