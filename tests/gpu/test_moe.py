"""gpt-oss's mixture of experts (grouped GEMM over routed tokens) against a dense reference, and
the MXFP4 dequantiser against the spec by hand and against transformers' converter."""

import pytest
import torch

from gpu.quantization import mxfp4
from gpu.config.model import ModelConfig
import torch.nn.functional as F

from gpu.layers import moe as moe_module
from gpu.layers.moe import MoE, clamped_swiglu, grouped_mm, moe_reference, padded_grouped_mm, route, segment_mm


def torch_grouped_mm(a, w, offs):
    """The CUDA bf16 path's call (torch's grouped GEMM also runs on CPU, in any float dtype)."""
    return F.grouped_mm(a, w.transpose(1, 2), offs=offs)


GROUPED_IMPLS = {"dispatch": grouped_mm, "segments": segment_mm, "padded": padded_grouped_mm,
                 "torch_grouped": torch_grouped_mm}

CONFIG = ModelConfig(architecture="gpt_oss", vocab_size=8, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4,
                     max_position_embeddings=64, num_experts=6, num_experts_per_tok=3)


def _moe(dtype=torch.float32, seed=0) -> MoE:
    g = torch.Generator().manual_seed(seed)
    moe = MoE(CONFIG, dtype, "cpu")
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return moe


@pytest.mark.parametrize("impl", list(GROUPED_IMPLS))
@pytest.mark.parametrize("tokens", [1, 2, 7, 33])
def test_grouped_moe_matches_dense_reference(tokens, impl, monkeypatch):
    monkeypatch.setattr(moe_module, "grouped_mm", GROUPED_IMPLS[impl])
    moe = _moe()
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(tokens))
    with torch.inference_mode():
        got, want = moe(x), moe_reference(moe, x)
        _, experts = route(moe.router(x), moe.top_k)
    if tokens == 1:
        assert experts.unique().numel() == 3          # three experts get no rows: empty segments
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_grouped_moe_bfloat16_close_to_fp32_reference():
    moe = _moe(torch.bfloat16)
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.inference_mode():
        got, want = moe(x).float(), moe_reference(moe, x).float()
    assert (got - want).norm() / want.norm() < 0.02       # bf16 rounding of the intermediates only


def test_grouped_mm_implementations_match_per_expert_matmuls():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(5, 24, 16, generator=g)
    counts = torch.tensor([3, 0, 1, 6, 0])
    a = torch.randn(int(counts.sum()), 16, generator=g)
    offs = counts.cumsum(0).to(torch.int32)
    want = torch.cat([a[s:e] @ w[i].T for i, (s, e) in enumerate(zip([0, *offs[:-1].tolist()], offs.tolist()))])
    for impl in GROUPED_IMPLS.values():
        torch.testing.assert_close(impl(a, w, offs), want)


def test_clamped_swiglu_by_hand():
    # interleaved (gate, up) pairs: (1, 2), (9, -9) clamped to (7, -7), (-3, 0.5)
    gate_up = torch.tensor([[1.0, 2.0, 9.0, -9.0, -3.0, 0.5]])
    sig = lambda z: 1 / (1 + torch.exp(torch.tensor(-z)))  # noqa: E731
    want = torch.tensor([[(2 + 1) * 1 * sig(1.702), (-7 + 1) * 7 * sig(7 * 1.702), (0.5 + 1) * -3 * sig(-3 * 1.702)]])
    torch.testing.assert_close(clamped_swiglu(gate_up, 1.702, 7.0), want)


def test_route_softmaxes_over_the_top_k_only():
    weights, experts = route(torch.tensor([[0.0, 3.0, 1.0, 2.0]]), 2)
    assert experts.tolist() == [[1, 3]]
    e = torch.exp(torch.tensor(1.0))
    torch.testing.assert_close(weights, torch.tensor([[e / (e + 1), 1 / (e + 1)]]))


def test_mxfp4_dequantise_by_hand():
    """One row of one 32-element block. Bytes hold two e2m1 codes, the even element in the low
    nibble: 0x21 -> codes 1, 2 -> 0.5, 1.0; 0xF7 -> 7, 15 -> 6.0, -6.0; 0x89 -> 9, 8 -> -0.5, -0.0;
    0x3C -> 12, 3 -> -2.0, 1.5. The e8m0 scale byte 125 means 2^(125 - 127) = 1/4."""
    row = torch.tensor([0x21, 0xF7, 0x89, 0x3C] + [0x00] * 12, dtype=torch.uint8)
    out = mxfp4.dequantize(row.view(1, 1, 16), torch.tensor([[125]], dtype=torch.uint8), torch.float32)
    assert out.shape == (1, 32)
    want = [0.5, 1.0, 6.0, -6.0, -0.5, -0.0, -2.0, 1.5] + [0.0] * 24
    assert out[0].tolist() == [v / 4 for v in want]
    assert torch.signbit(out[0, 5])                    # code 8 is negative zero
    big = mxfp4.dequantize(row.view(1, 1, 16), torch.tensor([[130]], dtype=torch.uint8))  # 2^3, bf16
    assert big.dtype == torch.bfloat16 and big[0, :4].tolist() == [4.0, 8.0, 48.0, -48.0]


def test_mxfp4_matches_transformers_converter():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=g, dtype=torch.uint8)   # [E, out, in/32, 16]
    scales = torch.randint(110, 140, (3, 10, 4), generator=g, dtype=torch.uint8)
    ours = mxfp4.dequantize(blocks, scales)                                          # [E, out, in]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)        # [E, in, out]
    assert torch.equal(ours, theirs.transpose(1, 2))


def test_mxfp4_quantize_round_trip_is_nearest():
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(4))
    back = mxfp4.dequantize(*mxfp4.quantize(w), torch.float32)
    assert back.shape == w.shape
    # within half an FP4 step of the block's scale: the largest gap (4 -> 6) is 2 units
    scale = 2.0 ** torch.ceil(torch.log2(w.reshape(4, 2, 32).abs().amax(-1) / 6))
    assert ((back - w).reshape(4, 2, 32).abs() <= scale.unsqueeze(-1) + 1e-6).all()
    assert torch.equal(mxfp4.dequantize(*mxfp4.quantize(back), torch.float32), back)   # representable: exact


def test_mxfp4_errors():
    with pytest.raises(ValueError, match="uint8"):
        mxfp4.dequantize(torch.zeros(1, 16), torch.zeros(1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="do not match"):
        mxfp4.dequantize(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8))
    half = torch.zeros(1, 1, 16, dtype=torch.uint8)
    pairs = [("x_blocks", half), ("x_blocks", half)]
    with pytest.raises(ValueError, match="twice"):
        list(mxfp4.dequantize_pairs(pairs, torch.float32))
