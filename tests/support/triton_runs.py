"""The Triton runner's logits, captured, and the two-sequence plans the runner tests step
through (shared by several test modules)."""
from __future__ import annotations

from gpu.interface import SamplingOptions, SeqChunk, SeqStart, StepPlan


def capture_logits(lm, runner, plans):
    seen = []
    orig = lm.compute_logits
    lm.compute_logits = lambda h: seen.append(orig(h)) or seen[-1]
    try:
        results = [runner.execute(p) for p in plans]
    finally:
        lm.compute_logits = orig
    return results, seen


def two_sequence_plans(third_step: bool = False) -> list[StepPlan]:
    """a (7 tokens, prefilled in two chunks over blocks 7 and 2) and b (2 tokens, block 0),
    greedy; with `third_step`, one more decode step each, b's table grown to (0, 4)."""
    greedy = SamplingOptions(temperature=0.0)
    a, b = (3, 9, 4, 1, 7, 2, 8), (5, 6)
    plans = [
        StepPlan(1, (SeqChunk("a", a[:5], 0, (7, 2), False), SeqChunk("b", b, 0, (0,), True)),
                 (SeqStart("a", a, greedy), SeqStart("b", b, greedy))),
        StepPlan(2, (SeqChunk("b", (11,), 2, (0,), True), SeqChunk("a", a[5:], 5, (7, 2), True))),
    ]
    if third_step:
        plans.append(StepPlan(3, (SeqChunk("b", (12,), 3, (0, 4), True), SeqChunk("a", (13,), 7, (7, 2), True))))
    return plans
