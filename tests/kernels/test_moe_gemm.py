"""The dense fused-MoE grouped GEMM (gpu/kernels/triton/moe_gemm.py) against its torch
reference, with uneven row counts (experts with no rows among them), each epilogue, and the
whole routed MoE of gpu/layers/moe.py computed through two launches."""

import pytest
import torch

from gpu.kernels.triton.moe_gemm import moe_gemm, moe_gemm_ref


def _offs(counts, device):
    return torch.tensor(counts, device=device).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[3, 0, 20, 1, 0], [0, 0, 1, 0, 0], [0, 0, 0, 0, 0]], ids=["uneven", "one", "none"])
def test_plain_matches_reference(device, tol, dtype, counts):
    E, N, K = 5, 48, 80             # N not a multiple of BLOCK_N, K not of BLOCK_K
    g = torch.Generator().manual_seed(0)
    w = torch.randn(E, N, K, generator=g).to(device, dtype)
    rows = sum(counts)
    a = torch.randn(rows, K, generator=g).to(device, dtype)
    offs = _offs(counts, device)
    got, want = moe_gemm(a, w, offs), moe_gemm_ref(a, w, offs)
    assert got.shape == (rows, N) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), **tol(dtype))


def test_routed_moe_in_two_launches_matches_the_layer(device, tol):
    """gate_up with the tokens' rows gathered and SwiGLU, then down with the routing weight
    and the scatter to (token, slot): the MoE layer's sum, for a Qwen3-MoE-like layer."""
    from gpu.config.model import ModelConfig
    from gpu.config.moe import MoESpec
    from gpu.layers.moe import MoE, moe_reference

    c = ModelConfig(architecture="test", vocab_size=8, hidden_size=32, intermediate_size=24, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4,
                    max_position_embeddings=64, num_experts=6, num_experts_per_tok=2,
                    moe=MoESpec(norm_topk_prob=False, router_bias=False, activation="swiglu", expert_bias=False))
    moe = MoE(c, torch.float32, "cpu")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    x = torch.randn(7, 32, generator=g)
    with torch.inference_mode():
        weights, experts = moe.route(x)
        by_expert, order = experts.flatten().sort(stable=True)
        offs = torch.searchsorted(by_expert, torch.arange(1, 7), out_int32=True)
        want = moe_reference(moe, x)
    d = lambda t: t.to(device)  # noqa: E731
    h = moe_gemm(d(x), d(moe.experts.gate_up_proj), d(offs), a_rows=d(order // 2), swiglu=True)
    y = moe_gemm(h, d(moe.experts.down_proj), d(offs), row_scale=d(weights.flatten()[order]), out_rows=d(order))
    torch.testing.assert_close(y.view(7, 2, 32).sum(1).cpu(), want, **tol(torch.float32))


SPECS = {
    "qwen3_moe": dict(norm_topk_prob=True, router_bias=False, activation="swiglu", expert_bias=False),
    "gpt_oss_unpacked": dict(),     # biases on the router and the experts, clamped SwiGLU
    "llama4": dict(scoring="sigmoid", router_bias=False, activation="swiglu", expert_bias=False,
                   weight_on_input=True, norm_topk_prob=False),
}


@pytest.mark.parametrize("name", SPECS)
def test_the_layer_through_the_kernel_matches_the_dense_reference(name):
    """gpu/layers/moe.py with Experts.use_kernel (the CUDA default; here under the interpreter):
    a routing that leaves experts empty, in fp32 against every expert on every token."""
    from gpu.config.model import ModelConfig
    from gpu.config.moe import MoESpec
    from gpu.layers.moe import MoE, moe_reference

    k = 1 if name == "llama4" else 2
    c = ModelConfig(architecture="test", vocab_size=8, hidden_size=32, intermediate_size=24, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4,
                    max_position_embeddings=64, num_experts=6, num_experts_per_tok=k, moe=MoESpec(**SPECS[name]))
    moe = MoE(c, torch.float32, "cpu")
    assert not moe.experts.use_kernel                  # on the CPU the kernel only when asked
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    x = torch.randn(5, 32, generator=g)
    with torch.inference_mode():
        want = moe_reference(moe, x)
        moe.experts.use_kernel = True
        got = moe(x)
    assert len(moe.route(x)[1].unique()) < 6           # some expert has no rows
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
