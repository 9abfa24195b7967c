"""Tensor parallelism at TP = 2 for the hybrid linear-attention families (gpu/models/hybrid.py):
the Gated DeltaNet key and value heads (their conv channels, gates and states) and the gated
attention's heads split over the ranks, each rank's StatePool holding its heads' states, the
MLPs' and experts' intermediate columns split, the vocabulary split. Logits of a batch of
prompts agree with TP = 1 to 1e-4, and greedy decoding through the paged KV cache and the
state pool (prefill in chunks of 5, so every prompt's states carry across chunks; decode rows
mixed with the other prompt's prefill) is token-identical to TP = 1 and to one whole-prompt
prefill. One spawn of two ranks runs every checkpoint: a dense Qwen3-Next (in_proj_qkvz
grouped by key head), a Qwen3-Next with experts of an odd width and a gated shared expert, a
Qwen3.5 (its projections apart) and a Qwen3.5-MoE with an odd vocabulary. The second and the
third have one KV head: TP above num_key_value_heads, each rank keeps the whole KV head (its
K/V computed on both) with half the query heads."""
import pytest
import torch

from gpu.loader.decoder import load_model
from gpu.parallel import SINGLE, TP
from tests.support.hybrid_models import TINY_EXPERTS, make_hybrid
from tests.support.tp_ranks import logits, paged_greedy, run_ranks

PROMPTS = [[3, 17, 42, 99, 5, 150, 7, 63, 21, 88, 130, 1], [64, 9, 33, 120, 77, 2, 45, 101, 7, 7]]
NEW_TOKENS = 6
# experts of intermediate 31 (rank 1's slice padded), a vocabulary of 161 (rank 1's last row
# padding); one KV head of 4 query heads (replicated over the ranks) in the second and third
CHECKPOINTS = {"qwen3_next": ("qwen3_next", {}),
               "qwen3_next_moe": ("qwen3_next", dict(TINY_EXPERTS, moe_intermediate_size=31, num_key_value_heads=1)),
               "qwen3_5": ("qwen3_5", dict(num_key_value_heads=1)),
               "qwen3_5_moe": ("qwen3_5_moe", dict(vocab_size=161))}


def _run(tp: TP, jobs):
    out = {}
    for name, path in jobs:
        m = load_model(path, dtype="float32", progress=False, tp=tp).model
        heads = (m.layers[0].linear_attn.dims.value_heads, m.local_kv_heads)
        out[name] = (logits(m, PROMPTS), paged_greedy(m, tp, PROMPTS, NEW_TOKENS),
                     paged_greedy(m, tp, PROMPTS, NEW_TOKENS, chunk=64), heads)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    jobs = []
    for seed, (name, (family, overrides)) in enumerate(CHECKPOINTS.items()):
        path = tmp_path_factory.mktemp(name)
        make_hybrid(family, path, seed=seed, **overrides)
        jobs.append((name, path))
    return _run(SINGLE, jobs), run_ranks(2, _run, jobs)


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_tp2_matches_tp1(results, name):
    single, sharded = results
    (want, want_chunked, want_whole, heads), (got, got_chunked, got_whole, half) = single[name], sharded[name]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert got_chunked == want_chunked == want_whole == got_whole
    # each rank: half the value heads, half the KV heads (a lone one whole)
    assert half == (heads[0] // 2, max(1, heads[1] // 2))
    assert heads[1] == CHECKPOINTS[name][1].get("num_key_value_heads", 2)
