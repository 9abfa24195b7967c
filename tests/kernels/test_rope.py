import pytest
import torch

from gpu.kernels.triton.rope import apply_rope, apply_rope_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def default_cos_sin(head_dim: int, max_positions: int, theta: float = 10000.0) -> torch.Tensor:
    """Test-local builder for the unscaled table: [P, Dh] = [cos | sin] of p * inv_freq."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).float()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,n_q_heads,n_kv_heads,head_dim", [(9, 9, 3, 64), (5, 4, 2, 128), (1, 1, 1, 64)])
def test_apply_rope_matches_ref(T, n_q_heads, n_kv_heads, head_dim, dtype, device, tol):
    g = torch.Generator().manual_seed(T)
    cos_sin = default_cos_sin(head_dim, 4096, theta=1e5).to(device)
    positions = torch.randint(0, 4096, (T,), generator=g).to(device)
    # q and k as views into one fused qkv projection.
    qkv = torch.randn(T, (n_q_heads + 2 * n_kv_heads) * head_dim, generator=g).to(dtype).to(device)
    q = qkv[:, :n_q_heads * head_dim].view(T, n_q_heads, head_dim)
    k = qkv[:, n_q_heads * head_dim:(n_q_heads + n_kv_heads) * head_dim].view(T, n_kv_heads, head_dim)
    q_out, k_out = apply_rope(q, k, positions, cos_sin)
    q_ref, k_ref = apply_rope_ref(q, k, positions, cos_sin)
    torch.testing.assert_close(q_out, q_ref, **tol(dtype))
    torch.testing.assert_close(k_out, k_ref, **tol(dtype))


def test_rope_ref_is_a_rotation_by_position():
    """Independent check of the reference: pairs (x_i, x_{i+Dh/2}) rotate by p * inv_freq_i."""
    head_dim, T = 8, 6
    cos_sin = default_cos_sin(head_dim, 32)
    positions = torch.tensor([0, 1, 5, 31, 2, 7])
    q, k = torch.randn(T, 2, head_dim), torch.randn(T, 1, head_dim)
    q_ref, _ = apply_rope_ref(q, k, positions, cos_sin)
    z = torch.complex(q[..., :4].double(), q[..., 4:].double())
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    z = z * torch.polar(torch.ones(T, 4, dtype=torch.float64), positions[:, None].double() * inv_freq)[:, None, :]
    torch.testing.assert_close(q_ref, torch.cat((z.real, z.imag), -1).float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(q_ref[0], q[0])  # position 0 is the identity
