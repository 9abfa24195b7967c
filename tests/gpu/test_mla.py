"""Multi-head latent attention (gpu/layers/mla.py) and the DeepSeek-V3 family: the absorbed
decode over the paged latent cache against naive attention over per-head expanded K/V at
every cache length across block boundaries; the cache's bytes a token; the real config."""
import json
from pathlib import Path

import pytest
import torch

import gpu
from gpu.interface import SeqChunk
from gpu.layers.attention import KVCache, TorchPagedAttention
from gpu.layers.mla import LatentAttention, mla_reference
from gpu.layers.ops import build_rope_cache
from gpu.models.registry import config_from_hf
from gpu.worker.staging import prepare_step
from tests.support.moe_models import BASE, MOE
from tests.support.mla_models import _layer, _tiny_config

CONFIGS = Path(gpu.__file__).parent / "configs"


@pytest.mark.parametrize("prefill", [1, 5])
@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_paged_latent_decode_matches_naive_expanded_attention(prefill, cpu_kernels):
    """A prompt of `prefill` tokens, then one token a step up to 13: blocks of 4 (boundaries
    after 4, 8 and 12 cached tokens), every step's row against the naive reference."""
    c = _tiny_config()
    attn = _layer(c)
    T, bs = 13, 4
    x = torch.randn(T, c.hidden_size, generator=torch.Generator().manual_seed(1))
    cos_sin = build_rope_cache(c, 64, "cpu")
    want = mla_reference(attn, x, cos_sin)                                         # [T, D]
    cache = KVCache(1, 6, bs, 1, c.kv_cache_head_dim, torch.float32, "cpu", latent=c.kv_cache_latent)
    assert cache.v[0].data_ptr() == cache.k[0].data_ptr() and cache.v[0].shape[-1] == 32
    backend = TorchPagedAttention(cache, c.head_dim ** -0.5, cpu_kernels=cpu_kernels)
    table = (3, 1, 5, 2)
    rows, start = [], 0
    with torch.inference_mode():
        for end in [prefill, *range(prefill + 1, T + 1)]:
            chunk = SeqChunk("a", tuple(range(start, end)), start, table[:-(-end // bs)], True)
            _, positions, meta, _ = prepare_step((chunk,), bs, torch.device("cpu"))
            backend.prepare(meta)
            rows.append(attn(x[start:end], positions, cos_sin, backend))
            start = end
    torch.testing.assert_close(torch.cat(rows), want, atol=1e-4, rtol=1e-4)


def _run_steps(attn, c, steps, cpu_kernels, bs=4):
    """steps: per step, (sequence id, its x rows, first position, end position, block table)
    per chunk; the output rows of every chunk by sequence, in order."""
    cos_sin = build_rope_cache(c, 64, "cpu")
    cache = KVCache(1, 16, bs, 1, c.kv_cache_head_dim, torch.float32, "cpu", latent=c.kv_cache_latent)
    backend = TorchPagedAttention(cache, c.head_dim ** -0.5, cpu_kernels=cpu_kernels)
    out: dict[str, list[torch.Tensor]] = {}
    with torch.inference_mode():
        for step in steps:
            chunks = tuple(SeqChunk(sid, tuple(range(a, b)), a, table[:-(-b // bs)], True)
                           for sid, _, a, b, table in step)
            _, positions, meta, _ = prepare_step(chunks, bs, torch.device("cpu"))
            backend.prepare(meta)
            y = attn(torch.cat([x[a:b] for _, x, a, b, _ in step]), positions, cos_sin, backend)
            at = 0
            for sid, _, a, b, _ in step:
                out.setdefault(sid, []).append(y[at:at + b - a])
                at += b - a
    return {sid: torch.cat(rows) for sid, rows in out.items()}


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_expanded_prefill_equals_absorbed_under_chunking_and_a_prefix_cache_hit(cpu_kernels):
    """Sequence a: a 6-token chunk, a 10-token chunk after its cached 6 (expanded over the
    latent read back from the cache), then a decode row beside b's prefill; b shares a's first
    three blocks (12 tokens, a prefix-cache hit) and prefills 10 new tokens over them in the
    same step as a's decode; then a's 3-token chunk (a verify-sized chunk: absorbed rows) and
    b's decode. Prefill rows expanded (the default) and absorbed (expand_prefill False)
    against each other and against naive attention over each sequence, in fp32."""
    c = _tiny_config()
    attn = _layer(c)
    g = torch.Generator().manual_seed(2)
    xa = torch.randn(20, c.hidden_size, generator=g)
    xb = torch.cat([xa[:12], torch.randn(11, c.hidden_size, generator=g)])
    ta, tb = (3, 1, 5, 2, 7), (3, 1, 5, 9, 11, 12)          # b's first three blocks are a's
    steps = [[("a", xa, 0, 6, ta)], [("a", xa, 6, 16, ta)],
             [("a", xa, 16, 17, ta), ("b", xb, 12, 22, tb)],
             [("a", xa, 17, 20, ta), ("b", xb, 22, 23, tb)]]
    cos_sin = build_rope_cache(c, 64, "cpu")
    want = {"a": mla_reference(attn, xa, cos_sin), "b": mla_reference(attn, xb, cos_sin)[12:]}
    calls = []
    expand = attn._expanded
    attn._expanded = lambda *a: calls.append(a[-1]) or expand(*a)
    expanded = _run_steps(attn, c, steps, cpu_kernels)
    assert calls == [0, 6, 12]        # a's two chunks and b's, at their first positions
    attn.expand_prefill = False
    absorbed = _run_steps(attn, c, steps, cpu_kernels)
    assert calls == [0, 6, 12]
    for sid, ref in want.items():
        torch.testing.assert_close(expanded[sid], absorbed[sid], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(expanded[sid], ref, atol=1e-4, rtol=1e-4)


def test_the_backend_names_a_steps_prefills_and_reads_a_context_back():
    """TorchPagedAttention.prefill_spans: the chunks that attend as prefills (a first chunk, a
    chunk of more than SHORT_CHUNK tokens after a cached context), not decode rows or a short
    chunk; context: a sequence's cached latent rows, in position order across its blocks."""
    c = _tiny_config()
    cache = KVCache(1, 8, 4, 1, c.kv_cache_head_dim, torch.float32, "cpu", latent=c.kv_cache_latent)
    backend = TorchPagedAttention(cache, 1.0)
    chunks = (SeqChunk("a", (0,), 5, (3, 1), True), SeqChunk("b", tuple(range(9)), 2, (4, 6, 0), True),
              SeqChunk("c", (0, 1, 2), 0, (2,), True), SeqChunk("d", (0, 1), 4, (5, 7), True))
    _, _, meta, _ = prepare_step(chunks, 4, torch.device("cpu"))
    backend.prepare(meta)
    assert backend.prefill_spans() == ((1, 10, 2, 1), (10, 13, 0, 2))
    rows = torch.arange(8 * 4, dtype=torch.float32)[:, None, None].expand(-1, 1, c.kv_cache_head_dim)
    cache.k[0].copy_(rows.reshape(8, 4, 1, -1))
    ctx = backend.context(0, 1, torch.float32)                # b: 11 positions over blocks 4, 6, 0
    assert ctx[:, 0, 0].tolist() == [16, 17, 18, 19, 24, 25, 26, 27, 0, 1, 2]


def test_latent_cache_bytes_a_token():
    """DeepSeek-V3: (512 + 64) values a token and layer, 1,152 bytes in bf16; 61 layers:
    70,272 bytes a token, against 128 heads x (192 + 128) x 2 bytes = 81,920 a layer for full
    K/V (71x)."""
    c = config_from_hf(json.loads((CONFIGS / "deepseek-v3/config.json").read_text()))
    assert (c.kv_cache_head_dim, c.kv_cache_latent, c.num_hidden_layers) == (576, 512, 61)
    latent = KVCache.bytes_per_block(c.num_hidden_layers, 1, 1, c.kv_cache_head_dim, torch.bfloat16,
                                     c.kv_cache_latent)
    full = c.num_hidden_layers * c.num_attention_heads * (c.qk_nope_head_dim + c.head_dim + c.v_head_dim) * 2
    assert latent == 61 * 1152 == 70272 and full == 61 * 81920
    assert full / latent == pytest.approx(71.1, abs=0.1)


def test_real_deepseek_v3_config():
    c = config_from_hf(json.loads((CONFIGS / "deepseek-v3/config.json").read_text()))
    assert (c.architecture, c.hidden_size, c.num_experts, c.num_experts_per_tok) == ("deepseek_v3", 7168, 256, 8)
    m = c.moe
    assert (m.scoring, m.n_group, m.topk_group, m.routed_scaling_factor, m.correction_bias) == (
        "sigmoid", 8, 4, 2.5, True)
    assert m.dense_layers == (0, 1, 2) and m.shared_intermediate_size == 2048 and c.intermediate_size == 2048
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.head_dim, c.v_head_dim) == (1536, 512, 128, 64, 128)
    s = c.rope_scaling_dict
    assert (s["rope_type"], s["factor"], s["mscale_all_dim"]) == ("yarn", 40, 1.0)
    # 37B parameters active a token (DeepSeek's report), the embedding's 0.9B not a matmul
    assert c.macs_per_token + c.hidden_size * c.vocab_size == pytest.approx(37e9, rel=0.05)


def test_tensor_parallel_splits_the_heads_and_names_a_size_that_does_not_divide():
    """TP 2: each rank holds 2 of the 4 heads' up-projections and o_proj columns; the latent's
    down-projection (and so the cache's one latent row) whole on every rank."""
    from gpu.parallel import TP

    c = _tiny_config()
    attn = LatentAttention(c, 0, torch.float32, "cpu", TP(rank=1, size=2))
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (2, 1, 48)
    assert attn.kv_b_proj.weight.shape == (2 * (16 + 24), 32) and attn.q_b_proj.weight.shape == (2 * 32, 48)
    assert attn.o_proj.weight.shape == (64, 2 * 24) and attn.kv_a_proj_with_mqa.weight.shape == (48, 64)
    with pytest.raises(ValueError, match="num_attention_heads 4 is not divisible by --tensor-parallel-size 3"):
        LatentAttention(c, 0, torch.float32, "cpu", TP(rank=0, size=3))
