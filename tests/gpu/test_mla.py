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

CONFIGS = Path(gpu.__file__).parent / "configs"


def _tiny_config():
    import transformers

    cls, kw = MOE["deepseek_v3"]
    d = getattr(transformers, cls)(**{**BASE, **kw}).to_dict()
    return config_from_hf({**d, "architectures": ["DeepseekV3ForCausalLM"]})


def _layer(c, seed=0):
    g = torch.Generator().manual_seed(seed)
    attn = LatentAttention(c, 0, torch.float32, "cpu")
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if "norm" in name
                    else torch.randn(p.shape, generator=g) * 0.3)
    return attn


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
