"""gpt-oss's sliding-window layers in a KV pool of their own (the hybrid KV cache) through
the whole engine: a request far longer than that pool frees the halves its window has passed,
with the same tokens and logprobs as with --disable-hybrid-kv-cache-manager, and a second
identical prompt still hits the prefix cache; three requests at once with preemptions give the
plain cache's output. (The runner alone: tests/gpu/test_gpt_oss_sliding_kv.py; the block
manager: tests/stages/test_sliding_blocks.py.)"""
from __future__ import annotations

import orjson
import pytest
import torch
import trio

from gpu.layers.attention import KVCache
from pipeline.core.config import EngineConfig
from pipeline.core.engine import open_engine

from tests.support.hf_models import make_hf_model

PER_BLOCK = KVCache.bytes_per_block(3, 16, 2, 16, torch.float32)   # the tiny model, fp32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss_sliding")
    make_hf_model("gpt_oss", path, seed=4)          # 3 layers: 0 and 2 sliding (window 6), 1 full
    return path


async def _run(path, hybrid: bool):
    prompt = [i % 150 + 3 for i in range(0, 7 * 37, 7)]                      # 37 tokens
    body = {"prompt": prompt, "max_tokens": 60, "temperature": 0, "logprobs": 2, "ignore_eos": True}
    cfg = EngineConfig(model=str(path), dtype="float32", max_model_len=128, max_num_seqs=1,
                       max_num_batched_tokens=16, kv_cache_memory_bytes=40 * PER_BLOCK,
                       disable_hybrid_kv_cache_manager=not hybrid,
                       enable_prompt_tokens_details=True)
    async with open_engine(cfg) as engine:
        outs = []
        for _ in range(2):
            reply = await engine.submit("completions", {"model": engine.model_names[0], **body})
            outs.append(orjson.loads(await reply.read()))
        stats = engine.stats()
        sliding = engine.blocks.sliding
        layout = (engine.blocks.num_blocks, sliding.num_slots if sliding else None)
        in_use = sliding.num_slots - sliding.available if sliding else None
    return outs, stats, layout, in_use


async def test_long_request_same_output_with_sliding_blocks_freed(model_dir):
    (plain_a, plain_b), _, plain_layout, _ = await _run(model_dir, hybrid=False)
    (a, b), stats, layout, in_use = await _run(model_dir, hybrid=True)
    assert plain_layout == (40, None)
    # 40 plain blocks' memory: 5 sliding slots (a window of 6 and a 16-token chunk, one
    # sequence) leave room for 40 * 3 - 5 * 2 = 110 full-layer blocks
    assert layout == (110, 5)
    # 97 tokens span 7 blocks, more than the 5 slots: the halves were freed as the window passed
    assert stats.num_preemptions == 0 and in_use == 0
    for got, want in ((a, plain_a), (b, plain_b)):
        g, w = got["choices"][0]["logprobs"], want["choices"][0]["logprobs"]
        assert g["tokens"] == w["tokens"] and len(g["tokens"]) == 60
        assert g["token_logprobs"] == pytest.approx(w["token_logprobs"], abs=1e-4)
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 32     # the prefix cache still hits
    assert plain_b["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


async def test_concurrent_requests_with_preemption_same_output(model_dir):
    """Three requests at once in a cache too small for them all (preemptions in both pools):
    the hybrid cache gives the plain cache's tokens and logprobs."""
    prompts = [[(i * k + 5) % 150 + 3 for i in range(37)] for k in (3, 5, 7)]

    async def run(hybrid):
        cfg = EngineConfig(model=str(model_dir), dtype="float32", max_model_len=128, max_num_seqs=3,
                           max_num_batched_tokens=16, kv_cache_memory_bytes=12 * PER_BLOCK,
                           disable_hybrid_kv_cache_manager=not hybrid)
        outs = [None] * 3
        async with open_engine(cfg) as engine:
            async def one(i):
                body = {"prompt": prompts[i], "max_tokens": 40, "temperature": 0, "logprobs": 1,
                        "ignore_eos": True}
                reply = await engine.submit("completions", {"model": engine.model_names[0], **body})
                outs[i] = orjson.loads(await reply.read())["choices"][0]["logprobs"]
            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(one, i)
            stats = engine.stats()
            layout = (engine.blocks.num_blocks, engine.blocks.sliding and engine.blocks.sliding.num_slots)
        return outs, stats.num_preemptions, layout

    plain, plain_pre, plain_layout = await run(False)
    hybrid, hybrid_pre, layout = await run(True)
    assert plain_layout == (12, None) and layout == (14, 11)
    assert plain_pre > 0 and hybrid_pre > 0
    for g, w in zip(hybrid, plain):
        assert g["tokens"] == w["tokens"]
        assert g["token_logprobs"] == pytest.approx(w["token_logprobs"], abs=1e-4)
