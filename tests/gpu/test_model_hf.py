"""Logits parity with transformers' Llama/Qwen2/Qwen3 on tiny random checkpoints."""

import json

import pytest
import torch

from gpu.models.registry import config_from_hf
from gpu.config.model import ModelConfig
from gpu.loader.decoder import load_model
from gpu.layers.ops import build_rope_cache
from tests.support.hf_models import hf_logits, make_hf_model, our_logits

IDS = [3, 17, 42, 99, 5, 150, 7, 63, 21, 88, 130, 1, 64, 9, 33, 120, 77, 2, 45, 101] * 3  # 60 tokens

CASES = {
    "llama": ("llama", dict(tie_word_embeddings=False)),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama3-rope": ("llama", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "linear-rope": ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0})),
    "qwen2-bias": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3-qknorm": ("qwen3", dict(head_dim=32, tie_word_embeddings=False)),
    "qwen3-yarn": ("qwen3", dict(max_position_embeddings=128, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32})),
}


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(case, tmp_path):
    arch, overrides = CASES[case]
    hf = make_hf_model(arch, tmp_path, **overrides)
    loaded = load_model(tmp_path, dtype="float32", progress=False)
    assert loaded.config.architecture == arch
    assert loaded.name == tmp_path.name and loaded.tokenizer is None
    expected, got = hf_logits(hf, IDS), our_logits(loaded.model, IDS)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_flat_batch_of_sequences_matches_each_sequence(tmp_path):
    hf = make_hf_model("qwen3", tmp_path)
    model = load_model(tmp_path, dtype="float32", progress=False).model
    a, b = IDS[:13], IDS[20:49]
    got = our_logits(model, a + b, seq_lens=[len(a), len(b)])
    torch.testing.assert_close(got[: len(a)], hf_logits(hf, a), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[len(a):], hf_logits(hf, b), atol=1e-4, rtol=1e-4)


def test_qwen2_biases_and_merged_weights_are_loaded(tmp_path):
    hf = make_hf_model("qwen2", tmp_path)
    model = load_model(tmp_path, dtype="float32", progress=False).model
    attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
    ref = hf.model.layers[1]
    torch.testing.assert_close(attn.qkv_proj.bias, torch.cat(
        [ref.self_attn.q_proj.bias, ref.self_attn.k_proj.bias, ref.self_attn.v_proj.bias]))
    assert attn.o_proj.bias is None
    torch.testing.assert_close(mlp.gate_up_proj.weight, torch.cat([ref.mlp.gate_proj.weight, ref.mlp.up_proj.weight]))


@pytest.mark.parametrize("case", ["llama", "llama3-rope", "linear-rope", "qwen3-yarn"])
def test_rope_cache_matches_transformers_rotary_embedding(case):
    arch, overrides = CASES[case]
    hf = make_hf_model(arch, **overrides)
    positions = torch.arange(300)[None]
    x = torch.zeros(1, 300, 8)
    cos, sin = hf.model.rotary_emb(x, positions)  # [1, P, Dh], halves duplicated
    config = config_from_hf(hf.config.to_dict())
    cache = build_rope_cache(config, 300, "cpu")
    half = config.head_dim // 2
    # fp32 angles reach ~300 rad here, where one ulp is ~3e-5.
    torch.testing.assert_close(cache[:, :half], cos[0, :, :half], atol=6e-5, rtol=0)
    torch.testing.assert_close(cache[:, half:], sin[0, :, :half], atol=6e-5, rtol=0)


def test_missing_or_misshapen_weights_are_errors(tmp_path):
    from safetensors.torch import load_file, save_file

    make_hf_model("llama", tmp_path, tie_word_embeddings=False)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="missing 1 weights.*up_proj"):
        load_model(tmp_path, dtype="float32", progress=False)
    weights["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="shape"):
        load_model(tmp_path, dtype="float32", progress=False)


def test_sharded_safetensors_and_generation_config(tmp_path):
    hf = make_hf_model("llama", seed=1)
    hf.generation_config.eos_token_id = [2, 7]
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    loaded = load_model(tmp_path, dtype="float32", progress=False)
    assert loaded.config.eos_token_ids == (hf.config.eos_token_id,)          # config.json's
    assert loaded.eos_token_ids == tuple(dict.fromkeys((hf.config.eos_token_id, 2, 7)))  # merged
    assert loaded.generation_config["eos_token_id"] == [2, 7]
    torch.testing.assert_close(our_logits(loaded.model, IDS[:10]), hf_logits(hf, IDS[:10]), atol=1e-4, rtol=1e-4)


def test_dummy_load_of_shrunk_qwen3_config(tmp_path):
    from pathlib import Path

    import gpu

    full = json.loads((Path(gpu.__file__).parent / "configs/qwen3-0.6b/config.json").read_text())
    real = config_from_hf(full)
    assert (real.hidden_size, real.num_hidden_layers, real.head_dim, real.vocab_size) == (1024, 28, 128, 151936)
    assert real.qk_norm and real.tie_word_embeddings and real.eos_token_ids == (151645,)
    assert real.rope_theta == 1e6 and real.rope_scaling is None and real.max_position_embeddings == 40960

    small = {**full, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "intermediate_size": 96, "vocab_size": 256, "max_position_embeddings": 512}
    (tmp_path / "config.json").write_text(json.dumps(small))
    a = load_model(tmp_path, load_format="dummy", dtype="float32", seed=3, progress=False)
    b = load_model(tmp_path / "config.json", load_format="dummy", dtype="float32", seed=3, progress=False)
    c = load_model(tmp_path, load_format="dummy", dtype="float32", seed=4, progress=False)
    assert a.tokenizer is None and a.max_model_len == 512 and a.config.qk_norm
    la, lb, lc = (our_logits(x.model, IDS[:8]) for x in (a, b, c))
    assert torch.isfinite(la).all()
    torch.testing.assert_close(la, lb)
    assert not torch.allclose(la, lc)


def test_bfloat16_load_runs(tmp_path):
    hf = make_hf_model("qwen3", tmp_path)
    loaded = load_model(tmp_path, dtype="bfloat16", progress=False)
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    got = our_logits(loaded.model, IDS[:12])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, hf_logits(hf, IDS[:12]), atol=0.1, rtol=0.05)


def test_config_validation():
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'.*llama, qwen2, qwen3"):
        config_from_hf({"model_type": "gpt2"})
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                max_position_embeddings=16, model_type="llama")
    with pytest.raises(ValueError, match="rope_type 'dynamic'"):
        config_from_hf({**base, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    with pytest.raises(ValueError, match="multiple"):
        config_from_hf({**base, "num_key_value_heads": 3})
    legacy = config_from_hf({**base, "rope_theta": 5e5, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8}})
    current = config_from_hf({**base, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8}})
    assert legacy == current and hash(legacy) == hash(current)
    assert legacy.rope_scaling_dict["rope_type"] == "llama3"


def test_cached_dense_attention_matches_full_recompute(tmp_path):
    from gpu.layers.attention_dense import DenseCachedAttention

    make_hf_model("qwen2", tmp_path)
    model = load_model(tmp_path, dtype="float32", progress=False).model
    full = our_logits(model, IDS[:12])
    attn = DenseCachedAttention()
    with torch.inference_mode():
        prefill = model.compute_logits(model(torch.tensor(IDS[:9]), torch.arange(9), attn))
        steps = [model.compute_logits(model(torch.tensor([IDS[i]]), torch.tensor([i]), attn)) for i in range(9, 12)]
    torch.testing.assert_close(torch.cat([prefill, *steps]), full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt_oss"])
def test_macs_per_token_count_the_linears_a_token_runs(arch, tmp_path):
    """ModelConfig.macs_per_token (the draft model's cost over its target's, for the cost
    gate: stages/schedule/spec.py) is the weights of every nn.Linear a token passes through in
    transformers' model, the LM head included and a mixture's router left out: of its
    experts' weights, the share a token's active experts hold."""
    hf = make_hf_model(arch, tmp_path)
    c = config_from_hf(hf.config.to_dict())
    linears = sum(m.weight.numel() for name, m in hf.named_modules()
                  if isinstance(m, torch.nn.Linear) and "router" not in name)
    experts = sum(p.numel() for name, p in hf.named_parameters()
                  if ".experts." in name and not name.endswith("bias"))
    if arch == "gpt_oss":
        assert experts > 0
        linears += experts * c.num_experts_per_tok // c.num_experts
    assert c.macs_per_token == linears
