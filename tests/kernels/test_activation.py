import pytest
import torch

from gpu.kernels.triton.activation import gelu_tanh_and_mul, gelu_tanh_and_mul_ref, silu_and_mul, silu_and_mul_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,inter", [(7, 1536), (1, 72), (33, 36)])
def test_silu_and_mul_matches_ref(n, inter, dtype, device, tol):
    g = torch.Generator().manual_seed(n)
    x = (2 * torch.randn(n, 2 * inter, generator=g)).to(dtype).to(device)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), **tol(dtype))


def test_silu_and_mul_ref_is_swiglu():
    x = torch.randn(3, 10)
    gate, up = x[:, :5], x[:, 5:]
    torch.testing.assert_close(silu_and_mul_ref(x), gate * torch.sigmoid(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,inter", [(7, 1536), (33, 36)])
def test_gelu_tanh_and_mul_matches_ref(n, inter, dtype, device, tol):
    g = torch.Generator().manual_seed(n)
    x = (2 * torch.randn(n, 2 * inter, generator=g)).to(dtype).to(device)
    torch.testing.assert_close(gelu_tanh_and_mul(x), gelu_tanh_and_mul_ref(x), **tol(dtype))
