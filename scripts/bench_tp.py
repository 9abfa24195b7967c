"""Tensor parallelism's per-step overhead (issue 25): the plan broadcast and the model's
collectives, at TP = 2 and 3, over gloo on this machine's CPU.

    PYTHONPATH=. python scripts/bench_tp.py [--sizes 2,3] [--rounds 2] [--iters 200]

Each size runs in spawned processes (one intra-op thread a rank), in alternating rounds
(2, 3, 2, 3 ...) so that a change in the machine's load hits every size alike; the median
over rounds of each figure is printed as a markdown table.

- "broadcast": rank 0's `StepBroadcast.send` of a real staged step (pack + header + payload)
  and a worker's receive + unpack + `upload_inputs`, per step, for decode batches and a
  prefill chunk (the block tables of 1024-token contexts).
- "collectives": what one SmolLM2-135M forward and its logits cost in communication alone
  at T tokens: 1 + 2 x 30 all-reduces of [T, 576] fp32 (the embedding, then o_proj and
  down_proj in each layer) and one gather of [rows, 49152 / N] logits to rank 0.

On a CPU with few cores, gloo over loopback measures the overhead the plumbing adds, not
the speed tensor parallelism would give on GPUs with NVLink: the ranks share the cores.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

HIDDEN, LAYERS, VOCAB = 576, 30, 49152       # SmolLM2-135M
DECODE = (1, 32, 256)                        # decode batch sizes
PREFILL = 2048                               # one prefill chunk of this many tokens
CONTEXT = 1024                               # each sequence's context (block tables)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plan(batch: int, tokens_each: int):
    from gpu.interface import SeqChunk, StepPlan

    blocks = tuple(range(CONTEXT // 16))
    chunks = tuple(SeqChunk(f"s{i}", (7,) * tokens_each, CONTEXT - tokens_each, blocks, True)
                   for i in range(batch))
    return StepPlan(1, chunks)


def _time(fn, iters: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6     # µs


def _rank(rank: int, size: int, port: int, iters: int, out: str) -> None:
    from gpu.parallel import init_group
    from gpu.worker.staging import BlockTables, StagedTokens, stage_plan, upload_inputs
    from gpu.worker.tp import HEADER, StepBroadcast, unpack

    torch.set_num_threads(1)
    tp = init_group(rank, size, backend="gloo", init_method=f"tcp://127.0.0.1:{port}",
                    timeout_s=300)
    plan_group = torch.distributed.new_group(backend="gloo")
    cpu = torch.device("cpu")
    results = {}
    cases = [(f"decode {b}", b, 1) for b in DECODE] + [(f"prefill {PREFILL}", 1, PREFILL)]
    for name, batch, each in cases:
        if rank == 0:
            host = stage_plan(_plan(batch, each), 16, BlockTables(), StagedTokens())
            upload_inputs(host, cpu)
            sender = StepBroadcast(plan_group)
            us = _time(lambda: sender.send(host, [], True, 1), iters)
        else:
            header = torch.zeros(HEADER, dtype=torch.int64)

            def receive():
                torch.distributed.broadcast(header, 0, group=plan_group)
                h = header.numpy().copy()
                payload = torch.empty(int(h[10]), dtype=torch.int64)
                torch.distributed.broadcast(payload, 0, group=plan_group)
                upload_inputs(unpack(h, payload.numpy())[0], cpu)
            us = _time(receive, iters)
        results[("broadcast", name, rank)] = us
    for name, tokens in [(f"decode {b}", b) for b in DECODE] + [(f"prefill {PREFILL}", PREFILL)]:
        x = torch.randn(tokens, HIDDEN)
        rows = min(tokens, 256)
        part = torch.randn(rows, -(-VOCAB // size))

        def forward_collectives():
            for _ in range(1 + 2 * LAYERS):
                tp.all_reduce(x)
            tp.gather_first(part, dim=-1)
        results[("collectives", name, rank)] = _time(forward_collectives, max(5, iters // 20))
    gathered = [None] * size if rank == 0 else None
    torch.distributed.gather_object(results, gathered, dst=0)
    if rank == 0:
        merged = {}
        for r in gathered:
            merged.update(r)
        torch.save(merged, out)
    torch.distributed.destroy_process_group()


def pack_costs(iters: int) -> dict[str, float]:
    """µs to pack a step on rank 0 and to unpack it on a worker, in this process: the
    part of "broadcast" that is not gloo."""
    from gpu.worker.staging import BlockTables, StagedTokens, stage_plan, upload_inputs
    from gpu.worker.tp import pack, unpack

    out = {}
    for name, batch, each in [(f"decode {b}", b, 1) for b in DECODE] + [(f"prefill {PREFILL}", 1, PREFILL)]:
        host = stage_plan(_plan(batch, each), 16, BlockTables(), StagedTokens())
        upload_inputs(host, torch.device("cpu"))
        header, payload = pack(host, [], [], True, 1)
        out[name] = (_time(lambda: pack(host, [], [], True, 1), iters),
                     _time(lambda: unpack(header, payload), iters), payload.size * 8)
    return out


def run(size: int, iters: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "r.pt")
        mp.start_processes(_rank, args=(size, _free_port(), iters, out), nprocs=size,
                           join=True, start_method="spawn")
        return torch.load(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="2,3")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    runs: dict[int, list[dict]] = {s: [] for s in sizes}
    for _ in range(args.rounds):
        for s in sizes:                     # alternating: 2, 3, 2, 3 ...
            runs[s].append(run(s, args.iters))
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end; "
          f"{args.rounds} rounds x {args.iters} steps, median; µs per step\n")
    packs = pack_costs(args.iters)
    print("| step | payload bytes | pack (rank 0) | unpack (worker) |\n|---|---|---|---|")
    for name, (p_us, u_us, nbytes) in packs.items():
        print(f"| {name} | {nbytes:,} | {p_us:,.0f} | {u_us:,.0f} |")
    print()
    print("| what | step | " + " | ".join(f"TP {s}: rank 0 | TP {s}: worker" for s in sizes)
          + " |")
    print("|---|---|" + "---|---|" * len(sizes))
    keys = sorted({(k[0], k[1]) for k in runs[sizes[0]][0]},
                  key=lambda k: (k[0], "prefill" in k[1], int(k[1].split()[-1])))
    for what, step in keys:
        cells = []
        for s in sizes:
            for rank in (0, 1):
                cells.append(f"{statistics.median(r[(what, step, rank)] for r in runs[s]):,.0f}")
        print(f"| {what} | {step} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
