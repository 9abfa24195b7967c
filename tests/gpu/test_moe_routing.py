"""The MoE layer's routing strategies (gpu/config/moe.py, gpu/layers/moe.py route): against
transformers' routers (DeepSeek-V3's grouped sigmoid, Llama 4's top-1 sigmoid on the input),
and the grouped GEMM against the dense reference on the edge cases of routing: ties, every
expert empty but one, one expert in every row."""
import attrs
import pytest
import torch

from gpu.config.model import ModelConfig
from gpu.config.moe import MoESpec
from gpu.layers.moe import MoE, moe_reference, route
from gpu.models.causal_lm import make_moe

SOFTMAX = MoESpec(router_bias=False, activation="swiglu", expert_bias=False)
SIGMOID = MoESpec(scoring="sigmoid", norm_topk_prob=True, router_bias=False, correction_bias=True, n_group=4,
                  topk_group=2, routed_scaling_factor=2.5, activation="swiglu", expert_bias=False)
LLAMA4 = MoESpec(scoring="sigmoid", norm_topk_prob=False, router_bias=False, weight_on_input=True,
                 activation="swiglu", expert_bias=False, shared_intermediate_size=24)


def _config(spec: MoESpec, experts=8, top_k=2) -> ModelConfig:
    return ModelConfig(architecture="test", vocab_size=8, hidden_size=32, intermediate_size=24, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-5,
                       rope_theta=1e4, max_position_embeddings=64, num_experts=experts, num_experts_per_tok=top_k,
                       moe=spec)


def _moe(spec: MoESpec, experts=8, top_k=2, seed=0) -> MoE:
    g = torch.Generator().manual_seed(seed)
    moe = make_moe(_config(spec, experts, top_k), torch.float32, "cpu", False, _single())
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return moe


def _single():
    from gpu.parallel import SINGLE
    return SINGLE


@pytest.mark.parametrize("spec", [SOFTMAX, attrs.evolve(SOFTMAX, norm_topk_prob=False), SIGMOID, LLAMA4],
                         ids=["softmax-norm", "softmax", "grouped-sigmoid", "llama4"])
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_grouped_moe_matches_dense_reference(spec, tokens):
    moe = _moe(spec, top_k=1 if spec.weight_on_input else 2)
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(tokens))
    with torch.inference_mode():
        torch.testing.assert_close(moe(x), moe_reference(moe, x), atol=1e-4, rtol=1e-4)


def test_ties_pick_k_distinct_experts_and_share_the_weight():
    """Every logit equal: each strategy still picks k distinct experts, weighted alike."""
    logits = torch.zeros(3, 8)
    for spec, each in ((SOFTMAX, 0.5), (attrs.evolve(SOFTMAX, norm_topk_prob=False), 1 / 8),
                       (SIGMOID, 0.5 * 2.5)):
        weights, experts = route(logits, 2, spec, torch.zeros(8) if spec.correction_bias else None)
        assert all(len(set(row)) == 2 for row in experts.tolist())
        torch.testing.assert_close(weights, torch.full((3, 2), each))
    moe = _moe(SOFTMAX)
    with torch.no_grad():
        moe.router.weight.zero_()                      # every token's logits tie
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        torch.testing.assert_close(moe(x), moe_reference(moe, x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("top_k", [1, 2])
def test_one_expert_takes_every_row(top_k):
    """Expert 5's router row dominates: at top-1 every other expert's segment is empty; at
    top-2 expert 5 is in every row and the second slot spreads over the rest."""
    moe = _moe(SOFTMAX, top_k=top_k, seed=2)
    with torch.no_grad():
        moe.router.weight[5] = 0
        moe.router.weight[5, 0] = 50.0
    x = torch.randn(17, 32, generator=torch.Generator().manual_seed(3))
    x[:, 0] = x[:, 0].abs() + 1.0
    with torch.inference_mode():
        _, experts = moe.route(x)
        assert (experts == 5).any(-1).all()
        if top_k == 1:
            assert experts.unique().tolist() == [5]
        torch.testing.assert_close(moe(x), moe_reference(moe, x), atol=1e-4, rtol=1e-4)


def test_correction_bias_chooses_but_does_not_weigh():
    """A large correction bias on expert 3 puts it in every row; its weight is its own
    uncorrected sigmoid (renormalised, scaled)."""
    spec = attrs.evolve(SIGMOID, n_group=1, topk_group=1)
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(4))
    bias = torch.zeros(8)
    bias[3] = 10.0
    weights, experts = route(logits, 2, spec, bias)
    assert (experts == 3).any(-1).all()
    s = logits.sigmoid()
    chosen = s.gather(1, experts)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True) * 2.5)


def test_grouped_sigmoid_matches_transformers_deepseek_v3_router():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                           routed_scaling_factor=2.5, norm_topk_prob=True)
    theirs = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(8, 32, generator=g))
        theirs.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.1)
    x = torch.randn(40, 32, generator=g)
    _, want_w, want_e = theirs(x)
    got_w, got_e = route(x @ theirs.weight.T, 2, SIGMOID, theirs.e_score_correction_bias)
    order_w, order_g = want_e.sort(-1).indices, got_e.sort(-1).indices
    assert torch.equal(want_e.gather(1, order_w), got_e.gather(1, order_g))
    torch.testing.assert_close(got_w.gather(1, order_g), want_w.gather(1, order_w))


def test_llama4_moe_matches_transformers():
    """Top-1 sigmoid on the expert's input, and the shared expert, against Llama4TextMoe
    (whose experts are stacked [E, D, 2I] with gate and up as halves)."""
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    cfg = Llama4TextConfig(hidden_size=32, intermediate_size=24, num_local_experts=8, num_experts_per_tok=1)
    theirs = Llama4TextMoe(cfg).eval()
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    ours = make_moe(_config(LLAMA4, 8, 1), torch.float32, "cpu", False, _single())
    gate, up = theirs.experts.gate_up_proj.chunk(2, dim=-1)                    # [E, D, I] each
    with torch.no_grad():
        ours.router.weight.copy_(theirs.router.weight)
        ours.experts.gate_up_proj.copy_(torch.stack([gate, up], dim=-1).flatten(-2).transpose(1, 2))
        ours.experts.down_proj.copy_(theirs.experts.down_proj.transpose(1, 2))
        sh = theirs.shared_expert
        ours.shared_expert.gate_up_proj.weight.copy_(torch.cat([sh.gate_proj.weight, sh.up_proj.weight]))
        ours.shared_expert.down_proj.weight.copy_(sh.down_proj.weight)
    x = torch.randn(11, 32, generator=g)
    with torch.inference_mode():
        want, _ = theirs(x)
        torch.testing.assert_close(ours(x), want, atol=1e-4, rtol=1e-4)


def test_spec_errors():
    with pytest.raises(ValueError, match="unsupported MoE scoring 'relu'"):
        MoESpec(scoring="relu")
    with pytest.raises(ValueError, match=r"topk_group must be in 1..n_group \(4\), got 5"):
        MoESpec(scoring="sigmoid", n_group=4, topk_group=5)
    with pytest.raises(ValueError, match="n_group 3 does not divide num_experts 8"):
        _config(attrs.evolve(SIGMOID, n_group=3, topk_group=1))
