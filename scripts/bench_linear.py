"""CPU matmul rates at the bundled SmolLM2's decode shapes: the plain F.linear against
oneDNN with the weight packed once (gpu/models/causal_lm.py's Linear). Interleaved, best of N, so
that a busy machine hurts both alike.

    .venv/bin/python scripts/bench_linear.py --rows 32 --dtype bfloat16
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

# SmolLM2-135M: hidden 576, q+k+v 960, FFN 1536 (gate and up merged: 3072), vocab 49152
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
          "lm_head": (576, 49152)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--repeats", type=int, default=40)
    a = ap.parse_args()
    dt = getattr(torch, a.dtype)
    print(f"{'shape':>8s} {'M x K x N':>18s} {'F.linear':>9s} {'packed':>9s}  GFLOP/s "
          f"({torch.get_num_threads()} threads)")
    for name, (k, n) in SHAPES.items():
        x, w = torch.randn(a.rows, k).to(dt), torch.randn(n, k).to(dt)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        runs = {"plain": lambda: F.linear(x, w),
                "packed": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")}
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(a.repeats):
            for key, f in runs.items():
                t = time.perf_counter()
                f()
                best[key] = min(best[key], time.perf_counter() - t)
        flop = 2 * a.rows * k * n / 1e9
        print(f"{name:>8s} {f'{a.rows} x {k} x {n}':>18s} {flop / best['plain']:9.0f} "
              f"{flop / best['packed']:9.0f}")


if __name__ == "__main__":
    main()
