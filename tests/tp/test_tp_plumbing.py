"""Tensor parallelism's plumbing without processes: the per-step message round-trips
exactly, the logits calls a worker makes are rank 0's, the flags validate, and the
rendezvous reads MASTER_ADDR/MASTER_PORT, WORLD_SIZE, RANK and LOCAL_WORLD_SIZE."""
from __future__ import annotations

import argparse

import attrs
import numpy as np
import pytest

from gpu.interface import PLACEHOLDER, SamplingOptions, SeqChunk, StepPlan
from gpu.worker.runner import PROMPT_LOGPROB_ROWS
from gpu.worker.staging import BlockTables, stage_inputs, upload_inputs
from gpu.worker.tp import HEADER, STEP, logit_calls, pack, unpack
from pipeline.core.config import EngineConfig, add_engine_arguments, engine_config
from pipeline.layouts.tp_procs import rendezvous, worker_flags


def _chunks(drafts: int = 0):
    return (SeqChunk("a", (5, 6, 7, 8, 9), 0, (3, 4), True),
            SeqChunk("b", (11, PLACEHOLDER), 20, (7, 8, 9), True, num_drafts=drafts),
            SeqChunk("c", (1, 2, 3), 16, (2, 5), False))


@pytest.mark.parametrize("drafts", [0, 1])
def test_a_step_round_trips_to_the_arrays_and_metadata_rank_0_uploaded(drafts):
    host = stage_inputs(_chunks(drafts), 16, BlockTables())
    ids, pos, meta, sample_idx = upload_inputs(host, __import__("torch").device("cpu"),
                                               last_token=lambda seq: 42)
    kv, spans = ((3, 1), (4, -1)), [(0, 4), (5, 6)]
    header, payload = pack(host, kv, spans, True, 17)
    assert header.shape == (HEADER,) and header[0] == STEP and header[9] == 17
    assert payload.size == header[10]
    got, got_kv, got_spans, sample, states = unpack(header, payload)
    assert got_kv == kv and got_spans == spans and sample and states == []
    ids2, pos2, meta2, sample_idx2 = upload_inputs(got, __import__("torch").device("cpu"))
    assert ids2.tolist() == ids.tolist() and 42 in ids2.tolist()      # the PLACEHOLDER filled
    assert pos2.tolist() == pos.tolist() and sample_idx2.tolist() == sample_idx.tolist()
    for name in ("slot_mapping", "block_tables", "cu_seqlens_q", "seq_lens"):
        a, b = getattr(meta, name), getattr(meta2, name)
        assert a.dtype == b.dtype and a.tolist() == b.tolist(), name
    for name in ("q_starts", "q_lens", "ctx_lens", "start_positions", "decode_rows",
                 "prefill_rows", "max_seqlen_q"):
        assert getattr(meta, name) == getattr(meta2, name), name


def test_a_hybrid_models_state_slots_travel_with_the_step():
    """(state_slot, state_load, state_save) per chunk, in the step's order: each worker's
    StatePool loads, steps and saves the same slots as rank 0's."""
    chunks = tuple(attrs.evolve(c, state_slot=i + 1, state_load=7 if i == 1 else -1,
                                state_save=9 if i == 2 else -1) for i, c in enumerate(_chunks()))
    host = stage_inputs(chunks, 16, BlockTables())
    upload_inputs(host, __import__("torch").device("cpu"), last_token=lambda seq: 42)
    flat = [x for c in chunks for x in (c.state_slot, c.state_load, c.state_save)]
    header, payload = pack(host, (), [(0, 4)], False, 3, flat)
    got, _, spans, _, states = unpack(header, payload)
    assert spans == [(0, 4)] and got.q_lens == host.q_lens
    assert [(s.state_slot, s.state_load, s.state_save) for s in states] == [(1, -1, -1), (2, 7, -1), (3, -1, 9)]


def test_the_worker_calls_compute_logits_on_the_rows_rank_0_does(smollm):
    """Rank 0's prompt logprobs (gpu/worker/runner.py) call compute_logits on pieces of each span;
    logit_calls must list those pieces in the same order."""
    import torch

    from gpu.worker.runner import compute_prompt_logprobs

    seen = []

    class Recording:
        def compute_logits(self, rows):
            seen.append(rows[:, 0].tolist())
            return smollm.model.compute_logits(rows)

    n = PROMPT_LOGPROB_ROWS + 5
    hidden = torch.arange(n + 3, dtype=torch.float32)[:, None].repeat(1, smollm.config.hidden_size)
    spans = [(0, n), (n, n + 3)]
    for a, b in spans:
        compute_prompt_logprobs(Recording(), hidden[a:b], tuple(range(b - a)), 0)
    assert [hidden[a:b, 0].tolist() for a, b in logit_calls(spans)] == seen
    assert len(seen) == 3


def _parse(*argv):
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    return p.parse_args(list(argv))


def test_flag_and_validation():
    assert engine_config(_parse("-tp", "3")).tensor_parallel_size == 3
    assert engine_config(_parse("--tensor-parallel-size", "2")).tensor_parallel_size == 2
    with pytest.raises(ValueError, match="--tensor-parallel-size must be at least 1, got 0"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="does not combine with --simulate-gpu"):
        EngineConfig(tensor_parallel_size=2, simulate_gpu="h200")


@pytest.mark.parametrize("prefix", [None, True, False])
def test_worker_flags_rebuild_the_fields_a_worker_needs(prefix):
    """--enable-prefix-caching too, as given or left to the model (None): it sizes a hybrid
    model's state pool on every rank."""
    cfg = EngineConfig(model="/m.gguf", dtype="float32", max_model_len=256, enforce_eager=True,
                       tensor_parallel_size=2, num_gpu_blocks_override=9, max_num_seqs=3,
                       enable_prefix_caching=prefix)
    back = engine_config(_parse(*worker_flags(cfg)))
    for name in ("model", "dtype", "max_model_len", "enforce_eager", "tensor_parallel_size",
                 "num_gpu_blocks_override", "max_num_seqs", "block_size", "seed", "enable_prefix_caching"):
        assert getattr(back, name) == getattr(cfg, name), name


def test_rendezvous_reads_torchrun_style_environment():
    local = rendezvous(3, {})
    assert local.init_method.startswith("tcp://127.0.0.1:") and local.local_ranks == (1, 2)
    multi = rendezvous(4, {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
                           "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"})
    assert multi.init_method == "tcp://10.0.0.1:29500" and multi.local_ranks == (1,)
    with pytest.raises(ValueError, match="WORLD_SIZE=2 but --tensor-parallel-size 4"):
        rendezvous(4, {"WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="tailrace serve is rank 0"):
        rendezvous(2, {"RANK": "1"})
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=5"):
        rendezvous(2, {"LOCAL_WORLD_SIZE": "5"})
