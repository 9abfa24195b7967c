"""Chat prompts for the bundled SmolLM2, and greedy decoding of them all at once through
ModelRunner (the serving path: paged KV cache, sampler), for the precision tests to compare
one dtype recipe's tokens with another's."""
from __future__ import annotations

import torch

from gpu.layers.attention import KVCache
from gpu.interface import SamplingOptions, SeqChunk, SeqStart, StepPlan
from gpu.worker.runner import ModelRunner

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain photosynthesis in one sentence.", "List three prime numbers.",
           "Who wrote Hamlet?", "Translate 'good morning' into Spanish.",
           "What is 12 times 12?", "Name a colour of the rainbow."]


def greedy_runner(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy decoding of every prompt at once through ModelRunner (the serving path)."""
    bs, c = 16, model.config
    per_seq = -(-(max(map(len, prompts)) + n) // bs)
    cache = KVCache(c.num_hidden_layers, per_seq * len(prompts), bs, c.num_key_value_heads,
                    c.head_dim, model.dtype, "cpu")
    runner = ModelRunner(model, cache, device=torch.device("cpu"))
    tables = [tuple(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    greedy = SamplingOptions(temperature=0.0)
    out: list[list[int]] = [[] for _ in prompts]
    plan = StepPlan(0, tuple(SeqChunk(str(i), tuple(p), 0, tables[i], True) for i, p in enumerate(prompts)),
                    tuple(SeqStart(str(i), tuple(p), greedy) for i, p in enumerate(prompts)))
    for step in range(1, n + 1):
        result = runner.execute(plan)
        for sid, tok in zip(result.seq_ids, result.token_ids):
            out[int(sid)].append(tok)
        plan = StepPlan(step, tuple(SeqChunk(str(i), (o[-1],), len(p) + len(o) - 1, tables[i], True)
                                    for i, (p, o) in enumerate(zip(prompts, out))))
    return out
