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

int16-gemv: the int16 GEMV tiles (AVX2 builds without AVX-512, every format; x quantized per
32-element block to int16, _mm256_madd_epi16) at every row given, against the fused and
buffered fp32 tiles (shapes 5-7: Gemma 3 270M's K-quant linears, random blocks):

    .venv/bin/python scripts/bench_cpu_quant_gemm.py --threads 1 --rows 1 2 4 --variants int16-gemv fused buffered
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

SHAPES = [(960, 576, "Q4_1"), (3072, 576, "Q4_1"), (576, 1536, "Q4_1"), (49152, 576, "Q8_0"), (3072, 576, "Q8_0"),
          # Gemma 3 270M Q4_K_M's K-quant linears (ffn_down, attn_output; its K = 640 ones are Q5_0/Q8_0)
          (640, 2048, "Q4_K"), (640, 2048, "Q6_K"), (640, 1024, "Q5_K")]
KQ_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def kquant_blocks(rng, n: int, kdim: int, qtype: str) -> np.ndarray:
    """Random K-quant blocks with sane f16 scales (gguf-py cannot quantize them)."""
    bb = KQ_BYTES[qtype]
    packed = rng.integers(0, 256, (n, kdim // 256 * bb), dtype=np.uint8)
    blocks = packed.reshape(n, -1, bb)
    at = 208 if qtype == "Q6_K" else 0
    blocks[..., at:at + 2] = np.frombuffer(np.float16(0.003).tobytes(), np.uint8)
    if qtype != "Q6_K":
        blocks[..., 2:4] = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)
    return packed


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
    ap.add_argument("--cpu-time", action="store_true",
                    help="time by the process's CPU time, not the wall clock (with --threads 1 on a shared "
                         "machine: other processes' load then costs no time, only cache)")
    a = ap.parse_args()
    clock = time.process_time if a.cpu_time else time.perf_counter
    if "gemm" in a.variants and len(a.int16) > 1:
        i = a.variants.index("gemm")
        a.variants[i:i + 1] = [f"gemm-int16-{v}" for v in a.int16]
    torch.set_num_threads(a.threads)
    k = cpu_quant.kernels()
    print(f"threads {a.threads}, ISA {cpu_quant.isa()}, {'CPU' if a.cpu_time else 'wall'} time")
    rng = np.random.default_rng(0)
    for si in a.shapes:
        n, kdim, qtype = SHAPES[si]
        fmt = int(gguf.GGMLQuantizationType[qtype])
        if qtype in KQ_BYTES:
            q = torch.from_numpy(kquant_blocks(rng, n, kdim, qtype))
        else:
            w = rng.standard_normal((n, kdim)).astype(np.float32) * 0.02
            q = torch.from_numpy(gguf.quants.quantize(w, fmt).copy())
        scratch = torch.empty(n, kdim)
        for m in a.rows:
            x, y = torch.randn(m, kdim), torch.empty(m, n)

            def kernel(gemm: int, fused: int, int16: str = a.int16[0], gemv: int = 0):
                def f():
                    k.set_gemm(gemm, 1)
                    k.set_fused(fused)
                    k.set_int16(int16 == "on")
                    k.set_int16_gemv(gemv)
                    k.matmul(fmt, q, x, y)
                return f

            def large():
                k.dequantize(fmt, q, kdim, scratch)
                F.linear(x, scratch)

            fs = {"gemm": kernel(10 ** 6, 0), "fused": kernel(0, 10 ** 6), "buffered": kernel(0, 0), "torch": large,
                  "int16-gemv": kernel(0, 0, gemv=10 ** 6)}
            fs.update({f"gemm-int16-{v}": kernel(10 ** 6, 0, v) for v in a.int16})
            times = {v: [] for v in a.variants}
            for _ in range(a.rounds):
                for v in a.variants:
                    f = fs[v]
                    f()
                    t = clock()
                    for _ in range(a.calls):
                        f()
                    times[v].append((clock() - t) / a.calls)
            best = {v: statistics.median(ts) for v, ts in times.items()}
            ref = best[a.variants[0]]
            cols = "  ".join(f"{v} {t * 1e3:7.3f} ms ({t / ref:4.2f}x)" for v, t in best.items())
            print(f"[{m:3d} x {kdim} x {n:5d}] {qtype}: {cols}  {a.variants[0]} {2 * m * n * kdim / ref / 1e9:4.0f} GF/s",
                  flush=True)
    k.set_gemm(-1)
    k.set_fused(-1)
    k.set_int16(-1)
    k.set_int16_gemv(-1)


if __name__ == "__main__":
    main()
