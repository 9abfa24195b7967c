"""Tensor parallelism at TP = 2 for the MoE families (gpu/layers/moe.py: each expert's
intermediate dimension split, the router replicated): logits of a batch of prompts agree
with TP = 1 to 1e-4, and greedy decoding through a dense and a paged KV cache (chunked
prefill, mixed batches) is token-identical. One spawn of two ranks runs every checkpoint:
a Qwen3-MoE with a dense layer and experts of intermediate 31 (rank 1's slice padded), a
Qwen2-MoE with a gated shared expert, a Mixtral, a GLM-4.5 (partial rotary, grouped sigmoid
routing with its correction bias replicated, a shared expert), a Llama 4 (no-RoPE layer, top-1
sigmoid on the input, a shared expert), a DeepSeek-V3 (latent attention: its heads split, the
latent cache replicated; grouped sigmoid routing, a shared expert, a dense first layer)."""
import pytest
import torch

from gpu.loader.decoder import load_model
from gpu.parallel import SINGLE, TP
from tests.support.moe_models import make_moe_model
from tests.support.tp_ranks import greedy, logits, paged_greedy, run_ranks

PROMPTS = [[3, 17, 42, 99, 5, 150, 7, 63, 21, 88, 130, 1], [64, 9, 33, 120, 77, 2, 45, 101, 7, 7]]
NEW_TOKENS = 6
# layer 1 is a mixture in each (qwen3_moe: layers 0 and 2 instead of its default dense layer 1)
CHECKPOINTS = {"qwen3_moe": dict(moe_intermediate_size=31, mlp_only_layers=[0]), "qwen2_moe": {}, "mixtral": {},
               "glm4_moe": {}, "llama4": {}, "deepseek_v3": {}}


def _run(tp: TP, jobs):
    out = {}
    for name, path in jobs:
        m = load_model(path, dtype="float32", progress=False, tp=tp).model
        out[name] = (logits(m, PROMPTS), [greedy(m, tp, p, NEW_TOKENS) for p in PROMPTS],
                     paged_greedy(m, tp, PROMPTS, NEW_TOKENS), tuple(m.layers[1].mlp.experts.down_proj.shape))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    jobs = []
    for seed, (kind, overrides) in enumerate(CHECKPOINTS.items()):
        path = tmp_path_factory.mktemp(kind)
        make_moe_model(kind, path, seed=seed, **overrides)
        jobs.append((kind, path))
    return _run(SINGLE, jobs), run_ranks(2, _run, jobs)


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_tp2_matches_tp1(results, name):
    single, sharded = results
    (want, want_tokens, want_paged, whole), (got, got_tokens, got_paged, half) = single[name], sharded[name]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert got_tokens == want_tokens
    assert got_paged == want_paged == want_tokens
    assert half[:2] == whole[:2] and half[2] == -(-whole[2] // 2)      # each expert's columns halved
