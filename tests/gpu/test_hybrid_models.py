"""Qwen3-Next and Qwen3.5 (dense, text) against transformers' own modules on tiny random
checkpoints: the logits of a whole prompt, and of several prompts in one flat batch."""
import pytest
import torch

from gpu.loader.decoder import load_model
from tests.support.hf_models import hf_logits, our_logits
from tests.support.hybrid_models import TINY_HYBRID, make_hybrid

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


def test_experts_are_refused_clearly():
    from gpu.models.registry import config_from_hf

    with pytest.raises(ValueError, match="mixture-of-experts"):
        config_from_hf({**TINY_HYBRID, "model_type": "qwen3_next", "num_experts": 4})
