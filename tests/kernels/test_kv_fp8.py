"""--kv-cache-dtype fp8 on the Triton path: write_kv and the fused prepare_qkv store e4m3 codes
of k / k_scale and v / v_scale byte for byte as their torch references do, and paged attention
over the e4m3 cache equals attention over its upcast values, and stays within a stated bound
of attention over the bf16 cache it was written from (mixed prefill and decode, contexts
across page boundaries, flash-decoding splits)."""

import pytest
import torch

from gpu.kernels.triton.kv_cache import write_kv, write_kv_ref
from gpu.kernels.triton.paged_attention import paged_attention, paged_attention_ref
from gpu.kernels.triton.qkv_prep import prepare_qkv, prepare_qkv_ref
from tests.support.paged_batches import _make_batch
from tests.support.qkv_inputs import _inputs

FP8 = torch.float8_e4m3fn


def _bytes(t):
    return t.cpu().view(torch.uint8)


def test_write_kv_stores_scaled_e4m3_codes(device):
    g = torch.Generator().manual_seed(0)
    T, hkv, dh, page, blocks = 7, 2, 32, 4, 5
    k = (torch.randn(T, hkv, dh, generator=g) * 200).to(torch.bfloat16)    # some past 448 * k_scale: saturated
    v = torch.randn(T, hkv, dh, generator=g).to(torch.bfloat16)
    slots = torch.tensor([3, -1, 0, 17, 8, 9, 19])
    caches = [torch.zeros(blocks, page, hkv, dh, dtype=FP8) for _ in range(4)]
    d = lambda t: t.to(device)  # noqa: E731
    kc, vc = d(caches[0]), d(caches[1])
    write_kv(d(k), d(v), kc, vc, d(slots), k_scale=0.5, v_scale=0.03125)
    write_kv_ref(k, v, caches[2], caches[3], slots, 0.5, 0.03125)
    assert torch.equal(_bytes(kc), _bytes(caches[2])) and torch.equal(_bytes(vc), _bytes(caches[3]))
    assert caches[2].float().abs().max() == 448.0                            # saturated, not NaN


def test_prepare_qkv_stores_scaled_e4m3_codes_as_the_unfused_path(device, tol):
    args = _inputs(9, 4, 2, 32, 8, True, torch.bfloat16, device)
    args[9], args[10] = (torch.zeros(args[9].shape, dtype=FP8, device=device) for _ in range(2))
    ref_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    q = prepare_qkv(*args, k_scale=2.0, v_scale=0.25)
    q_ref = prepare_qkv_ref(*ref_args, k_scale=2.0, v_scale=0.25)
    torch.testing.assert_close(q, q_ref, **tol(torch.bfloat16))
    assert torch.equal(_bytes(args[10]), _bytes(ref_args[10]))                 # v: copied, then rounded alike
    # k: the fused norm and rotation round to bf16 within an ulp of the unfused ones (the
    # bf16 test's tolerance), which can move the e4m3 code by one step (2^-3 relative at most)
    k, k_ref = args[9].float().cpu(), ref_args[9].float()
    assert k.abs().max() > 0 and bool(((k - k_ref).abs() <= k_ref.abs() * 0.125).all())


@pytest.mark.parametrize("q_lens,seq_lens,splits", [([1, 6, 1], [9, 22, 40], 1), ([1, 1], [17, 33], 2)],
                         ids=["mixed", "decode-split2"])
def test_paged_attention_over_an_e4m3_cache(device, q_lens, seq_lens, splits):
    """Pages of 8: every context crosses a page boundary. Scales: k 0.25, v 0.5."""
    q, kc, vc, bt, cu, sl = _make_batch(q_lens, seq_lens, 4, 2, 32, 8, torch.bfloat16, device, seed=4)
    k_scale, v_scale = 0.25, 0.5
    k8 = (kc.float() / k_scale).to(FP8)
    v8 = (vc.float() / v_scale).to(FP8)
    hint = 1 if max(q_lens) == 1 else None
    got = paged_attention(q, k8, v8, bt, cu, sl, 32 ** -0.5, max_seqlen_q=hint, num_kv_splits=splits,
                          k_scale=k_scale, v_scale=v_scale)
    # the cache's own values, upcast: the kernel's arithmetic
    up = paged_attention_ref(q.float(), k8.float() * k_scale, v8.float() * v_scale, bt, cu, sl, 32 ** -0.5)
    torch.testing.assert_close(got.float(), up, atol=2e-2, rtol=2e-2)
    # against the bf16 cache written from the same k and v: e4m3 keeps 3 mantissa bits (a
    # relative 2^-4 an element at most); on unit-normal q, k, v the output moves < 0.1
    bf16 = paged_attention_ref(q.float(), kc.float(), vc.float(), bt, cu, sl, 32 ** -0.5)
    err = (got.float() - bf16).abs()
    assert float(err.max()) < 0.1 and float(err.mean()) < 0.02


def test_the_triton_runner_with_an_fp8_cache_matches_the_torch_runner(tmp_path, device):
    """The CUDA path's wiring (TritonPagedAttention: the fused qkv write and paged attention
    given the cache's per-layer scales) against the CPU torch path over the same e4m3 cache,
    a tiny random Qwen3 with scales 0.5 (k) and 2 (v): mixed prefill and decode across blocks."""
    import json

    from gpu.layers.attention import KVCache
    from gpu.loader.decoder import load_model
    from gpu.worker.runner import ModelRunner
    from tests.support.triton_runs import capture_logits, two_sequence_plans
    from tests.support.tiny_runners import TINY_QWEN3

    (tmp_path / "config.json").write_text(json.dumps(TINY_QWEN3))
    lm = load_model(tmp_path, load_format="dummy", dtype="float32", device=str(device), seed=1, progress=False).model
    c = lm.config

    def make(use_triton):
        cache = KVCache(c.num_hidden_layers, 12, 4, c.num_key_value_heads, c.head_dim, FP8, device)
        cache.set_scales({i: (0.5, 2.0) for i in range(c.num_hidden_layers)})
        return ModelRunner(lm, cache, device=device, use_triton=use_triton), cache

    plans = two_sequence_plans()
    (torch_runner, torch_cache), (triton_runner, triton_cache) = make(False), make(True)
    r_torch, l_torch = capture_logits(lm, torch_runner, plans)
    r_triton, l_triton = capture_logits(lm, triton_runner, plans)
    # the torch path's prefill attends to its chunk's own k/v before rounding, the Triton path
    # reads them back from the cache: within e4m3's 2^-4 of the largest logit (measured: 2^-7)
    for x, y in zip(l_torch, l_triton):
        assert float((x - y).abs().max()) < 2.0 ** -4 * float(x.abs().max())
    assert [r.token_ids for r in r_triton] == [r.token_ids for r in r_torch]
    k_t, k_c = triton_cache.k[0].float().cpu(), torch_cache.k[0].float().cpu()
    assert k_t.abs().max() > 0 and bool(((k_t - k_c).abs() <= k_c.abs() * 0.125).all())   # one e4m3 step at most
