"""Tensor parallelism at TP = 2 over gloo on tiny random safetensors checkpoints, fp32: the
logits of a batch of prompts agree with TP = 1 to 1e-4, and greedy decoding through each rank's
KV cache (a dense one, and the paged cache with chunked prefill and mixed batches) is
token-identical. One spawn of two ranks runs every checkpoint (spawning is the
slow part). Covered: a Llama with one KV head (replicated on both ranks), q/k/v/o biases
(o's added once) and an odd, padded vocabulary; a Qwen3 with q/k norms and tied, padded
embeddings; gpt-oss with sinks, a sliding window of 6 and its experts sharded, both
dequantised and MXFP4-packed, with padded slices; gpu/configs/gpt-oss-tiny's dummy weights (the 201k Harmony
vocabulary), which every rank draws as a single process would and cuts."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import gpu
from gpu.quantization import mxfp4
from gpu.loader.decoder import load_model
from gpu.parallel import SINGLE, TP
from tests.support.hf_models import make_hf_model
from tests.support.tp_ranks import greedy, logits, paged_greedy, run_ranks

PROMPTS = [[3, 17, 42, 99, 5, 150, 7, 63, 21, 88, 130, 1], [64, 9, 33, 120, 77, 2, 45, 101, 7, 7]]
NEW_TOKENS = 6
CHECKPOINTS = {  # name: (arch, overrides, experts)
    "llama-kv1-bias": ("llama", dict(num_key_value_heads=1, attention_bias=True, vocab_size=161), "auto"),
    "qwen3-tied": ("qwen3", dict(tie_word_embeddings=True, vocab_size=163), "auto"),
    # experts' intermediate 95 and 96: slices of 48 and, packed, 64 (whole scale groups), the
    # last rank's padded with zero columns
    "gpt-oss": ("gpt_oss", dict(intermediate_size=95), "dequantized"),
    "gpt-oss-mxfp4": ("gpt_oss", {}, "packed"),
    "gpt-oss-tiny-dummy": (None, {}, "auto"),
}
TINY_CONFIG = Path(gpu.__file__).parent / "configs" / "gpt-oss-tiny"


def _run(tp: TP, jobs):
    out = {}
    for name, path, experts in jobs:
        fmt = "dummy" if path == TINY_CONFIG else "auto"
        m = load_model(path, dtype="float32", progress=False, tp=tp, experts=experts, load_format=fmt).model
        out[name] = (logits(m, PROMPTS), [greedy(m, tp, p, NEW_TOKENS) for p in PROMPTS],
                     (m.local_q_heads, m.local_kv_heads), paged_greedy(m, tp, PROMPTS, NEW_TOKENS))
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
        if arch is None:
            jobs.append((name, TINY_CONFIG, experts))
            continue
        path = tmp_path_factory.mktemp(name)
        make_hf_model(arch, path, seed=seed, **overrides)
        if experts == "packed":
            _quantize_experts(path)
        jobs.append((name, path, experts))
    return _run(SINGLE, jobs), run_ranks(2, _run, jobs)


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_tp2_matches_tp1(results, name):
    single, sharded = results
    (want, want_tokens, heads, want_paged), (got, got_tokens, local_heads, got_paged) = single[name], sharded[name]
    assert local_heads == (heads[0] // 2, max(1, heads[1] // 2))
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert got_tokens == want_tokens
    assert got_paged == want_paged == want_tokens  # chunked, batched, paged: the same tokens


def test_indivisible_sizes_name_the_flag(tmp_path):
    make_hf_model("llama", tmp_path)   # 4 query heads, intermediate 96
    with pytest.raises(ValueError, match="num_attention_heads 4 is not divisible by --tensor-parallel-size 3"):
        load_model(tmp_path, dtype="float32", progress=False, tp=TP(rank=0, size=3))


def test_kv_heads_replicated_below_the_size():
    """8 query heads over 2 KV heads at TP 4: ranks 0-1 read KV head 0, ranks 2-3 head 1 (the
    head their query heads 0-1, 2-3 | 4-5, 6-7 belong to); at TP 2 one each; 3 KV heads at
    TP 2 do not divide."""
    from gpu.config.model import ModelConfig
    from gpu.models.causal_lm import kv_heads, q_heads

    c = ModelConfig(architecture="llama", vocab_size=10, hidden_size=64, intermediate_size=64,
                    num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                    rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=16)
    assert [kv_heads(c, TP(r, 4)) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [q_heads(c, TP(r, 4)) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [kv_heads(c, TP(r, 2)) for r in range(2)] == [(0, 1), (1, 2)]
    with pytest.raises(ValueError, match="num_key_value_heads 2 does not divide --tensor-parallel-size 3"):
        kv_heads(c, TP(0, 3))


def test_rank_loads_its_shard_read_in_part(tmp_path, monkeypatch):
    """Loading needs no collective, so one process can play rank 1 of 2: its parameters are
    TP 1's cut by heads, rows, columns and vocabulary, and safetensors hand it the dense
    tensors already cut (get_slice), never whole."""
    from gpu.formats import hf as weights_hf

    make_hf_model("llama", tmp_path, num_key_value_heads=2, attention_bias=True, vocab_size=161)
    arrived = {}
    read = weights_hf.named_tensors

    def recording(files, select=None):
        for name, t in read(files, select):
            arrived[name] = tuple(t.shape)
            yield name, t
    monkeypatch.setattr(weights_hf, "named_tensors", recording)
    full = load_model(tmp_path, dtype="float32", progress=False).model.state_dict()
    whole = dict(arrived)
    rank1 = load_model(tmp_path, dtype="float32", progress=False, tp=TP(rank=1, size=2)).model.state_dict()
    layer = "layers.0.self_attn."
    q, k = full[layer + "qkv_proj.weight"].split([64, 32, 32])[:2]     # 4 q heads, 2 KV heads of 16
    assert torch.equal(rank1[layer + "qkv_proj.weight"][:32], q[32:])   # q heads 2-3
    assert torch.equal(rank1[layer + "qkv_proj.weight"][32:48], k[16:])  # KV head 1
    assert torch.equal(rank1[layer + "o_proj.weight"], full[layer + "o_proj.weight"][:, 32:])
    assert not rank1[layer + "o_proj.bias"].any()                       # rank 0 adds it
    assert torch.equal(rank1["layers.1.mlp.down_proj.weight"], full["layers.1.mlp.down_proj.weight"][:, 48:])
    assert torch.equal(rank1["embed_tokens.weight"][:80], full["embed_tokens.weight"][81:])  # rows 81-160
    assert not rank1["embed_tokens.weight"][80:].any()                  # padding to 162
    assert arrived["model.layers.0.self_attn.q_proj.weight"] == (32, 64)
    assert arrived["model.layers.0.mlp.down_proj.weight"] == (64, 48)
    assert arrived["lm_head.weight"] == (80, 64) and whole["lm_head.weight"] == (161, 64)
