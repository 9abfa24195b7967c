"""gpu/kernels/cpu/quant.c's kernels for one packed linear call, A/B alternating in one process (a
shared machine: each round times every variant once, the mean of --calls calls; the median
round is reported): the outer-product GEMM tiles (gpu/kernels/cpu/quant_gemm.c), the fused small-M tiles,
the buffered dot-product tiles, and the large-M path (dequantize in C + torch's fp32 GEMM),
at SmolLM2's shapes.

    .venv/bin/python scripts/bench_cpu_quant_gemm.py --threads 1 --rows 8 16 32 48 64 128 256
    .venv/bin/python scripts/bench_cpu_quant_gemm.py --threads 2 --rows 64 128 256 512 --variants gemm torch

--int16 on off: the GEMM tiles with the int16 VNNI tiles (Q4_0/Q4_1/Q8_0 on AVX512_VNNI builds,
the default there) and with the fp32 tiles, as the variants gemm-int16-on and gemm-int16-off:

    .venv/bin/python scripts/bench_cpu_quant_gemm.py --threads 2 --rows 32 512 --shapes 1 3 --variants gemm --int16 on off
"""
from __future__ import annotations

import argparse
import statistics
import time

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from gpu.kernels.cpu import quant as cpu_quant

SHAPES = [(960, 576, "Q4_1"), (3072, 576, "Q4_1"), (576, 1536, "Q4_1"), (49152, 576, "Q8_0"), (3072, 576, "Q8_0")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 48, 64, 128, 256])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--shapes", type=int, nargs="+", default=list(range(len(SHAPES))))
    ap.add_argument("--variants", nargs="+", default=["gemm", "fused", "buffered", "torch"])
    ap.add_argument("--int16", nargs="+", default=["on"], choices=["on", "off"],
                    help="the gemm variant with the int16 VNNI tiles (on, where the build has them) or the fp32 "
                         "tiles (off); more than one: a gemm variant each")
    a = ap.parse_args()
    if "gemm" in a.variants and len(a.int16) > 1:
        i = a.variants.index("gemm")
        a.variants[i:i + 1] = [f"gemm-int16-{v}" for v in a.int16]
    torch.set_num_threads(a.threads)
    k = cpu_quant.kernels()
    print(f"threads {a.threads}, ISA {cpu_quant.isa()}")
    rng = np.random.default_rng(0)
    for si in a.shapes:
        n, kdim, qtype = SHAPES[si]
        fmt = int(gguf.GGMLQuantizationType[qtype])
        w = rng.standard_normal((n, kdim)).astype(np.float32) * 0.02
        q = torch.from_numpy(gguf.quants.quantize(w, fmt).copy())
        scratch = torch.empty(n, kdim)
        for m in a.rows:
            x, y = torch.randn(m, kdim), torch.empty(m, n)

            def kernel(gemm: int, fused: int, int16: str = a.int16[0]):
                def f():
                    k.set_gemm(gemm, 1)
                    k.set_fused(fused)
                    k.set_int16(int16 == "on")
                    k.matmul(fmt, q, x, y)
                return f

            def large():
                k.dequantize(fmt, q, kdim, scratch)
                F.linear(x, scratch)

            fs = {"gemm": kernel(10 ** 6, 0), "fused": kernel(0, 10 ** 6), "buffered": kernel(0, 0), "torch": large}
            fs.update({f"gemm-int16-{v}": kernel(10 ** 6, 0, v) for v in a.int16})
            times = {v: [] for v in a.variants}
            for _ in range(a.rounds):
                for v in a.variants:
                    f = fs[v]
                    f()
                    t = time.perf_counter()
                    for _ in range(a.calls):
                        f()
                    times[v].append((time.perf_counter() - t) / a.calls)
            best = {v: statistics.median(ts) for v, ts in times.items()}
            ref = best[a.variants[0]]
            cols = "  ".join(f"{v} {t * 1e3:7.3f} ms ({t / ref:4.2f}x)" for v, t in best.items())
            print(f"[{m:3d} x {kdim} x {n:5d}] {qtype}: {cols}  {a.variants[0]} {2 * m * n * kdim / ref / 1e9:4.0f} GF/s",
                  flush=True)
    k.set_gemm(-1)
    k.set_fused(-1)
    k.set_int16(-1)


if __name__ == "__main__":
    main()
