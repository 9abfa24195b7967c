"""Gated DeltaNet's pieces against transformers' Qwen3-Next references: the delta rule's
chunked and recurrent forms (each other, and split anywhere with the state carried), the
causal conv1d with its rolling state, the norms, and a whole layer through a StatePool."""
import pytest
import torch

from gpu.config.model import ModelConfig
from gpu.layers import delta_rule as dr
from gpu.layers.linear_attention import GatedDeltaNet, StatePool, StateStep
from gpu.layers.norms import gated_rms_norm, offset_rms_norm

hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


def _inputs(L, Hk=2, Hv=4, Dk=16, Dv=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(L, Hk, Dk, generator=g), torch.randn(L, Hk, Dk, generator=g)
    v = torch.randn(L, Hv, Dv, generator=g)
    decay = -torch.rand(L, Hv, generator=g) * 0.7
    beta = torch.rand(L, Hv, generator=g)
    state = torch.randn(Hv, Dk, Dv, generator=g) * 0.1
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("length", [1, 5, 64, 150])
def test_chunked_and_recurrent_match_transformers(length):
    q, k, v, g, beta, s0 = _inputs(length)
    o, s = dr.chunked(q, k, v, g, beta, s0)
    ref_o, ref_s = hf.torch_recurrent_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], initial_state=s0[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o, ref_o[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, ref_s[0], atol=1e-5, rtol=1e-5)
    ro, rs = dr.recurrent(q, k, v, g, beta, s0)
    torch.testing.assert_close(ro, ref_o[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rs, ref_s[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cuts", [(1,), (37,), (64,), (5, 70, 71)])
def test_chunked_split_anywhere_with_the_state_carried_equals_one_pass(cuts):
    q, k, v, g, beta, _ = _inputs(150, seed=1)
    whole_o, whole_s = dr.chunked(q, k, v, g, beta)
    outs, s, bounds = [], None, (0, *cuts, 150)
    for a, b in zip(bounds, bounds[1:]):
        o, s = dr.chunked(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], s)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs), whole_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, whole_s, atol=1e-5, rtol=1e-5)


def test_conv1d_with_its_rolling_state_matches_transformers():
    C, K, L = 12, 4, 9
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(L, C, generator=g), torch.randn(C, K, generator=g)
    ref = hf.causal_conv1d_fn(x.t()[None], w, None, activation="silu")[0].t()
    out, state = dr.conv1d(x, w, None)
    torch.testing.assert_close(out, ref)
    # the same in pieces: a chunk of 5, then one token at a time (decode), state carried
    out1, s = dr.conv1d(x[:5], w, None)
    steps = [out1]
    s = s[None]
    for t in range(5, L):
        y, s = dr.conv1d_step(x[t:t + 1], w, s)
        steps.append(y)
    torch.testing.assert_close(torch.cat(steps), ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(s[0], state)
    torch.testing.assert_close(state, x[-(K - 1):].t())


def test_norms_match_transformers():
    x, gate = torch.randn(6, 32), torch.randn(6, 32)
    norm = hf.Qwen3NextRMSNorm(32, eps=1e-6)
    gated = hf.Qwen3NextRMSNormGated(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
        gated.weight.normal_()
    torch.testing.assert_close(offset_rms_norm(x, norm.weight, 1e-6), norm(x))
    torch.testing.assert_close(gated_rms_norm(x, gate, gated.weight, 1e-6), gated(x, gate))


def _layer(seed=3):
    import transformers

    cfg = transformers.Qwen3NextConfig(
        hidden_size=32, num_hidden_layers=1, layer_types=["linear_attention"], num_experts=0,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, vocab_size=32, intermediate_size=32)
    torch.manual_seed(seed)
    ref = hf.Qwen3NextGatedDeltaNet(cfg, 0).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    ours_cfg = ModelConfig(
        architecture="qwen3_next", vocab_size=32, hidden_size=32, intermediate_size=32,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        rms_norm_eps=cfg.rms_norm_eps, rope_theta=10000.0, max_position_embeddings=64,
        layer_types=("linear_attention",), linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4)
    ours = GatedDeltaNet(ours_cfg, 0, "qkvz", torch.float32, "cpu")
    ours.load_state_dict(ref.state_dict())
    return ref, ours, ours_cfg


@pytest.mark.parametrize("triton", [False, True], ids=["torch", "triton"])
def test_layer_prefill_then_decode_through_the_pool_matches_transformers(triton):
    """Sequence A in chunks of 7 and 3 then two decode steps, beside sequence B (a 1-token
    prompt, then decodes) in the same steps, each in its own slot; transformers runs each
    whole sequence at once. triton: the layer runs gpu/kernels/triton/delta_rule.py (under
    the interpreter here), as it does on CUDA."""
    ref, ours, cfg = _layer()
    ours.use_triton = triton
    from gpu.layers.linear_attention import LinearDims
    pool = StatePool(1, 4, LinearDims.of(cfg), torch.float32, "cpu")
    pool.conv.fill_(float("nan"))   # stale states: a sequence at position 0 must not read them
    pool.recurrent.fill_(float("nan"))
    g = torch.Generator().manual_seed(4)
    xa, xb = torch.randn(12, 32, generator=g), torch.randn(4, 32, generator=g)
    with torch.no_grad():
        want_a, want_b = ref(xa[None])[0], ref(xb[None])[0]
    # (rows of A, rows of B) a step, each as (start, count)
    steps = [((0, 7), (0, 1)), ((7, 3), (1, 1)), ((10, 1), (2, 1)), ((11, 1), (3, 1))]
    got_a, got_b = [], []
    with torch.no_grad():
        for (a0, an), (b0, bn) in steps:
            x = torch.cat([xa[a0:a0 + an], xb[b0:b0 + bn]])
            step = pool.step([2, 0], [0, an], [an, bn], [a0, b0])
            y = ours(x, step)
            got_a.append(y[:an])
            got_b.append(y[an:])
    torch.testing.assert_close(torch.cat(got_a), want_a, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat(got_b), want_b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("triton", [False, True], ids=["torch", "triton"])
def test_a_sequence_without_a_slot_starts_from_zeros_and_keeps_nothing(triton):
    ref, ours, cfg = _layer()
    ours.use_triton = triton
    x = torch.randn(5, 32)
    with torch.no_grad():
        y = ours(x, StateStep.of(None, [(0, 5, -1, False)]))
        torch.testing.assert_close(y, ref(x[None])[0], atol=1e-5, rtol=1e-4)


def test_prefill_chunks_of_unequal_lengths_are_grouped_and_exact():
    """One step of four prompts, 40, 3, 1 and 7 tokens (two padding groups), then the same
    step's continuation, every sequence in its own slot: each equals transformers alone."""
    ref, ours, cfg = _layer(seed=5)
    from gpu.layers.linear_attention import LinearDims
    pool = StatePool(1, 4, LinearDims.of(cfg), torch.float32, "cpu")
    lens = [40, 3, 1, 7]
    g = torch.Generator().manual_seed(6)
    xs = [torch.randn(n + 2, 32, generator=g) for n in lens]     # 2 more tokens each, next step
    step = StateStep.of(pool, [(sum(lens[:i]), n, i, False) for i, n in enumerate(lens)])
    assert len(step.chunks) == 2
    with torch.no_grad():
        first = ours(torch.cat([x[:n] for x, n in zip(xs, lens)]), step)
        second = ours(torch.cat([x[n:] for x, n in zip(xs, lens)]),
                      pool.step([0, 1, 2, 3], [0, 2, 4, 6], [2] * 4, lens))
        for i, (x, n) in enumerate(zip(xs, lens)):
            want = ref(x[None])[0]
            got = torch.cat([first[sum(lens[:i]):sum(lens[:i]) + n], second[2 * i:2 * i + 2]])
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
