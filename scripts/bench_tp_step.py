"""A whole SmolLM2 (the default model) decode step under tensor parallelism, and its
collectives' share (scripts/bench_tp.py times the collectives and the plan broadcast
alone): TP = 1, 2 and 3 over gloo on this machine, alternated in rounds (A B C A B C ...),
median of each.

Three ranks are spawned once (one intra-op thread each); TP 2 runs on ranks 0-1 in a
subgroup while rank 2 waits, TP 1 on rank 0 alone. For each size and round:
  step:        one decode step's forward (batch B, one new token each: attention over no
               context, so the matmuls and collectives dominate) plus compute_logits;
  collectives: the same step's collectives alone: 2 L + 1 all-reduces of [B, D] in the model
               dtype (embedding, o_proj and down per layer) and the logits gather ([B, V/size]
               fp32 to rank 0).
On a CPU shared by the ranks this measures overhead, not speed-up: TP exists for models that
do not fit one device, and the ranks here compete for the same cores.

    .venv/bin/python scripts/bench_tp_step.py --batch 32 --steps 20 --rounds 3
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from gpu.layers.attention_dense import DenseCausalAttention  # noqa: E402
from gpu.loader.decoder import load_model  # noqa: E402
from gpu.parallel import SINGLE, TP, destroy_group, init_group  # noqa: E402

SIZES = (1, 2, 3)


def _rank(rank: int, port: int, args) -> None:
    torch.set_num_threads(1)
    world = init_group(rank, 3, backend="gloo", init_method=f"tcp://127.0.0.1:{port}", timeout_s=600)
    g2 = dist.new_group([0, 1])  # every rank takes part in making it
    tps = {1: SINGLE if rank == 0 else None, 2: TP(rank, 2, g2) if rank < 2 else None, 3: world}
    models = {}
    for n, tp in tps.items():
        if tp is not None:
            try:
                models[n] = load_model(None, dtype=args.dtype, progress=False, tp=tp).model
            except ValueError:   # SmolLM2's 9 heads do not split in 2: collectives only
                models[n] = None
    full = next(m for m in models.values() if m is not None)
    L, D, V, dtype = full.config.num_hidden_layers, full.config.hidden_size, full.config.vocab_size, full.dtype
    B = args.batch
    ids = torch.randint(0, 49152, (B,), generator=torch.Generator().manual_seed(0))
    positions = torch.full((B,), 7)
    attn = DenseCausalAttention([1] * B)
    times = {n: {"step": [], "collectives": []} for n in SIZES}
    for _ in range(args.rounds):
        for n in SIZES:
            dist.barrier()
            if tps[n] is None:
                continue
            tp, m = tps[n], models[n]
            x = torch.zeros(B, D, dtype=dtype)
            part = torch.zeros(B, -(-V // n))
            with torch.inference_mode():
                for _ in range(2 if m is not None else 0):  # warm-up
                    m.compute_logits(m(ids, positions, attn))
                for _ in range(args.steps):
                    t = time.perf_counter()
                    if m is not None:
                        m.compute_logits(m(ids, positions, attn))
                    t1 = time.perf_counter()
                    for _ in range(2 * L + 1):
                        tp.all_reduce(x)
                    tp.gather_first(part)
                    t2 = time.perf_counter()
                    if m is not None:
                        times[n]["step"].append(t1 - t)
                    times[n]["collectives"].append(t2 - t1)
    dist.barrier()
    if rank == 0:
        print(f"SmolLM2-135M, decode batch {B}, {args.dtype}, gloo, {torch.get_num_threads()} thread a rank, "
              f"{args.rounds} rounds x {args.steps} steps, medians:")
        for n in SIZES:
            med = {k: statistics.median(v) * 1e3 for k, v in times[n].items() if v}
            step = f"step {med['step']:7.2f} ms" if "step" in med else "step    n/a (heads do not split)"
            coll = f", its collectives alone {med['collectives']:6.2f} ms ({2 * L + 1} all-reduces + 1 gather)"
            print(f"  TP {n}: {step}" + (coll if n > 1 else ""))
    destroy_group(world)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(port, args), nprocs=3, join=True, start_method="spawn")


if __name__ == "__main__":
    main()
