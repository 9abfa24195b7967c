import pytest
import torch

from gpu.kernels.triton.kv_cache import write_kv, write_kv_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,n_kv_heads,head_dim,page_size", [(13, 2, 64, 16), (5, 3, 128, 8), (1, 1, 64, 32)])
def test_write_kv_matches_ref(T, n_kv_heads, head_dim, page_size, dtype, device):
    g = torch.Generator().manual_seed(T)
    num_blocks = 4
    slots = torch.randperm(num_blocks * page_size, generator=g)[:T]
    if T > 2:
        slots[[1, T - 1]] = -1  # padding rows are skipped
    # k and v as views into one fused qkv projection (non-contiguous token stride).
    qkv = torch.randn(T, (2 + 2 * n_kv_heads) * head_dim, generator=g).to(dtype).to(device)
    k = qkv[:, 2 * head_dim:(2 + n_kv_heads) * head_dim].view(T, n_kv_heads, head_dim)
    v = qkv[:, (2 + n_kv_heads) * head_dim:].view(T, n_kv_heads, head_dim)
    k_cache = torch.randn(num_blocks, page_size, n_kv_heads, head_dim, generator=g).to(dtype).to(device)
    v_cache = torch.randn(num_blocks, page_size, n_kv_heads, head_dim, generator=g).to(dtype).to(device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slots = slots.to(device)

    write_kv(k, v, k_cache, v_cache, slots)
    write_kv_ref(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
