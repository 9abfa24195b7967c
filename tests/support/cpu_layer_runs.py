"""Greedy runs of the C decode stack against the per-layer path (moved from
tests/gpu/test_cpu_layer.py; shared by several test modules)."""
from __future__ import annotations

import contextlib
import torch
from gpu.layers.attention import KVCache
from gpu.interface import SamplingOptions, SeqChunk, SeqStart, StepPlan
from gpu.worker.runner import ModelRunner

# blocks per sequence: prompts of 3-11 tokens cross block boundaries while decoding
BS, BLOCKS = 4, 8


class _Counting:
    """Wraps FusedDecode's C function: how many calls, and what they returned."""
    def __init__(self, fn):
        self.fn, self.rcs = fn, []

    def __call__(self, *args):
        rc = self.fn(*args)
        self.rcs.append(rc)
        return rc


@contextlib.contextmanager
def _prefilled(lm, fused: bool, n: int):
    """n sequences prefilled greedily (the C stack on or off for what follows); yields
    (the runner, the prompts, their block tables, the prefill's result, the logits of every
    step so far, the cache). The model's own logits hook and the stack's switch are put back."""
    c = lm.config
    lm.fused_decode.enabled = fused
    cache = KVCache(c.num_hidden_layers, n * BLOCKS, BS, c.num_key_value_heads, c.head_dim, torch.float32, "cpu")
    runner = ModelRunner(lm, cache, device=torch.device("cpu"))
    logits = []
    orig = lm.compute_logits
    lm.compute_logits = lambda h: logits.append(orig(h)) or logits[-1]
    try:
        prompts = [tuple(range(300 + 7 * i, 300 + 7 * i + 3 + 4 * (i % 6))) for i in range(n)]
        tables = [tuple(range(i * BLOCKS, (i + 1) * BLOCKS)) for i in range(n)]
        g = SamplingOptions(temperature=0.0)
        res = runner.execute(StepPlan(0, tuple(SeqChunk(str(i), p, 0, tables[i], True) for i, p in enumerate(prompts)),
                                      tuple(SeqStart(str(i), p, g) for i, p in enumerate(prompts))))
        yield runner, prompts, tables, res, logits, cache
    finally:
        del lm.compute_logits
        lm.fused_decode.enabled = True


def _run(lm, fused: bool, n: int, steps: int = 4, before_step=None):
    """Greedy prefill + decode of n sequences; (tokens per step, logits per decode step, cache)."""
    with _prefilled(lm, fused, n) as (runner, prompts, tables, res, logits, cache):
        tokens, pos = [res.token_ids], [len(p) for p in prompts]
        for step in range(1, steps + 1):
            if before_step is not None:
                before_step(step)
            res = runner.execute(StepPlan(step, tuple(SeqChunk(str(i), (tokens[-1][i],), pos[i], tables[i], True)
                                                      for i in range(n))))
            tokens.append(res.token_ids)
            pos = [p + 1 for p in pos]
    return tokens, logits[1:], cache
