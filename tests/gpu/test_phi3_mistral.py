"""Phi-3/Phi-4 (fused qkv_proj and gate_up_proj, LongRoPE, partial rotary) and Mistral with a
sliding window, from tiny random HF checkpoints, against transformers' logits; Phi-4-mini-
like greedy tokens through the engine with chunked prefill and preemption."""
from __future__ import annotations

import orjson
import pytest
import torch
import trio

from gpu.layers.attention import KVCache
from gpu.loader.decoder import load_model
from tests.support.hf_models import hf_logits, make_hf_model, our_logits
from pipeline.core.config import EngineConfig
from pipeline.core.engine import open_engine

IDS = [3, 17, 42, 99, 5, 150, 7, 63, 21, 88, 130, 1, 64, 9, 33, 120, 77, 2, 45, 101] * 2  # 40 tokens
# LongRoPE at test scale: 8 frequencies (head_dim 16), an original length of 64 within which
# the short factors serve (transformers switches to the long ones past it, for whole sequences)
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
            "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0]}
CASES = {
    "phi3": ("phi3", dict(head_dim=16)),
    "phi3-longrope": ("phi3", dict(head_dim=16, max_position_embeddings=256, rope_parameters=LONGROPE)),
    "phi4-mini-partial": ("phi3", dict(head_dim=16, tie_word_embeddings=True, rope_parameters={
        **LONGROPE, "partial_rotary_factor": 0.5, "short_factor": [1.0, 1.2, 1.5, 2.0],
        "long_factor": [1.0, 2.0, 4.0, 8.0]}, max_position_embeddings=256)),
    "mistral-sliding": ("mistral", dict(head_dim=16, sliding_window=6)),
}


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(case, tmp_path):
    arch, overrides = CASES[case]
    hf = make_hf_model(arch, tmp_path, **overrides)
    loaded = load_model(tmp_path, dtype="float32", progress=False)
    c = loaded.config
    assert c.architecture == ("llama" if arch == "mistral" else "phi3")
    if case == "phi4-mini-partial":
        assert c.rotary_dim == 8 and c.rope_scaling_dict["rope_type"] == "longrope"
    if arch == "mistral":
        assert c.sliding_window == 6 and set(c.layer_types) == {"sliding_attention"}
    torch.testing.assert_close(our_logits(loaded.model, IDS), hf_logits(hf, IDS), atol=1e-4, rtol=1e-4)


async def test_engine_greedy_matches_transformers_with_chunks_and_preemption(tmp_path):
    arch, overrides = CASES["phi4-mini-partial"]
    hf = make_hf_model(arch, tmp_path, seed=3, **overrides)
    prompts = [[(i * k + 5) % 150 + 3 for i in range(30)] for k in (3, 5, 7)]
    n = 30       # 60 tokens: within the original 64, where both use the short factors
    with torch.inference_mode():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    c = hf.config
    per_block = KVCache.bytes_per_block(c.num_hidden_layers, 16, c.num_key_value_heads, 16, torch.float32)
    cfg = EngineConfig(model=str(tmp_path), dtype="float32", max_model_len=128, max_num_seqs=3,
                       max_num_batched_tokens=16, kv_cache_memory_bytes=8 * per_block)
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
        preemptions = engine.stats().num_preemptions
    assert preemptions > 0
    assert outs == want
