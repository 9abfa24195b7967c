"""The GPU stand-in (--simulate-gpu): its cost model's arithmetic, and tokens that are
real text."""
from __future__ import annotations

import json
import math
from pathlib import Path

import orjson
import pytest
import torch

import gpu
from gpu.config import ModelConfig
from gpu.model import CausalLM
from gpu.interface import SamplingOptions, SeqChunk, SeqStart, StepPlan
from gpu.simulate import GPUS, CostModel, SimulatedRunner, ordinary_token_ids

QWEN3 = ModelConfig.from_hf(json.loads(
    (Path(gpu.__file__).parent / "configs/qwen3-0.6b/config.json").read_text()))
H200 = GPUS["h200"]


def test_weights_and_kv_sizes_of_qwen3_0_6b():
    cost = CostModel.of(QWEN3, H200)
    # counted independently: every nn.Linear weight of the model built on the meta device
    model = CausalLM(QWEN3, torch.bfloat16, "meta")
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert cost.matmul_params == linear == 595_984_384
    assert cost.weight_bytes == 1_191_968_768
    assert cost.kv_bytes_per_token == 28 * 2 * 8 * 128 * 2 == 114_688


def test_a_decode_step_reads_weights_once_and_every_sequences_kv():
    cost = CostModel.of(QWEN3, H200)
    step = cost.step_seconds([1] * 256, [1000] * 256, 256)
    weights, kv, logits = 1_191_968_768, 256 * 1000 * 114_688, 2 * 4 * 256 * 151_936
    assert step == pytest.approx((weights + kv + logits) / 4.8e12 + 0.3e-3)
    assert 6.5e-3 < step < 7e-3
    # the per-step cost alone bounds an empty-context step from below
    assert cost.step_seconds([1], [1], 1) == pytest.approx(
        (weights + 114_688 + 8 * 151_936) / 4.8e12 + 0.3e-3)


def test_a_long_prefill_is_compute_bound():
    cost = CostModel.of(QWEN3, H200)
    flops = 2 * 595_984_384 * 2048 + 4 * 28 * 16 * 128 * 2048 * 2048
    assert cost.step_seconds([2048], [2048], 1) == pytest.approx(flops / 989e12 + 0.3e-3)


def test_kv_cache_is_sized_from_the_gpus_memory():
    cost = CostModel.of(QWEN3, H200)
    expected = (141e9 * 0.9 - 1_191_968_768 - 2**31) // (114_688 * 16)
    assert cost.kv_blocks(16, 0.9) == expected == 67_335


def test_simulated_tokens_are_ordinary_and_detokenize(smollm_tokenizer):
    tok = smollm_tokenizer
    ordinary = ordinary_token_ids(tok, 49152)
    assert not set(ordinary.tolist()) & set(tok.all_special_ids)
    assert len(ordinary) > 49_000
    runner = SimulatedRunner(CostModel.of(QWEN3, H200), 16, ordinary, seed=1)
    greedy = SamplingOptions(temperature=0.0)
    prompts = {"a": tuple(range(100, 140)), "b": tuple(range(200, 217))}
    plan = StepPlan(1, tuple(SeqChunk(s, p, 0, (0, 1, 2) if s == "a" else (3, 4), True)
                             for s, p in prompts.items()),
                    tuple(SeqStart(s, p, greedy) for s, p in prompts.items()))
    out = {s: [] for s in prompts}
    waits = 0.0
    for step in range(2, 12):
        result = runner.execute(plan)
        q = [len(c.token_ids) for c in plan.chunks]
        ctx = [c.start_pos + n for c, n in zip(plan.chunks, q)]
        waits += runner.cost.step_seconds(q, ctx, len(q))
        assert result.duration_s >= runner.cost.step_seconds(q, ctx, len(q))
        for sid, t in zip(result.seq_ids, result.token_ids):
            out[sid].append(t)
        plan = StepPlan(step, tuple(SeqChunk(s, (out[s][-1],), len(p) + len(out[s]) - 1,
                                             (0, 1, 2, 3) if s == "a" else (4, 5), True)
                                    for s, p in prompts.items()))
    assert runner.waited_s == pytest.approx(waits) and runner.steps == 10
    assert runner.states["a"].output_ids == out["a"]
    for toks in out.values():
        assert set(toks) <= set(ordinary.tolist())
        assert len(tok.decode(toks)) >= len(toks)   # ordinary tokens are at least a character


async def test_engine_serves_text_on_a_simulated_h200():
    from pipeline.config import EngineConfig
    from pipeline.engine import open_engine

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
