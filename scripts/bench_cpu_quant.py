"""The packed GGUF linear kernel (gpu/kernels/cpu/quant.c) against torch's fp32 and bf16 GEMMs on the
dequantized weight, at SmolLM2's shapes and 1-128 rows; best of N calls (a shared machine).

    .venv/bin/python scripts/bench_cpu_quant.py --threads 1
"""
from __future__ import annotations

import argparse
import time

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from gpu.kernels.cpu import quant as cpu_quant


def best(f, n: int = 15) -> float:
    b = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        f()
        b = min(b, time.perf_counter() - t)
    return b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32, 128])
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    k = cpu_quant.kernels()
    print(f"threads {a.threads}, ISA {cpu_quant.isa()}")
    rng = np.random.default_rng(0)
    for n, kdim, qtype in [(960, 576, "Q4_1"), (3072, 576, "Q4_1"), (576, 1536, "Q4_1"), (49152, 576, "Q8_0")]:
        fmt = gguf.GGMLQuantizationType[qtype]
        w = rng.standard_normal((n, kdim)).astype(np.float32) * 0.02
        q = torch.from_numpy(gguf.quants.quantize(w, fmt).copy())
        wd = torch.from_numpy(gguf.quants.dequantize(q.numpy(), fmt).reshape(n, kdim).copy())
        wb = wd.bfloat16()
        lin = cpu_quant.PackedLinear(kdim, [(int(fmt), q)])
        for m in a.rows:
            x = torch.randn(m, kdim)
            xb = x.bfloat16()
            tq = best(lambda: lin(x))
            tf = best(lambda: F.linear(x, wd))
            tb = best(lambda: F.linear(xb, wb))
            print(f"[{m:3d} x {kdim} x {n:5d}] {qtype}: packed {tq * 1e3:7.3f} ms ({2 * m * n * kdim / tq / 1e9:5.0f} GF/s, "
                  f"{q.numel() / tq / 1e9:4.1f} GB/s of blocks)  fp32 {tf * 1e3:7.3f}  bf16 {tb * 1e3:7.3f} ms", flush=True)


if __name__ == "__main__":
    main()
