"""Scheduler.schedule and Scheduler.update alone: CPU per engine step, best of N runs.

A nano-vllm-like batch (256 requests, prompts of 100..1024 tokens, 100..1024 output tokens,
ignore_eos) runs to the end through the scheduler's pure core with one step planned ahead
(async scheduling, as the engine runs it) and a fake result for every plan: no GPU, no
other stage. Prints the mean thread CPU time per step of schedule and update, the best of
--repeat runs (a shared, noisy machine only ever adds time).

    .venv/bin/python scripts/bench_scheduler.py [--repeat 5] [--digest]

--digest prints a hash of every plan and every downstream message instead (time fields
zeroed), with a small KV cache so that preemption and prefix-cache hits happen: the same
digest before and after a change to the scheduler means the same behaviour.
"""
from __future__ import annotations

import argparse
import hashlib
import random
import sys
import time
from pathlib import Path

root = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(root))     # the repo root: gpu, stages, tests.support

import attrs  # noqa: E402

from gpu.interface import StepResult  # noqa: E402
from tests.support.rendered import rendered  # noqa: E402
from stages.schedule.blocks import BlockManager  # noqa: E402
from stages.schedule import AsyncScheduler  # noqa: E402


def workload(rng: random.Random, num: int, shared_prefix: bool):
    base = [rng.randrange(1, 30000) for _ in range(1024)]
    for i in range(num):
        n = rng.randint(100, 1024)
        prompt = (base[:n] if shared_prefix and i % 2 else
                  [rng.randrange(1, 30000) for _ in range(n)])
        yield rendered(f"r{i}", prompt, max_tokens=rng.randint(100, 1024), ignore_eos=True)


def run(*, num_blocks: int, digest: bool, seed: int = 0) -> tuple[float, float, int, str]:
    rng = random.Random(seed)
    s = AsyncScheduler(BlockManager(num_blocks, 16), max_num_seqs=256, max_num_batched_tokens=8192,
                  max_model_len=4096, eos_token_ids=(2,))
    for r in workload(rng, 256, shared_prefix=digest):
        s.add(r)
    h = hashlib.sha256()
    t_sched = t_upd = 0.0
    steps = 0
    ahead = None
    while s.has_work() or ahead is not None:
        plan = None
        if s.has_work():
            t = time.thread_time()
            plan = s.schedule()
            t_sched += time.thread_time() - t
            steps += 1
            sampled = tuple(c.seq_id for c in plan.chunks if c.sample)
            result = StepResult(plan.step, sampled,
                                tuple(rng.randrange(3, 30000) for _ in sampled), 0.0)
            if digest:
                h.update(repr(plan).encode())
        if ahead is not None:
            t = time.thread_time()
            out = s.update(*ahead)
            t_upd += time.thread_time() - t
            if digest:
                out = attrs.evolve(out, done_at=0.0, deltas=tuple(
                    attrs.evolve(d, scheduled_at=0.0) for d in out.deltas))
                h.update(repr(out).encode())
        ahead = (plan, result) if plan is not None else None
    return t_sched / steps, t_upd / steps, steps, h.hexdigest()[:16]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--digest", action="store_true")
    a = p.parse_args()
    if a.digest:
        for nb in (600, 4000, 40000):
            _, _, steps, d = run(num_blocks=nb, digest=True)
            print(f"{nb} blocks: {steps} steps, digest {d}")
        return
    best = None
    for _ in range(a.repeat):
        sc, up, steps, _ = run(num_blocks=40000, digest=False)
        best = (sc, up) if best is None else (min(best[0], sc), min(best[1], up))
    print(f"{steps} steps, best of {a.repeat}: schedule {best[0] * 1e3:.3f} ms, "
          f"update {best[1] * 1e3:.3f} ms per step")


if __name__ == "__main__":
    main()
