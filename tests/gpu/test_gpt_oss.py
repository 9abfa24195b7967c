"""gpt-oss: logits parity with transformers' GptOssForCausalLM on tiny random checkpoints (plain
and MXFP4 experts), through the dense and the paged attention paths (chunked prefill, decode,
a prefix-cache hit), and the config of the real model. (The engine serving a gpt-oss
checkpoint: tests/engine/test_engine_gpt_oss.py.)"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import gpu
from gpu.models.registry import config_from_hf
from gpu.quantization import mxfp4
from gpu.layers.attention import KVCache
from gpu.config.model import ModelConfig
from gpu.loader.decoder import load_model
from gpu.interface import SamplingOptions, SeqChunk, SeqStart, StepPlan
from gpu.worker.runner import ModelRunner
from tests.support.hf_models import hf_logits, make_hf_model, our_logits

IDS = [3, 17, 42, 99, 5, 150, 7, 63, 21, 88, 130, 1, 64, 9, 33, 120, 77, 2, 45, 101] * 2  # 40 tokens
CONFIGS = Path(gpu.__file__).parent / "configs"


def _load(path, **kw):
    return load_model(path, dtype="float32", progress=False, **kw)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """One tiny random gpt-oss checkpoint (sliding window 6, 3 layers) and its HF model."""
    path = tmp_path_factory.mktemp("gpt_oss")
    return make_hf_model("gpt_oss", path), path


def test_logits_match_transformers(hf_dir):
    hf, path = hf_dir
    loaded = _load(path)
    c = loaded.config
    assert (c.architecture, c.num_experts, c.num_experts_per_tok, c.attention_sinks) == ("gpt_oss", 4, 2, True)
    assert [c.layer_window(i) for i in range(3)] == [6, None, 6]
    expected = hf_logits(hf, IDS)
    torch.testing.assert_close(our_logits(loaded.model, IDS), expected, atol=1e-4, rtol=1e-4)


def test_each_gpt_oss_feature_shows_in_the_logits(hf_dir):
    """Negative controls: without the window, or without the sinks, the logits differ from
    transformers' beyond the window (so the parity above checks them)."""
    hf, path = hf_dir
    expected = hf_logits(hf, IDS)
    model = _load(path).model
    for layer in model.layers:
        layer.self_attn.window = None
    assert not torch.allclose(our_logits(model, IDS)[6:], expected[6:], atol=1e-3)
    assert torch.allclose(our_logits(model, IDS)[:6], expected[:6], atol=1e-4)  # inside the window: same
    model = _load(path).model
    for layer in model.layers:
        layer.self_attn.sinks = None
    assert not torch.allclose(our_logits(model, IDS), expected, atol=1e-3)


def test_clamped_swiglu_matches_transformers(tmp_path):
    """Experts scaled up so gate and up cross the +-7 clamp."""
    hf = make_hf_model("gpt_oss", seed=1)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(12.0)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    x = torch.randn(8, 64)
    gate_up = x @ hf.model.layers[0].mlp.experts.gate_up_proj[0]
    assert (gate_up.abs() > 7).any()
    torch.testing.assert_close(our_logits(_load(tmp_path).model, IDS), hf_logits(hf, IDS), atol=1e-4, rtol=1e-4)


def _quantize_experts(path: Path, hf) -> None:
    """Rewrite the checkpoint's experts as MXFP4 (NAME_blocks / NAME_scales, [E, out, in/32, 16]),
    as openai/gpt-oss-* ship them, and put the rounded values back into the HF model."""
    weights = load_file(path / "model.safetensors")
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = weights.pop(name).transpose(1, 2)                       # HF [E, in, out] -> [E, out, in]
        blocks, scales = mxfp4.quantize(w)
        weights[name + "_blocks"], weights[name + "_scales"] = blocks, scales
        rounded = mxfp4.dequantize(blocks, scales, torch.float32).transpose(1, 2)
        with torch.no_grad():
            hf.get_parameter(name).copy_(rounded)
    save_file(weights, path / "model.safetensors")


def test_mxfp4_checkpoint_matches_transformers_on_the_dequantised_weights(tmp_path):
    hf = make_hf_model("gpt_oss", tmp_path, seed=2)
    _quantize_experts(tmp_path, hf)
    names = load_file(tmp_path / "model.safetensors").keys()
    assert "model.layers.0.mlp.experts.down_proj_scales" in names
    assert "model.layers.0.mlp.experts.down_proj" not in names
    torch.testing.assert_close(our_logits(_load(tmp_path).model, IDS), hf_logits(hf, IDS), atol=1e-4, rtol=1e-4)


def test_mxfp4_half_pair_is_an_error(tmp_path):
    hf = make_hf_model("gpt_oss", tmp_path, seed=2)
    _quantize_experts(tmp_path, hf)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.experts.gate_up_proj_scales"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="gate_up_proj_blocks' but not .*gate_up_proj_scales"):
        _load(tmp_path)


def _capture_logits(lm, runner, plans):
    seen = []
    orig = lm.compute_logits
    lm.compute_logits = lambda h: seen.append(orig(h)) or seen[-1]
    try:
        for plan in plans:
            runner.execute(plan)
    finally:
        lm.compute_logits = orig
    return torch.cat(seen)


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
def test_paged_prefill_decode_and_prefix_hit_match_transformers(hf_dir, use_triton):
    """Through the runner and the paged KV cache (block size 4, window 6): sequence a is
    prefilled in two chunks then decoded step by step; sequence b shares a's first two blocks
    (a prefix-cache hit: 8 tokens it never computes) and then diverges. Every sampled row
    equals transformers' logits for that position of a cold, full-sequence run."""
    hf, path = hf_dir
    lm = _load(path).model
    c = lm.config
    cache = KVCache(c.num_hidden_layers, 24, 4, c.num_key_value_heads, c.head_dim, torch.float32, "cpu")
    runner = ModelRunner(lm, cache, device=torch.device("cpu"), use_triton=use_triton)
    a = IDS[:27]
    b = IDS[:8] + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]    # 21 tokens
    table_a, table_b = (9, 2, 7, 0, 11, 4, 5), (9, 2, 13, 17, 20, 21)
    greedy = SamplingOptions(temperature=0.0)
    plans = [
        StepPlan(1, (SeqChunk("a", tuple(a[:10]), 0, table_a[:3], False),),
                 (SeqStart("a", tuple(a), greedy),)),
        StepPlan(2, (SeqChunk("a", tuple(a[10:19]), 10, table_a[:5], True),
                     SeqChunk("b", tuple(b[8:17]), 8, table_b[:5], True)),       # b: prefix hit
                 (SeqStart("b", tuple(b), greedy),)),
        *(StepPlan(3 + i, (SeqChunk("a", (a[19 + i],), 19 + i, table_a, True),
                           SeqChunk("b", (b[17 + i],), 17 + i, table_b, True))) for i in range(3)),
    ]
    got = _capture_logits(lm, runner, plans)                                   # [2 + 2 * 3, V]
    want_a, want_b = hf_logits(hf, a), hf_logits(hf, b)
    decodes = [row for i in range(3) for row in (want_a[19 + i], want_b[17 + i])]
    expected = torch.stack([want_a[18], want_b[16], *decodes])
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)


def test_real_gpt_oss_20b_config():
    d = json.loads((CONFIGS / "gpt-oss-20b/config.json").read_text())
    c = config_from_hf(d)
    assert (c.architecture, c.hidden_size, c.num_hidden_layers, c.num_experts, c.num_experts_per_tok) == (
        "gpt_oss", 2880, 24, 32, 4)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (64, 8, 64, 201088)
    assert c.layer_types[:2] == ("sliding_attention", "full_attention") and c.sliding_window == 128
    assert [c.layer_window(i) for i in (0, 1, 22, 23)] == [128, None, 128, None]
    s = c.rope_scaling_dict
    assert (s["rope_type"], s["factor"], s["original_max_position_embeddings"], s["truncate"]) == (
        "yarn", 32.0, 4096, False)
    assert c.rope_theta == 150000.0 and c.attention_bias and c.o_proj_bias and c.attention_sinks
    # The same without optional keys: transformers' GptOssConfig defaults apply.
    bare = {k: v for k, v in d.items() if k not in ("layer_types", "rope_scaling", "rope_theta")}
    assert config_from_hf(bare) == c


def test_rope_cache_matches_transformers_yarn():
    from gpu.layers.ops import build_rope_cache

    hf = make_hf_model("gpt_oss")
    cos, sin = hf.model.rotary_emb(torch.zeros(1, 300, 8), torch.arange(300)[None])  # [1, P, Dh/2]
    cache = build_rope_cache(config_from_hf(hf.config.to_dict()), 300, "cpu")
    torch.testing.assert_close(cache[:, :8], cos[0], atol=6e-5, rtol=0)
    torch.testing.assert_close(cache[:, 8:], sin[0], atol=6e-5, rtol=0)


def test_config_errors():
    base = dict(model_type="gpt_oss", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=2,
                num_attention_heads=2, num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="num_experts_per_tok must be in 1..4"):
        config_from_hf({**base, "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match="layer_types has 1 entries for 2 layers"):
        config_from_hf({**base, "layer_types": ["full_attention"]})
    with pytest.raises(ValueError, match="unsupported layer_types"):
        config_from_hf({**base, "layer_types": ["full_attention", "chunked_attention"]})
    with pytest.raises(ValueError, match="positive sliding_window"):
        config_from_hf({**base, "sliding_window": None})


def test_tiny_dummy_config_builds_quickly_with_the_harmony_vocabulary():
    """gpu/configs/gpt-oss-tiny: the o200k Harmony vocabulary (201088) over a 64-wide, 2-layer
    model, for end-to-end tests; its EOS ids are Harmony's <|return|>, <|endoftext|>, <|call|>."""
    loaded = load_model(CONFIGS / "gpt-oss-tiny", load_format="dummy", dtype="float32", progress=False)
    c = loaded.config
    assert (c.architecture, c.vocab_size, c.hidden_size, c.num_hidden_layers) == ("gpt_oss", 201088, 64, 2)
    assert loaded.eos_token_ids == (200002, 199999, 200012) and loaded.tokenizer is None
    logits = our_logits(loaded.model, [200006, 1428, 200008, 13225])
    assert logits.shape == (4, 201088) and torch.isfinite(logits).all()


def test_simulated_cost_counts_held_and_active_experts():
    """--simulate-gpu: every expert is held in memory, a token runs top-k of them. OpenAI gives
    gpt-oss-20b 21B parameters, 3.6B active per token, and gpt-oss-120b 117B and 5.1B."""
    from gpu.worker.simulate import GPUS, CostModel

    d = json.loads((CONFIGS / "gpt-oss-20b/config.json").read_text())
    big = {**d, "num_hidden_layers": 36, "num_local_experts": 128}
    del big["layer_types"]
    for config, total, active in ((d, 21e9, 3.6e9), (big, 117e9, 5.1e9)):
        cost = CostModel.of(config_from_hf(config), GPUS["h200"])
        embed = cost.vocab_size * 2880                                   # not a matmul
        assert cost.matmul_params + embed == pytest.approx(total, rel=0.02)
        assert cost.active_params == pytest.approx(active, rel=0.03)
        one, many = cost.step_seconds([1], [100], 1), cost.step_seconds([1] * 64, [100] * 64, 64)
        assert one < many < 64 * one       # one token reads 4 experts a layer; 64 tokens read all 32
