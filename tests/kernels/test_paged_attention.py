import itertools

import pytest
import torch

from gpu.kernels.triton import paged_attention as paged_attention_module
from gpu.kernels.triton.paged_attention import paged_attention, paged_attention_ref
from tests.support.paged_batches import _make_batch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


CASES = {
    # name: (q_lens, seq_lens, Hq, Hkv, Dh, page_size)
    "mixed_gqa3_d64": ([1, 5, 17, 1], [9, 20, 40, 33], 6, 2, 64, 16),
    "prefix_chunk_mha_d128": ([3, 13], [50, 13], 2, 2, 128, 16),
    "decode_gqa4_page8": ([1, 1, 1], [1, 17, 30], 8, 2, 64, 8),
    "empty_and_page32": ([0, 7, 1], [5, 39, 70], 4, 1, 64, 32),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_matches_ref(case, dtype, device, tol):
    q_lens, seq_lens, hq, hkv, dh, page = CASES[case]
    q, kc, vc, bt, cu, sl = _make_batch(q_lens, seq_lens, hq, hkv, dh, page, dtype, device)
    scale = dh ** -0.5
    out = paged_attention(q, kc, vc, bt, cu, sl, scale)
    ref = paged_attention_ref(q, kc, vc, bt, cu, sl, scale)
    torch.testing.assert_close(out, ref, **tol(dtype))


@pytest.mark.parametrize("max_seqlen_q", [1, 4])
def test_paged_attention_tile_hints(max_seqlen_q, device, tol):
    """The host hint only changes the tiling, not the result."""
    q_lens = [1, 1] if max_seqlen_q == 1 else [4, 1, 3]
    seq_lens = [23, 6] if max_seqlen_q == 1 else [4, 40, 19]
    q, kc, vc, bt, cu, sl = _make_batch(q_lens, seq_lens, 6, 2, 64, 16, torch.float16, device, seed=1)
    out = paged_attention(q, kc, vc, bt, cu, sl, 0.125, max_seqlen_q=max_seqlen_q)
    torch.testing.assert_close(out, paged_attention_ref(q, kc, vc, bt, cu, sl, 0.125), **tol(torch.float16))


def test_paged_attention_strided_q_and_out(device, tol):
    """q as a view into a fused qkv projection, out written into a preallocated buffer."""
    q_lens, seq_lens = [2, 5], [7, 21]
    q, kc, vc, bt, cu, sl = _make_batch(q_lens, seq_lens, 4, 2, 64, 16, torch.float32, device, seed=2)
    T = q.shape[0]
    qkv = torch.randn(T, (4 + 2 + 2) * 64, device=device)
    qkv[:, :4 * 64] = q.reshape(T, -1)
    q_view = qkv[:, :4 * 64].view(T, 4, 64)
    out = torch.full((T, 4, 64), float("nan"), device=device)
    paged_attention(q_view, kc, vc, bt, cu, sl, 0.125, out=out)
    torch.testing.assert_close(out, paged_attention_ref(q, kc, vc, bt, cu, sl, 0.125), **tol(torch.float32))


def test_paged_attention_ref_matches_dense_sdpa():
    """The reference itself: one sequence prefilled from scratch equals causal SDPA."""
    q_lens = seq_lens = [11]
    q, kc, vc, bt, cu, sl = _make_batch(q_lens, seq_lens, 4, 2, 64, 16, torch.float32, "cpu", seed=3)
    ref = paged_attention_ref(q, kc, vc, bt, cu, sl, 0.125)
    pos = torch.arange(11)
    k = kc[bt[0].long()[pos // 16], pos % 16].repeat_interleave(2, dim=1)
    v = vc[bt[0].long()[pos // 16], pos % 16].repeat_interleave(2, dim=1)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=0.125)
    torch.testing.assert_close(ref, dense.transpose(0, 1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_kv_splits", [2, 5])
def test_paged_attention_split_kv_matches_ref(num_kv_splits, dtype, device, tol):
    """Flash-decoding path: splits of unequal share, some empty (short contexts), mixed with a prefill."""
    q_lens, seq_lens = [1, 1, 1, 4], [3, 70, 33, 40]
    q, kc, vc, bt, cu, sl = _make_batch(q_lens, seq_lens, 6, 2, 64, 16, dtype, device, seed=4)
    out = paged_attention(q, kc, vc, bt, cu, sl, 0.125, num_kv_splits=num_kv_splits)
    torch.testing.assert_close(out, paged_attention_ref(q, kc, vc, bt, cu, sl, 0.125), **tol(dtype))


def test_suggest_num_kv_splits_is_one_off_cuda():
    assert paged_attention_module.suggest_num_kv_splits(1, 3, 4096, torch.device("cpu")) == 1


# gpt-oss: sinks and sliding windows (windows shorter than, across and longer than a KV tile).
SINK_WINDOW_CASES = {
    # name: (q_lens, seq_lens, window, sinks)
    "window3_sinks_mixed": ([1, 5, 17, 1], [9, 20, 40, 33], 3, True),
    "window20_no_sinks": ([1, 13, 4], [50, 13, 70], 20, False),
    "sinks_full": ([2, 1, 9], [7, 40, 9], None, True),
    "window_over_context": ([6, 1], [6, 12], 64, True),
}


def _sinks(hq, device, seed=5):
    return (torch.randn(hq, generator=torch.Generator().manual_seed(seed)) * 2).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(SINK_WINDOW_CASES))
def test_paged_attention_sinks_and_window_match_ref(case, dtype, device, tol):
    q_lens, seq_lens, window, with_sinks = SINK_WINDOW_CASES[case]
    q, kc, vc, bt, cu, sl = _make_batch(q_lens, seq_lens, 6, 2, 64, 8, dtype, device, seed=6)
    sinks = _sinks(6, device) if with_sinks else None
    out = paged_attention(q, kc, vc, bt, cu, sl, 0.125, sinks=sinks, window=window)
    ref = paged_attention_ref(q, kc, vc, bt, cu, sl, 0.125, sinks=sinks, window=window)
    torch.testing.assert_close(out, ref, **tol(dtype))
    if window is not None and window < max(seq_lens):  # the window must change the result
        assert not torch.allclose(ref, paged_attention_ref(q, kc, vc, bt, cu, sl, 0.125, sinks=sinks))


@pytest.mark.parametrize("num_kv_splits", [2, 5])
def test_paged_attention_split_kv_with_sinks_and_window(num_kv_splits, device, tol):
    """The sink is counted once across splits; windowed splits start at the window."""
    q_lens, seq_lens = [1, 1, 1, 4], [3, 70, 33, 40]
    q, kc, vc, bt, cu, sl = _make_batch(q_lens, seq_lens, 6, 2, 64, 16, torch.float32, device, seed=7)
    sinks = _sinks(6, device)
    for window in (None, 10, 45):
        out = paged_attention(q, kc, vc, bt, cu, sl, 0.125, num_kv_splits=num_kv_splits, sinks=sinks, window=window)
        ref = paged_attention_ref(q, kc, vc, bt, cu, sl, 0.125, sinks=sinks, window=window)
        torch.testing.assert_close(out, ref, **tol(torch.float32))


def test_paged_attention_ref_sinks_match_transformers_eager():
    """The reference's sink against gpt-oss's own formulation: softmax over [scores, sink] with
    the sink column dropped (transformers' eager_attention_forward), on one full sequence."""
    q_lens = seq_lens = [9]
    q, kc, vc, bt, cu, sl = _make_batch(q_lens, seq_lens, 4, 4, 16, 16, torch.float32, "cpu", seed=8)
    sinks = _sinks(4, "cpu")
    ref = paged_attention_ref(q, kc, vc, bt, cu, sl, 0.25, sinks=sinks, window=4)
    k, v = kc[bt[0, 0].long(), :9], vc[bt[0, 0].long(), :9]                    # [9, H, D]
    scores = torch.einsum("qhd,khd->hqk", q, k) * 0.25
    i = torch.arange(9)
    scores = scores.masked_fill((i[None, :] > i[:, None]) | (i[None, :] <= i[:, None] - 4), float("-inf"))
    logits = torch.cat([scores, sinks.reshape(4, 1, 1).expand(4, 9, 1)], dim=-1)
    probs = (logits - logits.amax(-1, keepdim=True)).softmax(-1)[..., :-1]
    torch.testing.assert_close(ref, torch.einsum("hqk,khd->qhd", probs, v), atol=1e-5, rtol=1e-5)


# Pure decode (max_seqlen_q=1): _decode_attention_kernel, grid (sequence, KV head, split).
DECODE_CASES = {
    # name: (seq_lens, Hq, Hkv, Dh, page_size, splits)
    "gqa3_d80_page7": ([1, 64, 65, 130, 9], 9, 3, 80, 7, 1),        # Dh not a power of two
    "gqa2_d128_split3": ([1, 200, 63, 64], 4, 2, 128, 16, 3),       # tile edges at 64
    "mha_d64_split16_empty": ([2, 70, 5], 2, 2, 64, 16, 16),        # most splits see nothing
    "gqa8_d32_page1": ([3, 33], 8, 1, 32, 1, 2),                    # one token a page
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_kernel_matches_ref(case, dtype, device, tol):
    seq_lens, hq, hkv, dh, page, splits = DECODE_CASES[case]
    q, kc, vc, bt, cu, sl = _make_batch([1] * len(seq_lens), seq_lens, hq, hkv, dh, page, dtype, device, seed=9)
    out = paged_attention(q, kc, vc, bt, cu, sl, dh ** -0.5, max_seqlen_q=1, num_kv_splits=splits)
    torch.testing.assert_close(out, paged_attention_ref(q, kc, vc, bt, cu, sl, dh ** -0.5), **tol(dtype))


def test_decode_kernel_sinks_and_window(device, tol):
    seq_lens = [1, 40, 90]
    q, kc, vc, bt, cu, sl = _make_batch([1] * 3, seq_lens, 6, 2, 64, 16, torch.float32, device, seed=10)
    sinks = _sinks(6, device)
    for splits, window in ((1, None), (1, 10), (4, 70), (4, None)):
        out = paged_attention(q, kc, vc, bt, cu, sl, 0.125, max_seqlen_q=1, num_kv_splits=splits,
                              sinks=sinks, window=window)
        ref = paged_attention_ref(q, kc, vc, bt, cu, sl, 0.125, sinks=sinks, window=window)
        torch.testing.assert_close(out, ref, **tol(torch.float32))


def test_decode_kernel_head_major_cache_layout(device, tol):
    """A cache kept as [blocks, Hkv, block_size, Dh] (one run per head and page), passed as
    its transposed view: the kernels take any strides."""
    seq_lens = [5, 47]
    q, kc, vc, bt, cu, sl = _make_batch([1, 1], seq_lens, 4, 2, 64, 16, torch.float32, device, seed=11)
    kh, vh = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()     # head-major storage
    out = paged_attention(q, kh.transpose(1, 2), vh.transpose(1, 2), bt, cu, sl, 0.125, max_seqlen_q=1)
    torch.testing.assert_close(out, paged_attention_ref(q, kc, vc, bt, cu, sl, 0.125), **tol(torch.float32))


def test_decode_promise_is_checked(device):
    q, kc, vc, bt, cu, sl = _make_batch([2, 1], [5, 9], 2, 1, 16, 16, torch.float32, device, seed=12)
    with pytest.raises(AssertionError, match="one query per sequence"):
        paged_attention(q, kc, vc, bt, cu, sl, 0.25, max_seqlen_q=1)


# Non-causal mode (an encoder's bidirectional attention, issue 32).
NONCAUSAL_CASES = {
    # name: (q_lens, seq_lens, Hq, Hkv, Dh, page_size)
    "encoder_pages1": ([5, 1, 17, 9], [5, 1, 17, 9], 4, 4, 32, 1),   # the encoder's layout
    "encoder_gqa2_page8": ([3, 20], [3, 20], 4, 2, 16, 8),
    "with_context": ([2, 6], [9, 6], 2, 1, 32, 4),   # queries also see a cached prefix, and later keys
}


def _dense_noncausal(q, kc, vc, bt, cu, sl, scale):
    """Each sequence's keys gathered and one full (unmasked) SDPA call per sequence."""
    _, page, hkv, _ = kc.shape
    group = q.shape[1] // hkv
    out = torch.empty_like(q)
    for b, n in enumerate(sl.tolist()):
        s, e = int(cu[b]), int(cu[b + 1])
        pos = torch.arange(n)
        pages = bt[b].long()[pos // page]
        k = kc[pages, pos % page].float().repeat_interleave(group, dim=1)
        v = vc[pages, pos % page].float().repeat_interleave(group, dim=1)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[s:e].float().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=scale)
        out[s:e] = o.transpose(0, 1).to(q.dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(NONCAUSAL_CASES))
def test_paged_attention_noncausal_matches_dense(case, dtype, device, tol):
    q_lens, seq_lens, hq, hkv, dh, page = NONCAUSAL_CASES[case]
    q, kc, vc, bt, cu, sl = _make_batch(q_lens, seq_lens, hq, hkv, dh, page, dtype, device, seed=9)
    scale = dh ** -0.5
    out = paged_attention(q, kc, vc, bt, cu, sl, scale, causal=False, max_seqlen_q=max(q_lens))
    dense = _dense_noncausal(q.cpu(), kc.cpu(), vc.cpu(), bt.cpu(), cu.cpu(), sl.cpu(), scale)
    torch.testing.assert_close(out.cpu(), dense, **tol(dtype))
    ref = paged_attention_ref(q, kc, vc, bt, cu, sl, scale, causal=False)
    torch.testing.assert_close(ref.cpu(), dense, **tol(dtype))
    # and it is not the causal answer
    assert not torch.allclose(out.float(), paged_attention(q, kc, vc, bt, cu, sl, scale).float(), atol=1e-3)


def test_paged_attention_noncausal_refuses_a_window(device):
    q, kc, vc, bt, cu, sl = _make_batch([3], [3], 2, 2, 16, 4, torch.float32, device)
    with pytest.raises(AssertionError, match="causal"):
        paged_attention(q, kc, vc, bt, cu, sl, 0.25, causal=False, window=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_softcap_matches_ref_prefill_and_decode(dtype, device, tol):
    """Gemma 2's soft-capping (cap * tanh(s / cap) on the scaled scores), with a window and
    split KV too; a cap of 0.5 against scores of about 1 changes the result."""
    q, kc, vc, bt, cu, sl = _make_batch([1, 7, 20], [9, 30, 20], 6, 2, 64, 8, dtype, device, seed=11)
    for window in (None, 5):
        out = paged_attention(q, kc, vc, bt, cu, sl, 0.125, window=window, softcap=0.5)
        ref = paged_attention_ref(q, kc, vc, bt, cu, sl, 0.125, window=window, softcap=0.5)
        torch.testing.assert_close(out, ref, **tol(dtype))
        assert not torch.allclose(ref.float(), paged_attention_ref(q, kc, vc, bt, cu, sl, 0.125, window=window).float(),
                                  atol=1e-3)
    q, kc, vc, bt, cu, sl = _make_batch([1] * 3, [1, 40, 90], 6, 2, 64, 16, dtype, device, seed=12)
    for splits in (1, 3):
        out = paged_attention(q, kc, vc, bt, cu, sl, 0.125, max_seqlen_q=1, num_kv_splits=splits, softcap=0.5)
        torch.testing.assert_close(out, paged_attention_ref(q, kc, vc, bt, cu, sl, 0.125, softcap=0.5), **tol(dtype))
