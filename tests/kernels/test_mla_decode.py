"""The MLA decode kernel (gpu/kernels/triton/mla_decode.py) against its torch reference, and
DeepSeek-V3's latent attention through the Triton backend (gpu/layers/attention.py
TritonPagedAttention) against naive attention over per-head expanded K/V, at every cache
length across block boundaries, in mixed steps (a prefill, a short chunk) and split."""
import attrs
import pytest
import torch

from gpu.interface import SeqChunk
from gpu.kernels.triton.mla_decode import mla_decode, mla_decode_ref
from gpu.layers.attention import KVCache, TritonPagedAttention
from gpu.layers.mla import mla_reference
from gpu.layers.ops import build_rope_cache
from gpu.worker.staging import prepare_step
from tests.support.mla_models import _layer, _tiny_config


@pytest.mark.parametrize("dtype,splits", [(torch.float32, 1), (torch.float32, 3), (torch.bfloat16, 1)])
def test_kernel_matches_reference(device, tol, dtype, splits):
    """Rows of 0 (a graph's padding), 1, 7 and 13 cached tokens in shuffled pages of 4; 5 heads
    (a partial head tile), a latent of 40 and a rotary part of 8 (neither a power of two)."""
    g = torch.Generator().manual_seed(0)
    lens, bs, H, R, P = [0, 1, 7, 13], 4, 5, 40, 8
    cache = torch.randn(20, bs, 1, R + P, generator=g).to(dtype)
    tables = torch.randperm(20, generator=g)[:len(lens) * 4].view(len(lens), 4).to(torch.int32)
    q = torch.randn(len(lens), H, R + P, generator=g).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    args = [t.to(device) for t in (q, cache, tables, seq_lens)]
    got = mla_decode(*args, 0.2, R, num_kv_splits=splits)
    want = mla_decode_ref(*args, 0.2, R)
    assert got.shape == (len(lens), H, R) and got.dtype == dtype
    assert torch.all(got[0] == 0)
    torch.testing.assert_close(got.float(), want.float(), **tol(dtype))


def test_latent_attention_on_the_triton_backend_matches_naive_expanded_attention(device):
    """Sequence a: a prompt of 2 tokens, then one token a step up to 10 (blocks of 4: boundaries
    after 4 and 8), every row against the naive reference. Sequence b joins a's steps: a
    prompt of 3 (a prefill row beside a's decode), later a chunk of 2 after its cache (rows
    that attend as decodes), then one decode with 2 KV splits."""
    c = _tiny_config()
    attn = _layer(c).to(device)
    bs, Ta, Tb = 4, 10, 6
    g = torch.Generator().manual_seed(1)
    xa, xb = (torch.randn(T, c.hidden_size, generator=g).to(device) for T in (Ta, Tb))
    cos_sin = build_rope_cache(c, 64, device)
    want_a, want_b = mla_reference(attn, xa, cos_sin), mla_reference(attn, xb, cos_sin)
    cache = KVCache(1, 8, bs, 1, c.kv_cache_head_dim, torch.float32, device, latent=c.kv_cache_latent)
    backend = TritonPagedAttention(cache, c.head_dim ** -0.5)
    tables = {"a": (3, 1, 5), "b": (7, 2)}
    b_steps = {3: (0, 3), 5: (3, 5), 7: (5, 6)}        # a's step end -> b's chunk [start, end)
    got = {"a": [], "b": []}
    with torch.inference_mode():
        start = 0
        for end in [2, *range(3, Ta + 1)]:
            spans = [("a", xa, start, end)] + ([("b", xb, *b_steps[end])] if end in b_steps else [])
            chunks = tuple(SeqChunk(s, tuple(range(lo, hi)), lo, tables[s][:-(-hi // bs)], True)
                           for s, _, lo, hi in spans)
            _, positions, meta, _ = prepare_step(chunks, bs, torch.device(device))
            if end == 7:
                assert meta.max_seqlen_q == 1
                meta = attrs.evolve(meta, num_kv_splits=2)
            backend.prepare(meta)
            out = attn(torch.cat([x[lo:hi] for _, x, lo, hi in spans]), positions, cos_sin, backend)
            at = 0
            for s, _, lo, hi in spans:
                got[s].append(out[at:at + hi - lo])
                at += hi - lo
            start = end
    torch.testing.assert_close(torch.cat(got["a"]), want_a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat(got["b"]), want_b, atol=1e-4, rtol=1e-4)


def test_deepseek_v3_on_the_triton_runner_matches_the_torch_runner(tmp_path, device):
    """The runner's CUDA path (gpu/worker/runner.py use_triton: the latent cache through
    TritonPagedAttention) against its torch path on a tiny DeepSeek-V3: a mixed step (a's
    chunk, b's whole prompt), a step of b's decode beside a's last chunk, then a pure decode
    step; logits to 1e-4 and the same greedy tokens."""
    from gpu.loader.decoder import load_model
    from gpu.worker.runner import ModelRunner
    from tests.support.triton_runs import capture_logits, two_sequence_plans
    from tests.support.moe_models import make_moe_model

    make_moe_model("deepseek_v3", tmp_path)
    lm = load_model(tmp_path, dtype="float32", device=str(device), progress=False).model
    c = lm.config

    def runner(use_triton):
        cache = KVCache(c.num_hidden_layers, 12, 4, 1, c.kv_cache_head_dim, torch.float32, device,
                        latent=c.kv_cache_latent)
        return ModelRunner(lm, cache, device=device, use_triton=use_triton)

    plans = two_sequence_plans(third_step=True)
    r_torch, l_torch = capture_logits(lm, runner(False), plans)
    r_triton, l_triton = capture_logits(lm, runner(True), plans)
    assert len(l_triton) == 3
    for x, y in zip(l_torch, l_triton):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)
    assert [r.token_ids for r in r_triton] == [r.token_ids for r in r_torch]
