"""The engine serving tiny random Qwen3-MoE, Mixtral, DeepSeek-V3 (latent KV cache) and Llama 4 checkpoints: greedy tokens equal
transformers' generate under chunked prefill, a KV cache small enough to preempt, and a
prefix-cache hit. (The models against transformers' logits: tests/gpu/test_moe_families.py.)"""
from __future__ import annotations

import sys
from pathlib import Path

import orjson
import pytest
import torch
import trio

from pipeline.core.config import EngineConfig
from pipeline.core.engine import open_engine

from tests.support.moe_models import make_moe_model

PROMPTS = [[(7 * i + 11 * j) % 150 + 3 for j in range(20 + 3 * i)] for i in range(5)]   # 20..32 tokens
NEW = 10


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "deepseek_v3", "llama4"])
async def test_greedy_tokens_match_transformers_under_chunking_and_preemption(kind, tmp_path):
    hf = make_moe_model(kind, tmp_path, seed=3)
    want = []
    with torch.inference_mode():
        for p in PROMPTS:
            out = hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
            want.append(out[0, len(p):].tolist())

    cfg = EngineConfig(model=str(tmp_path), dtype="float32", max_model_len=64, max_num_seqs=5,
                       max_num_batched_tokens=16, block_size=8, num_gpu_blocks_override=8,
                       enable_prompt_tokens_details=True)
    got: list[list[int] | None] = [None] * len(PROMPTS)
    async with open_engine(cfg) as engine:
        async def one(i: int) -> None:
            got[i] = await _tokens(engine, PROMPTS[i])

        async with trio.open_nursery() as reqs:
            for i in range(len(PROMPTS)):
                reqs.start_soon(one, i)
        preemptions = engine.stats().num_preemptions
        await _tokens(engine, PROMPTS[4])
        again = await _tokens(engine, PROMPTS[4], details=True)
    assert preemptions > 0                     # 5 x 4-6 blocks of 8 do not fit 8
    assert got == want
    tokens, cached = again
    assert tokens == want[4] and cached == 24  # three whole blocks of the 32-token prompt


async def _tokens(engine, prompt, details=False):
    body = {"model": engine.model_names[0], "prompt": prompt, "max_tokens": NEW, "temperature": 0,
            "ignore_eos": True, "logprobs": 1}
    out = orjson.loads(await (await engine.submit("completions", body)).read())
    tokens = [int(t.removeprefix("token_id:")) for t in out["choices"][0]["logprobs"]["tokens"]]
    if details:
        return tokens, out["usage"]["prompt_tokens_details"]["cached_tokens"]
    return tokens
