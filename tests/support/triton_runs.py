"""The Triton runner's logits, captured (moved from tests/kernels/test_runner_triton.py, which
other test modules share)."""
from __future__ import annotations



def capture_logits(lm, runner, plans):
    seen = []
    orig = lm.compute_logits
    lm.compute_logits = lambda h: seen.append(orig(h)) or seen[-1]
    try:
        results = [runner.execute(p) for p in plans]
    finally:
        lm.compute_logits = orig
    return results, seen
