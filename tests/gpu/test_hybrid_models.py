"""Qwen3-Next and Qwen3.5 (dense, text) against transformers' own modules on tiny random
checkpoints: the logits of a whole prompt, and of several prompts in one flat batch."""
import pytest
import torch

from gpu.layers.moe import MoE
from gpu.loader.decoder import load_model
from tests.support.hf_models import hf_logits, our_logits
from tests.support.hybrid_models import TINY_EXPERTS, TINY_HYBRID, make_hybrid, make_hybrid_vl

IDS = [(i * 37 + 11) % 157 + 2 for i in range(150)]     # 150 tokens: past two delta-rule chunks


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_logits_match_transformers(family, tmp_path):
    hf = make_hybrid(family, tmp_path)
    loaded = load_model(tmp_path, dtype="float32", progress=False)
    c = loaded.config
    assert c.architecture == family and c.num_linear_layers == 3 and c.num_kv_layers == 1
    assert c.rope_dim == 8
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


@pytest.mark.parametrize("family,overrides", [
    ("qwen3_next", dict(TINY_EXPERTS, mlp_only_layers=[1])),            # layer 1 keeps a dense MLP
    ("qwen3_next", dict(TINY_EXPERTS, decoder_sparse_step=2, norm_topk_prob=False)),
    ("qwen3_5_moe", {}),
])
def test_mixtures_match_transformers(family, overrides, tmp_path):
    """The released Qwen3-Next and Qwen3.5-MoE: experts routed on softmax, top 2 of 4, a
    shared expert times its sigmoid gate; the dense layers where the config keeps them."""
    hf = make_hybrid(family, tmp_path, seed=3, **overrides)
    with torch.no_grad():       # routing that is not a near-tie: spread the routers' logits
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(8)
    hf.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, dtype="float32", progress=False)
    c, model = loaded.config, loaded.model
    moe = [i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MoE)]
    dense = set(overrides.get("mlp_only_layers", ())) | {i for i in range(4) if (i + 1) % overrides.get(
        "decoder_sparse_step", 1)}
    assert moe == [i for i in range(4) if i not in dense] and c.num_experts == 4
    assert c.moe.shared_gate and c.moe.norm_topk_prob == overrides.get("norm_topk_prob", True)
    expected, got = hf_logits(hf, IDS[:40]), our_logits(model, IDS[:40])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_a_mixture_without_its_expert_sizes_is_refused_clearly():
    from gpu.models.registry import config_from_hf

    with pytest.raises(ValueError, match="num_experts > 0"):
        config_from_hf({**TINY_HYBRID, "model_type": "qwen3_5_moe_text"})


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_a_released_vision_language_folder_serves_its_text_model(family, tmp_path):
    """Qwen3.5's checkpoints are ForConditionalGeneration folders: the decoder under
    text_config and model.language_model, the vision tower skipped; text logits equal
    transformers' whole model on the same ids."""
    hf = make_hybrid_vl(family, tmp_path, seed=4)
    loaded = load_model(tmp_path, dtype="float32", progress=False)
    assert loaded.config.architecture == family and loaded.config.num_linear_layers == 3
    expected, got = hf_logits(hf, IDS[:40]), our_logits(loaded.model, IDS[:40])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
