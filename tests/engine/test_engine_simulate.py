"""The engine on the GPU stand-in (--simulate-gpu h200): no weights are loaded, and what it
samples comes back as text. (The stand-in itself: tests/gpu/test_simulate.py.)"""
from __future__ import annotations

import math

import orjson
import pytest

from pipeline.core.config import EngineConfig
from pipeline.core.engine import open_engine


async def test_engine_serves_text_on_a_simulated_h200():
    cfg = EngineConfig(simulate_gpu="h200", max_model_len=256, max_num_seqs=4)
    async with open_engine(cfg) as engine:
        assert engine.loaded.model.embed_tokens.weight.is_meta   # no weights were loaded
        sampled: list[int] = []
        real = engine.runner.execute

        def recording(plan, staged=None):
            result = real(plan, staged)
            sampled.extend(result.token_ids)
            return result

        engine.runner.execute = recording
        reply = await engine.submit("completions", {
            "model": engine.model_names[0], "prompt": "Once upon a time", "max_tokens": 12,
            "ignore_eos": True})
        body = orjson.loads(await reply.read())
        reply = await engine.submit("completions", {
            "model": engine.model_names[0], "prompt": "Hi", "max_tokens": 3, "logprobs": 2})
        lp = orjson.loads(await reply.read())["choices"][0]["logprobs"]
    assert body["usage"]["completion_tokens"] == 12 and len(sampled) == 12 + 3
    assert body["choices"][0]["text"] == engine.loaded.tokenizer.decode(sampled[:12])
    uniform = -math.log(len(engine.runner.token_ids))
    assert lp["token_logprobs"] == pytest.approx([uniform] * 3)
    assert all(len(top) >= 1 for top in lp["top_logprobs"])
    assert body["choices"][0]["text"].strip()


async def test_the_benchmark_splits_the_stand_ins_host_time():
    """pipeline/tools/bench.py on the stand-in: the waits, the runner back late from them and
    the runner waiting for its next plan are disjoint stretches of the timed window."""
    from pipeline.tools.bench import _bench

    cfg = EngineConfig(simulate_gpu="h200", max_model_len=256, max_num_seqs=4)
    s = {"num_prompts": 4, "input_len": 16, "min_input_len": 16, "output_len": 8, "min_output_len": 8,
         "seed": 0, "ignore_eos": True}
    r = await _bench(cfg, s, 0.6)
    assert r["failed_requests"] == 0 and r["gpu_steps"] >= 8
    assert r["late_ms_per_step"] >= 0 and r["starved_ms_per_step"] > 0
    assert r["late_ms_per_step"] + r["starved_ms_per_step"] <= r["host_ms_per_step"] + 1e-3
