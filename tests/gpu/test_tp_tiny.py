"""Tensor parallelism at TP = 2 over gloo on tiny random safetensors checkpoints, fp32: the
logits of a batch of prompts agree with TP = 1 to 1e-4 and greedy decoding through each rank's
KV cache is token-identical. One spawn of two ranks runs every checkpoint (spawning is the
slow part). Covered: a Llama with one KV head (replicated on both ranks), q/k/v/o biases
(o's added once) and an odd, padded vocabulary; a Qwen3 with q/k norms and tied, padded
embeddings; gpt-oss with sinks, a sliding window of 6 and its experts sharded, both
dequantised and MXFP4-packed."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu import mxfp4
from gpu.loader import load_model
from gpu.parallel import SINGLE, TP
from gpu_testutil import make_hf_model
from tp_testutil import greedy, logits, run_ranks

PROMPTS = [[3, 17, 42, 99, 5, 150, 7, 63, 21, 88, 130, 1], [64, 9, 33, 120, 77, 2, 45, 101, 7, 7]]
NEW_TOKENS = 6
CHECKPOINTS = {  # name: (arch, overrides, experts)
    "llama-kv1-bias": ("llama", dict(num_key_value_heads=1, attention_bias=True, vocab_size=161), "auto"),
    "qwen3-tied": ("qwen3", dict(tie_word_embeddings=True, vocab_size=163), "auto"),
    "gpt-oss": ("gpt_oss", {}, "dequantized"),
    "gpt-oss-mxfp4": ("gpt_oss", dict(intermediate_size=128), "packed"),
}


def _run(tp: TP, jobs):
    out = {}
    for name, path, experts in jobs:
        m = load_model(path, dtype="float32", progress=False, tp=tp, experts=experts).model
        out[name] = (logits(m, PROMPTS), [greedy(m, tp, p, NEW_TOKENS) for p in PROMPTS],
                     (m.local_q_heads, m.local_kv_heads))
    return out


def _quantize_experts(path):
    """The checkpoint's experts as MXFP4 pairs, as openai/gpt-oss-* ship them."""
    weights = load_file(path / "model.safetensors")
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4.quantize(weights.pop(name).transpose(1, 2))   # HF [E, in, out] -> ours
        weights[name + "_blocks"], weights[name + "_scales"] = blocks, scales
    save_file(weights, path / "model.safetensors")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    jobs = []
    for seed, (name, (arch, overrides, experts)) in enumerate(CHECKPOINTS.items()):
        path = tmp_path_factory.mktemp(name)
        make_hf_model(arch, path, seed=seed, **overrides)
        if experts == "packed":
            _quantize_experts(path)
        jobs.append((name, path, experts))
    return _run(SINGLE, jobs), run_ranks(2, _run, jobs)


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_tp2_matches_tp1(results, name):
    single, sharded = results
    (want, want_tokens, heads), (got, got_tokens, local_heads) = single[name], sharded[name]
    assert local_heads == (heads[0] // 2, max(1, heads[1] // 2))
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert got_tokens == want_tokens


def test_indivisible_sizes_name_the_flag(tmp_path):
    make_hf_model("llama", tmp_path)   # 4 query heads, intermediate 96
    with pytest.raises(ValueError, match="num_attention_heads 4 is not divisible by --tensor-parallel-size 3"):
        load_model(tmp_path, dtype="float32", progress=False, tp=TP(rank=0, size=3))
