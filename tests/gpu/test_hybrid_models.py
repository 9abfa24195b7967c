"""Qwen3-Next and Qwen3.5 (dense, text) against transformers' own modules on tiny random
checkpoints: the logits of a whole prompt, and of several prompts in one flat batch."""
import pytest
import torch

from gpu.loader.decoder import load_model
from gpu_testutil import hf_logits, our_logits

IDS = [(i * 37 + 11) % 157 + 2 for i in range(150)]     # 150 tokens: past two delta-rule chunks

TINY_HYBRID = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                   linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=512,
                   rms_norm_eps=1e-6, initializer_range=0.1, tie_word_embeddings=False)


def make_hybrid(family: str, out_dir=None, seed: int = 0, **overrides):
    """A tiny random transformers Qwen3-Next (no experts) or Qwen3.5 text model, eager, fp32,
    layers [linear, linear, linear, full]; every norm, A_log and dt_bias perturbed."""
    import transformers

    cfg = {**TINY_HYBRID, **overrides}
    if family == "qwen3_next":
        config = transformers.Qwen3NextConfig(**{"num_experts": 0, **cfg})
    else:
        config = transformers.Qwen3_5TextConfig(**cfg)
    rope = dict(config.rope_parameters)
    rope["partial_rotary_factor"] = 0.5       # 8 of 16 dims rotated
    config.rope_parameters = rope
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("A_log", "dt_bias")):
                p.add_(torch.randn_like(p) * 0.2)
    if out_dir is not None:
        model.save_pretrained(out_dir, safe_serialization=True)
    return model


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_logits_match_transformers(family, tmp_path):
    hf = make_hybrid(family, tmp_path)
    loaded = load_model(tmp_path, dtype="float32", progress=False)
    c = loaded.config
    assert c.architecture == family and c.num_linear_layers == 3 and c.num_kv_layers == 1
    assert c.rotary_dim == 8
    expected, got = hf_logits(hf, IDS), our_logits(loaded.model, IDS)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_flat_batch_of_sequences_matches_each_sequence(tmp_path):
    hf = make_hybrid("qwen3_5", tmp_path, seed=1)
    model = load_model(tmp_path, dtype="float32", progress=False).model
    a, b = IDS[:13], IDS[20:99]
    got = our_logits(model, a + b, seq_lens=[len(a), len(b)])
    torch.testing.assert_close(got[:len(a)], hf_logits(hf, a), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[len(a):], hf_logits(hf, b), atol=1e-4, rtol=1e-4)


def test_experts_are_refused_clearly():
    from gpu.models.registry import config_from_hf

    with pytest.raises(ValueError, match="mixture-of-experts"):
        config_from_hf({**TINY_HYBRID, "model_type": "qwen3_next", "num_experts": 4})
