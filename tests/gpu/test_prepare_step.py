"""Input preparation (gpu/worker/runner.py prepare_step): the persistent block tables give the
same padded tables as copying every table each step, and PLACEHOLDERs are filled in."""
from __future__ import annotations

import random

import numpy as np
import torch

from gpu.interface import PLACEHOLDER, SeqChunk
from gpu.worker.staging import BlockTables, StagedTokens, prepare_step, stage_inputs, upload_inputs

CPU = torch.device("cpu")


def padded(chunks) -> np.ndarray:
    out = np.zeros((len(chunks), max(len(c.block_table) for c in chunks)), dtype=np.int32)
    for i, c in enumerate(chunks):
        out[i, :len(c.block_table)] = c.block_table
    return out


def test_persistent_block_tables_match_a_fresh_copy_every_step():
    rng = random.Random(0)
    tables = {f"s{i}": [rng.randrange(1000) for _ in range(rng.randint(1, 9))] for i in range(12)}
    bt = BlockTables()
    for step in range(200):
        for sid in list(tables):
            if rng.random() < 0.2:                 # a new block
                tables[sid].append(rng.randrange(1000))
            if rng.random() < 0.05:                # preempted: a new, shorter table
                tables[sid] = [rng.randrange(1000) for _ in range(rng.randint(1, 3))]
            if rng.random() < 0.05:                # finished; another sequence arrives
                del tables[sid]
                bt.release(sid)
                tables[f"n{step}{sid}"] = [rng.randrange(1000) for _ in range(rng.randint(1, 40))]
        some = rng.sample(sorted(tables), rng.randint(1, len(tables)))   # not every one each step
        chunks = tuple(SeqChunk(sid, (1,), len(tables[sid]) * 4 - 1, tuple(tables[sid]), True)
                       for sid in some)
        _, _, meta, _ = prepare_step(chunks, 4, CPU, block_tables=bt)
        assert np.array_equal(meta.block_tables.numpy(), padded(chunks)), step
    assert set(bt.row_of) <= set(tables)          # released rows are given back


def test_placeholders_take_the_last_sampled_token():
    chunks = (SeqChunk("a", (5, 6, 7), 0, (0,), True),
              SeqChunk("b", (PLACEHOLDER,), 9, (1, 2, 3), True),
              SeqChunk("c", (3, PLACEHOLDER), 4, (4, 5), True))
    last = {"b": 42, "c": 43}
    input_ids, positions, meta, sample_idx = prepare_step(chunks, 4, CPU, last_token=last.__getitem__)
    assert input_ids.tolist() == [5, 6, 7, 42, 3, 43]
    assert positions.tolist() == [0, 1, 2, 9, 4, 5]
    assert sample_idx.tolist() == [2, 3, 5]


def test_staged_ahead_placeholders_come_from_the_previous_steps_tokens():
    """The GPU stage stages step N+1's inputs while step N runs; its PLACEHOLDERs are
    then filled from step N's sampled tokens by position (one gather), and equal what
    the per-sequence lookup gives. When step N did not run (it failed), the lookup fills
    them instead."""
    tokens = StagedTokens()
    bt = BlockTables()
    step1 = (SeqChunk("a", (5, 6), 0, (0,), True), SeqChunk("b", (7,), 0, (1,), False),
             SeqChunk("c", (8,), 0, (2,), True))
    host1 = stage_inputs(step1, 4, bt)
    tokens.stage(1, host1)
    step2 = (SeqChunk("c", (PLACEHOLDER,), 1, (2,), True), SeqChunk("b", (9,), 1, (1,), True),
             SeqChunk("a", (PLACEHOLDER,), 2, (0,), True))
    host2 = stage_inputs(step2, 4, bt)      # staged before step 1 has run
    tokens.stage(2, host2)
    assert host2.fill_src.tolist() == [1, 0] and host2.fill_step == 1

    def never(seq_id):
        raise AssertionError("the per-sequence lookup ran")

    tokens.executed(1, [100, 101])          # step 1 sampled a -> 100, c -> 101
    ids, _, _, _ = upload_inputs(host2, CPU, last_token=never, previous=tokens.previous(host2))
    assert ids.tolist() == [101, 9, 100]

    # step 2 failed (nothing executed): step 3's placeholders fall back to the lookup
    step3 = (SeqChunk("a", (PLACEHOLDER,), 3, (0,), True),)
    host3 = stage_inputs(step3, 4, bt)
    tokens.stage(3, host3)
    assert tokens.previous(host3) is None
    ids, _, _, _ = upload_inputs(host3, CPU, last_token={"a": 55}.__getitem__,
                                 previous=tokens.previous(host3))
    assert ids.tolist() == [55]
