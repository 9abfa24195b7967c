"""The engine serving a tiny random gpt-oss checkpoint (sliding window 6, 3 layers): prefix
caching through the real scheduler and block manager. (The model itself, against
transformers: tests/gpu/test_gpt_oss.py.)"""
from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from pipeline.core.config import EngineConfig
from pipeline.core.engine import open_engine

from tests.support.hf_models import make_hf_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gpt_oss")
    make_hf_model("gpt_oss", path)
    return path


async def test_engine_prefix_cache_hit_same_logprobs_as_cold(checkpoint):
    """The real scheduler and block manager: a second identical prompt reuses cached blocks,
    including those the sliding layers read, and samples with the same logprobs as a cold run."""
    prompt = [i % 150 + 3 for i in range(0, 7 * 37, 7)]                   # 37 tokens, 2 whole blocks of 16
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 3, "ignore_eos": True}

    async def run(engine):
        reply = await engine.submit("completions", {"model": engine.model_names[0], **body})
        return orjson.loads(await reply.read())

    cfg = dict(model=str(checkpoint), dtype="float32", max_model_len=128, max_num_seqs=4,
               enable_prompt_tokens_details=True)
    async with open_engine(EngineConfig(**cfg, enable_prefix_caching=False)) as engine:
        cold = await run(engine)
    async with open_engine(EngineConfig(**cfg)) as engine:
        first, second = await run(engine), await run(engine)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    for out in (first, second):
        got, want = out["choices"][0]["logprobs"], cold["choices"][0]["logprobs"]
        assert got["tokens"] == want["tokens"]
        assert got["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-4)
