"""What --event-log costs per engine step, without a model: the stages' side (their
`log(...)` calls: a queue append each) and the writer thread's side (serialising and
writing the lines), for a decode step of B sequences of chat streaming.

    PYTHONPATH=. python scripts/event_log_cost.py [B ...]

The stages' side is on the engine's critical path; the writer's runs in its own thread,
overlapping the GPU step (docs/benchmarks.md).
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import attrs

from gpu.interface import SeqChunk, StepPlan
from pipeline.core.events import EventLog
from stages.delta import Delta, Usage
from stages.emit import ReplyEnd
from stages.messages import Step

CHUNK = (b'data: {"id":"chatcmpl-0123456789abcdef0123456789abcdef","object":"chat.completion.'
         b'chunk","created":1764554000,"model":"SmolLM2-135M-Instruct","choices":[{"index":0,'
         b'"delta":{"content":" hello"},"logprobs":null,"finish_reason":null}]}\n\n')


def one_step(batch: int, k: int):
    ids = [f"{i:032x}" for i in range(batch)]
    deltas = tuple(Delta(rid, (1234,), None, None, 16, scheduled_at=1000.0 + k) for rid in ids)
    step = Step(k, (), deltas, batch, 0, 4 * batch, 1000.5 + k)
    plan = StepPlan(k, tuple(SeqChunk(rid, (1234,), 100 + k, (1, 2, 3, 4), True) for rid in ids))
    det = tuple(attrs.evolve(d, text=" hello") for d in deltas)
    par = tuple(attrs.evolve(d, content=" hello") for d in det)
    acc = tuple(attrs.evolve(d, usage=Usage(100, k)) for d in par)
    items = [(rid, CHUNK) for rid in ids] + [(ids[0], ReplyEnd(200))]
    return plan, step, det, par, acc, items


def measure(batch: int, steps: int = 200) -> tuple[float, float, int]:
    with tempfile.TemporaryDirectory() as tmp:
        log = EventLog(Path(tmp) / "events.jsonl")
        log._closed = True                 # stop the writer thread: time each side alone
        log._wake.set()
        log._thread.join()
        sched, gpu, detok, parse, acct, emit = (log.stage(s) for s in (
            "schedule", "gpu_step", "detokenize", "parse", "account", "emit"))
        made = [one_step(batch, k) for k in range(steps)]
        t0 = time.perf_counter()
        for plan, step, det, par, acc, items in made:
            gpu("step", step=plan.step, seqs=batch, tokens=batch, duration_s=0.01)
            sched("scheduled", plan=plan, preempted=(), message=step)
            detok("detokenized", step=step.step, deltas=det)
            parse("parsed", step=step.step, deltas=par)
            acct("accounted", step=step.step, deltas=acc)
            emit("emitted", items=items)
        stages = (time.perf_counter() - t0) / steps
        t0 = time.perf_counter()
        log._drain()
        writer = (time.perf_counter() - t0) / steps
        log.close()
        size = (Path(tmp) / "events.jsonl").stat().st_size
    return stages, writer, size // steps


def main(argv: list[str]) -> None:
    print("| batch | stages' side per step | writer thread per step | bytes per step |")
    print("|---|---|---|---|")
    for batch in map(int, argv or ["32", "128", "256"]):
        stages, writer, size = measure(batch)
        print(f"| {batch} | {stages * 1e6:.0f} µs | {writer * 1e3:.2f} ms | {size:,} |")


if __name__ == "__main__":
    main(sys.argv[1:])
