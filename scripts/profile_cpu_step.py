"""Where a CPU decode step goes: SmolLM2, 32 sequences of 128-token prompts, decode steps
through ModelRunner (paged KV cache, sampler) under torch.profiler, by operator.
aten::mm/addmm/_linear_pointwise are the linear layers, *scaled_dot_product* and the
index_select gathers the attention, argmax the (greedy) sampling.

    .venv/bin/python scripts/profile_cpu_step.py --dtype bfloat16
"""
from __future__ import annotations

import argparse
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from gpu.attention import KVCache
from gpu.loader import load_model
from gpu.interface import SamplingOptions, SeqChunk, SeqStart, StepPlan
from gpu.runner import ModelRunner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-seqs", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    lm = load_model(None, dtype=a.dtype, progress=False)
    c, n, bs = lm.config, a.num_seqs, 16
    cache = KVCache(c.num_hidden_layers, n * 17, bs, c.num_key_value_heads, c.head_dim, lm.model.dtype, "cpu")
    runner = ModelRunner(lm.model, cache, device=torch.device("cpu"))
    rng = random.Random(0)
    prompts = [tuple(rng.randrange(10000) for _ in range(128)) for _ in range(n)]
    tables = [tuple(range(i * 17, (i + 1) * 17)) for i in range(n)]
    greedy = SamplingOptions(temperature=0.0)
    runner.execute(StepPlan(0, tuple(SeqChunk(str(i), p, 0, tables[i], True) for i, p in enumerate(prompts)),
                            tuple(SeqStart(str(i), p, greedy) for i, p in enumerate(prompts))))

    def decode(step: int) -> float:
        t = time.perf_counter()
        runner.execute(StepPlan(step, tuple(SeqChunk(str(i), (5,), 128 + step, tables[i], True)
                                            for i in range(n))))
        return time.perf_counter() - t

    times = sorted(decode(s) for s in range(1, a.steps + 1))
    print(f"decode step of {n}: median {times[len(times) // 2] * 1e3:.1f} ms, best {times[0] * 1e3:.1f} ms")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for s in range(a.steps + 1, a.steps + 6):
            decode(s)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
