"""Qwen3-MoE, Qwen2-MoE and Mixtral (gpu/models/{qwen3_moe,qwen2_moe,mixtral}.py): logits
against transformers' forward on tiny random checkpoints saved per expert, through the dense
attention and through the runner's paged cache; the published configs read right."""
import json
from pathlib import Path

import pytest
import torch

import gpu
from gpu.models.registry import config_from_hf
from gpu.loader.decoder import load_model
from tests.support.hf_models import hf_logits, our_logits
from tests.support.moe_models import MOE, make_moe_model

IDS = [3, 17, 42, 99, 5, 150, 7, 63, 21, 88, 130, 1, 64, 9, 33, 120, 77, 2, 45, 101] * 2  # 40 tokens
CONFIGS = Path(gpu.__file__).parent / "configs"


@pytest.mark.parametrize("kind", list(MOE))
def test_logits_match_transformers(kind, tmp_path):
    hf = make_moe_model(kind, tmp_path, seed=len(kind))
    loaded = load_model(tmp_path, dtype="float32", progress=False)
    torch.testing.assert_close(our_logits(loaded.model, IDS), hf_logits(hf, IDS), atol=1e-4, rtol=1e-4)
    # two sequences in one flat batch: the routing is per token
    two = our_logits(loaded.model, IDS[:13] + IDS[5:30], [13, 25])
    torch.testing.assert_close(two[13:], hf_logits(hf, IDS[5:30]), atol=1e-4, rtol=1e-4)


def test_layers_follow_the_config(tmp_path):
    """Qwen3-MoE's mlp_only_layers and Qwen2-MoE's decoder_sparse_step give dense layers of
    intermediate_size; Qwen2-MoE's shared expert is gated."""
    from gpu.layers.moe import MoE

    make_moe_model("qwen3_moe", tmp_path / "q3")
    m = load_model(tmp_path / "q3", dtype="float32", progress=False).model
    assert [isinstance(layer.mlp, MoE) for layer in m.layers] == [True, False, True]
    assert m.layers[1].mlp.down_proj.in_features == 96 and m.layers[0].mlp.experts.down_proj.shape == (8, 64, 32)
    assert m.config.moe.norm_topk_prob and m.layers[0].mlp.shared_expert is None
    make_moe_model("qwen2_moe", tmp_path / "q2")
    m = load_model(tmp_path / "q2", dtype="float32", progress=False).model
    assert [isinstance(layer.mlp, MoE) for layer in m.layers] == [False, True, False]
    assert m.layers[1].mlp.shared_expert.down_proj.in_features == 48
    assert m.layers[1].mlp.shared_expert_gate is not None


def test_moe_matters_in_the_logits(tmp_path):
    """Negative control: the same model with routing by the other strategy (no renormalisation)
    moves the logits beyond the tolerance above."""
    import attrs

    hf = make_moe_model("qwen3_moe", tmp_path)
    m = load_model(tmp_path, dtype="float32", progress=False).model
    spec = attrs.evolve(m.config.moe, norm_topk_prob=False)
    for layer in m.layers:
        if hasattr(layer.mlp, "spec"):
            layer.mlp.spec = spec
    assert not torch.allclose(our_logits(m, IDS), hf_logits(hf, IDS), atol=1e-3)


def test_missing_expert_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    make_moe_model("mixtral", tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts: incomplete experts"):
        load_model(tmp_path, dtype="float32", progress=False)


def test_packed_experts_refused_for_a_plain_swiglu(tmp_path):
    make_moe_model("mixtral", tmp_path)
    with pytest.raises(ValueError, match="gpt-oss's experts only"):
        load_model(tmp_path, dtype="float32", progress=False, experts="packed")


def test_real_qwen3_30b_a3b_config():
    c = config_from_hf(json.loads((CONFIGS / "qwen3-30b-a3b/config.json").read_text()))
    assert (c.architecture, c.hidden_size, c.num_hidden_layers, c.num_experts, c.num_experts_per_tok) == (
        "qwen3_moe", 2048, 48, 128, 8)
    assert (c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (768, 32, 4, 128)
    assert c.qk_norm and c.moe.norm_topk_prob and c.moe.dense_layers == () and not c.moe.router_bias
    # 3.3B parameters active a token (Qwen's model card; the embedding's 0.3B is no matmul)
    assert c.macs_per_token + c.hidden_size * c.vocab_size == pytest.approx(3.3e9, rel=0.03)
