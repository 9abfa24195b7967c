"""gpu/worker/spec_decode/eagle.py's parts (issue 35): the target's aux hidden states against transformers'
hidden_states (vLLM's layer ids: id i is the residual stream entering layer i), an EAGLE3
head's draft vocabulary mapped by d2t, and the formats' configs read alike."""
from __future__ import annotations

import pytest
import torch

from tests.support.eagle_heads import eagle3_head
from tests.support.hf_models import make_hf_model

from gpu.layers.attention_dense import DenseCausalAttention
from gpu.worker.spec_decode.eagle import HeadError, load_head, read_head
from gpu.loader.decoder import load_model


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    hf = make_hf_model("llama", path, num_hidden_layers=4)
    return hf, load_model(path, dtype="float32", device="cpu", progress=False).model


def test_aux_hidden_states_are_the_streams_entering_the_layers(target):
    hf, ours = target
    ids = [5, 17, 99, 3, 42, 8, 150, 77]
    with torch.inference_mode():
        ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
        _, aux = ours(torch.tensor(ids), torch.arange(len(ids)), DenseCausalAttention(None),
                      aux_layers=(0, 2, 3))
    H = ours.config.hidden_size
    assert aux.shape == (len(ids), 3 * H)
    for k, layer in enumerate((0, 2, 3)):
        torch.testing.assert_close(aux[:, k * H:(k + 1) * H], ref[layer][0], atol=1e-5, rtol=1e-5)


def test_eagle3_logits_live_on_the_draft_vocabulary_mapped_by_d2t(target, tmp_path):
    _, ours = target
    c = ours.config
    path = eagle3_head(tmp_path / "h", vocab=c.vocab_size, target_hidden=c.hidden_size,
                       hidden=32, heads=2, kv_heads=1, head_dim=16, inter=48, draft_vocab=40,
                       aux_ids=[1, 2, 4])
    head = load_head(str(path), "eagle3", ours, torch.float32, "cpu")
    from safetensors.torch import load_file
    t = load_file(str(path / "model.safetensors"))
    targets = torch.arange(40) + t["d2t"]
    assert torch.equal(t["t2d"].nonzero()[:, 0], targets)        # the two maps agree
    rows = torch.randn(3, 32)
    with torch.inference_mode():
        logits = head.compute_logits(rows)
    assert logits.shape == (3, c.vocab_size)
    torch.testing.assert_close(logits[:, targets], rows @ t["lm_head.weight"].T)
    outside = torch.ones(c.vocab_size, dtype=torch.bool)
    outside[targets] = False
    assert torch.isinf(logits[:, outside]).all() and (logits[:, outside] < 0).all()
    assert head.spec.aux_layer_ids == (1, 2, 4) and head.spec.norm_before_residual is False


def test_the_speculators_format_reads_as_eagle3(target, tmp_path):
    _, ours = target
    c = ours.config
    kw = dict(vocab=c.vocab_size, target_hidden=c.hidden_size, draft_vocab=64)
    plain = read_head(str(eagle3_head(tmp_path / "a", **kw)), "eagle3", c)
    spec = read_head(str(eagle3_head(tmp_path / "b", speculators=True, **kw)), "eagle3", c)
    assert plain.layer == spec.layer and plain.draft_vocab_size == spec.draft_vocab_size
    # speculators' default is norm_before_residual true; vLLM's default layers (2, L/2, L-3)
    assert spec.norm_before_residual and not plain.norm_before_residual
    assert spec.aux_layer_ids == plain.aux_layer_ids == (2, 2, 1)


def test_aux_layers_the_target_lacks_are_refused(target, tmp_path):
    _, ours = target
    c = ours.config
    path = eagle3_head(tmp_path / "h", vocab=c.vocab_size, target_hidden=c.hidden_size,
                       draft_vocab=64, aux_ids=[1, 2, 9])
    with pytest.raises(HeadError, match=r"reads target layers \[1, 2, 9\].*the target has 4 layers"):
        read_head(str(path), "eagle3", c)
