"""Gemma 4's text models from HF folders against transformers, on a tiny random checkpoint
(tests/support/hf_models.py TINY_GEMMA4: sliding and full layers of different head_dim and
KV heads, k = v, two shared-KV layers with double-wide MLPs, per-layer inputs): logits, the
config.json forms released checkpoints use, and greedy tokens through the engine with
chunked prefill and preemption, the shared layers owning no KV memory."""
from __future__ import annotations

import orjson
import pytest
import torch
import trio

from gpu.layers.attention import KVCache
from gpu.loader.decoder import load_model
from gpu.models.registry import config_from_hf
from pipeline.core.config import EngineConfig
from pipeline.core.engine import open_engine
from tests.support.hf_models import hf_logits, make_hf_model, our_logits

IDS = [3, 17, 42, 99, 5, 150, 7, 63, 21, 88, 130, 1, 64, 9, 33, 120, 77, 2, 45, 101] * 2  # 40 tokens


def test_logits_match_transformers(tmp_path):
    hf = make_hf_model("gemma4", tmp_path)
    loaded = load_model(tmp_path, dtype="float32", progress=False)
    c = loaded.config
    assert c.architecture == "gemma4" and (c.full_head_dim, c.full_kv_heads) == (32, 1)
    assert [c.kv_source(i) for i in range(4)] == [0, 1, 0, 1]
    assert c.kv_layer_shapes == ((2, 16), (1, 32), None, None)
    expected, got = hf_logits(hf, IDS), our_logits(loaded.model, IDS)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_released_config_forms():
    """config.json as Google's checkpoints write it (global_head_dim, num_global_key_value_heads,
    under a Gemma4ForConditionalGeneration's text_config) reads as transformers 5's per_layer_config."""
    text = make_hf_model("gemma4").config.to_dict()
    text.pop("per_layer_config")
    text.update(global_head_dim=32, num_global_key_value_heads=1)
    c = config_from_hf({"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
                        "text_config": text, "vision_config": {"hidden_size": 8}})
    assert c.architecture == "gemma4" and (c.full_head_dim, c.full_kv_heads) == (32, 1)
    assert c.rope_scaling_dict == {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    assert c.per_layer_input_size == 8 and c.double_wide_shared_mlp and c.kv_shared_layers == 2
    without_k_eq_v = config_from_hf({**text, "attention_k_eq_v": False})    # global KV heads unused then
    assert (without_k_eq_v.full_head_dim, without_k_eq_v.full_kv_heads) == (32, 0)
    with pytest.raises(ValueError, match="mixture-of-experts variant"):
        config_from_hf({**text, "enable_moe_block": True, "num_experts": 4})


async def test_engine_greedy_matches_transformers_with_chunks_and_preemption(tmp_path):
    """Three requests at once, prefilled in chunks of 16 in a cache too small for them all
    (preemptions), the sliding layers on the sliding pool: transformers' greedy tokens."""
    hf = make_hf_model("gemma4", tmp_path, seed=3)
    prompts = [[(i * k + 5) % 500 + 3 for i in range(50)] for k in (3, 5, 7)]
    n = 40
    with torch.inference_mode():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    shapes = config_from_hf(hf.config.to_dict()).kv_layer_shapes
    per_block = KVCache.bytes_per_block(4, 16, 0, 0, torch.float32, layer_shapes=shapes)
    assert per_block == 2 * 16 * 4 * (2 * 16 + 32)     # layers 0 and 1 only
    cfg = EngineConfig(model=str(tmp_path), dtype="float32", max_model_len=128, max_num_seqs=3,
                       max_num_batched_tokens=16, kv_cache_memory_bytes=14 * per_block)
    outs = [None] * 3
    async with open_engine(cfg) as engine:
        async def one(i):
            body = {"prompt": prompts[i], "max_tokens": n, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}
            reply = await engine.submit("completions", {"model": engine.model_names[0], **body})
            outs[i] = orjson.loads(await reply.read())["choices"][0]["token_ids"]
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(one, i)
        stats = engine.stats()
        sliding = engine.blocks.sliding
    assert stats.num_preemptions > 0 and sliding is not None
    assert outs == want
