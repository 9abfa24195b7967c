"""Paged attention batches for the kernel tests (moved from tests/kernels/test_paged_attention.py,
which other test modules share)."""
from __future__ import annotations

import itertools
import torch


def _make_batch(q_lens, seq_lens, n_q_heads, n_kv_heads, head_dim, page_size, dtype, device, seed=0):
    """Random paged cache with shuffled, non-contiguous pages per sequence, plus spare pages."""
    g = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-s // page_size) for s in seq_lens]
    num_blocks = sum(pages_per_seq) + 3
    k_cache = torch.randn(num_blocks, page_size, n_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, page_size, n_kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    max_pages = max(pages_per_seq) + 1  # a spare column: tables are wider than needed
    block_tables = torch.full((len(seq_lens), max_pages), 10**6, dtype=torch.int32)  # junk past the end
    used = 0
    for b, n in enumerate(pages_per_seq):
        block_tables[b, :n] = perm[used:used + n].int()
        used += n
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), n_q_heads, head_dim, generator=g).to(dtype)
    to = lambda t: t.to(device)  # noqa: E731
    return (to(q), to(k_cache), to(v_cache), to(block_tables), to(cu),
            to(torch.tensor(seq_lens, dtype=torch.int32)))
