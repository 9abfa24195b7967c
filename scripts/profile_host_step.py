"""Host CPU per engine step, stage by stage, inside a real `tailrace bench throughput` run.

Wraps each stage's pure core (Scheduler.schedule/update, Detokenizer, Parser, Accountant,
Emitter) and the runner's execute with time.thread_time(): CPU time of the calling
thread, so the figures hold up better than wall time on a loaded machine (a runner's
sleep or a wait for the GIL does not count). Arguments are `tailrace bench throughput`'s:

    .venv/bin/python scripts/profile_host_step.py gpu/configs/qwen3-0.6b --tokenizer $SMOL \\
        --simulate-gpu h200 --workload nano-vllm [--no-async-scheduling]

With a simulated GPU, "runner execute" is the runner thread's host work (input preparation
included, the wait excluded); the rest runs on the event loop's thread. All of it holds the
one GIL: their sum against the stand-in's wait per step says whether the host can keep up.
"""
from __future__ import annotations

import collections
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpu.worker.simulate as simulate  # noqa: E402
import gpu.worker.runner as runner  # noqa: E402
from pipeline.tools import bench  # noqa: E402
from stages import account, detokenize, emit, parse, schedule  # noqa: E402

cpu: collections.Counter = collections.Counter()
calls: collections.Counter = collections.Counter()


def _wrap(owner, name: str, label: str) -> None:
    f = getattr(owner, name)

    @functools.wraps(f)
    def timed(*a, **k):
        t = time.thread_time()
        try:
            return f(*a, **k)
        finally:
            cpu[label] += time.thread_time() - t
            calls[label] += 1
    setattr(owner, name, timed)


def main() -> None:
    _wrap(schedule.Scheduler, "schedule", "schedule")
    _wrap(schedule.Scheduler, "update", "update")
    _wrap(detokenize.Detokenizer, "process", "detokenize")
    _wrap(parse.Parser, "process", "parse")
    _wrap(account.Accountant, "process", "account")
    _wrap(emit.Emitter, "process", "emit")
    _wrap(simulate.SimulatedRunner, "execute", "runner execute (simulated: the wait excluded)")
    _wrap(runner.ModelRunner, "execute", "runner execute")
    _wrap(simulate.SimulatedRunner, "stage", "gpu stage: input staging (event loop)")
    import argparse
    p = argparse.ArgumentParser(prog="profile_host_step", description=__doc__)
    bench.add_arguments(p)
    bench.main(p.parse_args())
    steps = max(calls["schedule"], 1)
    print(f"host CPU per engine step ({steps} steps):")
    for label, s in sorted(cpu.items(), key=lambda kv: -kv[1]):
        print(f"  {label:48s} {s / steps * 1e3:7.3f} ms")
    loop = sum(v for k, v in cpu.items() if not k.startswith(("runner", "  ")))
    print(f"  {'event loop stages, summed':48s} {loop / steps * 1e3:7.3f} ms")


if __name__ == "__main__":
    main()
