"""LoRA shrink/expand Triton kernels (gpu/kernels/triton/lora.py) against the torch reference,
under the interpreter on CPU: uneven groups of rows per adapter, rows without an adapter,
ranks padded to the largest."""
import pytest
import torch

from gpu.kernels.triton.lora import lora_expand, lora_ref, lora_shrink


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T,K,N,R,idx", [
    (7, 64, 96, 16, [0, 0, -1, 2, 1, 1, 1]),       # uneven groups, one base row
    (5, 40, 24, 8, [-1, -1, -1, -1, -1]),           # no adapter at all: out untouched
    (3, 130, 150, 24, [1, -1, 1]),                  # K, N past a block; R not a power of 2
])
def test_shrink_expand_match_the_reference(T, K, N, R, idx, dtype, device, tol):
    g = torch.Generator().manual_seed(T * K)
    L = 3
    x = torch.randn(T, K, generator=g).to(dtype).to(device)
    a = (torch.randn(L, R, K, generator=g) / K ** 0.5).to(dtype).to(device)
    b = torch.randn(L, N, R, generator=g).to(dtype).to(device)
    a[2, R // 2:] = 0     # adapter 2 has a smaller rank, padded with zeros
    b[2, :, R // 2:] = 0
    out = torch.randn(T, N, generator=g).to(dtype).to(device)
    index = torch.tensor(idx, dtype=torch.int32, device=device)
    want = lora_ref(x, a, b, index, out)
    got = lora_expand(lora_shrink(x, a, index), b, index, out.clone())
    torch.testing.assert_close(got, want, **tol(dtype))
    base = [t for t, i in enumerate(idx) if i < 0]
    assert torch.equal(got[base], out[base])


def test_ranks_bound_what_is_read(device):
    """Slots of rank R holding smaller adapters (gpu/lora/adapters.py's _Slots): with `ranks`, rows of
    A / columns of B past a slot's rank are never read (garbage there changes nothing), and a
    slot of rank 0 adds nothing."""
    g = torch.Generator().manual_seed(3)
    T, K, N, R, L = 6, 48, 40, 16, 3
    x = torch.randn(T, K, generator=g).to(device)
    a = torch.randn(L, R, K, generator=g).to(device)
    b = torch.randn(L, N, R, generator=g).to(device)
    ranks = torch.tensor([16, 5, 0], dtype=torch.int32, device=device)
    clean_a, clean_b = a.clone(), b.clone()
    for s, r in enumerate(ranks.tolist()):
        clean_a[s, r:] = 0
        clean_b[s, :, r:] = 0
    out = torch.randn(T, N, generator=g).to(device)
    index = torch.tensor([1, 0, -1, 2, 1, 1], dtype=torch.int32, device=device)
    got = lora_expand(lora_shrink(x, a, index, ranks), b, index, out.clone(), ranks)
    torch.testing.assert_close(got, lora_ref(x, clean_a, clean_b, index, out), atol=1e-4, rtol=1e-4)
    assert torch.equal(got[[2, 3]], out[[2, 3]])
