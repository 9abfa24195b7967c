"""Staged arrays start on 16-byte boundaries whatever the step's sizes (Triton specialises
pointers on 16-byte alignment: a new alignment would be a compile in the middle of a run)."""
from __future__ import annotations

import numpy as np
import torch

from gpu.interface import SeqChunk
from gpu.worker.staging import Staging, staged_offsets, stage_inputs, upload_inputs


def test_offsets_are_padded_to_16_bytes():
    assert staged_offsets([3, 5, 1], 8) == ([0, 4, 10], 12)
    assert staged_offsets([3, 5, 1], 4) == ([0, 4, 12], 16)
    assert staged_offsets([4, 4], 4) == ([0, 4], 8)           # aligned sizes: no padding


def test_staged_tensors_are_16_byte_aligned_and_exact():
    staging = Staging(torch.device("cpu"))
    for n in (1, 3, 7, 17):          # odd batches: unpadded, the later arrays would straddle
        chunks = tuple(SeqChunk(f"s{i}", (5,) * (1 + i % 3), 2 * i, tuple(range(3 * i, 3 * i + 3)), True)
                       for i in range(n))
        host = stage_inputs(chunks, 16)
        want = [a.copy() for a in host.arrays]
        ids, pos, meta, _ = upload_inputs(host, torch.device("cpu"), staging)
        got = [ids, pos, meta.slot_mapping, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens]
        for w, g in zip(want, got):
            assert g.data_ptr() % 16 == 0
            np.testing.assert_array_equal(g.numpy(), w)
