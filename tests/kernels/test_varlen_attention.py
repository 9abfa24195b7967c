"""The pooling models' attention (gpu/layers/pooler.py VarlenAttention): the step's own k/v, no
cache. Its Triton path (the prefill kernel's non-causal mode over one-token pages; under
TRITON_INTERPRET=1 on CPU) against its torch path (one padded SDPA call) and against dense
attention per sequence; then a tiny BERT through each (issue 32)."""
from __future__ import annotations

import pytest
import torch

from gpu.layers.pooler import VarlenAttention

CASES = {
    # name: (seq_lens, Hq, Hkv, Dh)
    "encoder_mha": ([5, 1, 17, 9], 4, 4, 16),
    "decoder_gqa": ([3, 20, 2], 4, 2, 32),
    "one_sequence": ([13], 2, 2, 16),
    "buckets": ([7, 8, 31, 8, 9, 30, 2], 2, 1, 16),    # (2) (7 8 8 9) (30 31): padded groups
    "equal_lengths": ([6, 6, 6], 2, 2, 16),           # one group, no mask
}


def _qkv(lens, hq, hkv, dh, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = torch.randn(T, hq, dh, generator=g).to(dtype).to(device)
    kv = torch.randn(T, 2, hkv, dh, generator=g).to(dtype).to(device)
    return q, kv[:, 0], kv[:, 1]          # k, v: strided views, as the model's unbind gives them


def _dense(q, k, v, lens, scale, causal):
    out, start = [], 0
    group = q.shape[1] // k.shape[1]
    for n in lens:
        qs, ks, vs = (x[start:start + n].float().transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        out.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale)
                   .transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_varlen_attention_paths_match_dense(case, causal, dtype, device, tol):
    lens, hq, hkv, dh = CASES[case]
    q, k, v = _qkv(lens, hq, hkv, dh, dtype, device)
    scale = dh ** -0.5
    dense = _dense(q.cpu(), k.cpu(), v.cpu(), lens, scale, causal)
    for use_triton, padded in ((False, False), (False, True), (True, False)):
        attn = VarlenAttention(scale, causal=causal, use_triton=use_triton, padded=padded)
        dev = torch.device(device) if use_triton else torch.device("cpu")
        layout = attn.prepare(lens, dev)
        assert (layout is not None) == padded
        x = [t if layout is None else t.index_select(0, layout) for t in (q, k, v)]   # the padded rows
        out = attn.unpad(attn.forward(0, *(t.to(dev) for t in x)))
        assert out.shape == q.shape and out.dtype == dtype
        torch.testing.assert_close(out.float().cpu(), dense, **tol(dtype))


def test_buckets_bound_the_padding():
    from gpu.layers.pooler import PAD_SLACK, _buckets
    lens = [7, 8, 31, 8, 9, 30, 2]
    groups = _buckets(lens)
    assert sorted(b for g in groups for b in g) == list(range(len(lens)))
    assert [sorted(lens[b] for b in g) for g in groups] == [[2], [7, 8, 8, 9], [30, 31]]
    for g in groups:
        assert max(lens[b] for b in g) * len(g) <= PAD_SLACK * sum(lens[b] for b in g)


def test_padded_layout_slabs():
    """The padded layout: slabs of sequences sorted by length, each padded to its longest
    within DENSE_SLACK; `unpad` takes each token's row back to the flat order."""
    from gpu.layers.pooler import DENSE_SLACK
    lens = [7, 8, 31, 8, 9, 30, 2]
    attn = VarlenAttention(0.25, causal=False, padded=True)
    layout = attn.prepare(lens, torch.device("cpu"))
    shapes = [(G, L) for _, G, L, _ in attn.slabs]
    assert shapes == [(1, 2), (1, 7), (2, 8), (1, 9), (2, 31)]      # 30 and 31: 62 rows for 61 tokens
    assert len(layout) == sum(G * L for G, L in shapes) <= DENSE_SLACK * sum(lens)
    flat = torch.arange(sum(lens))
    assert torch.equal(attn.unpad(flat.index_select(0, layout)), flat)


def test_varlen_attention_refuses_sinks_and_windows():
    attn = VarlenAttention(0.25, causal=True)
    attn.prepare([2], torch.device("cpu"))
    q = torch.zeros(2, 1, 16)
    with pytest.raises(ValueError, match="sliding"):
        attn.forward(0, q, q, q, window=1)


def test_tiny_bert_through_the_triton_path(device):
    """A whole (random) 2-layer encoder: the Triton attention gives the torch path's hidden states."""
    from gpu.models.bert import Encoder, EncoderConfig
    from gpu.layers.pooler import PoolingModel
    from gpu.config.pooling import PoolingSpec
    from gpu.loader.pooling import init_random
    cfg = EncoderConfig(architecture="bert", vocab_size=50, hidden_size=32, intermediate_size=40,
                        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=32)
    spec = PoolingSpec(task="embed", pooling_type="MEAN", normalize=True, use_activation=False,
                       hidden_size=32, encoder=True)
    model = PoolingModel(Encoder(cfg), spec)
    init_random(model, 0)
    lens = [4, 11, 1]
    ids = torch.randint(0, 50, (sum(lens),), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(n) for n in lens])
    outs = []
    for use_triton in (False, True):
        attn = VarlenAttention(cfg.head_dim ** -0.5, causal=False, use_triton=use_triton)
        dev = torch.device(device) if use_triton else torch.device("cpu")
        attn.prepare(lens, dev)
        with torch.inference_mode():
            outs.append(model.to(dev)(ids.to(dev), pos.to(dev), attn, lens).cpu())
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)
