"""Where a CPU decode step goes: SmolLM2, 32 sequences of 128-token prompts, decode steps
through ModelRunner (paged KV cache, sampler) under torch.profiler, by operator.
aten::mm/addmm/_linear_pointwise are the linear layers, *scaled_dot_product* and the
index_select gathers the attention, argmax the (greedy) sampling.

    .venv/bin/python scripts/profile_cpu_step.py --dtype bfloat16

A/B on a shared machine: --residual-dtypes or --attention with more than one value builds
one runner per combination (same weights) and times them alternately, --rounds times, so
that load from other processes hits all alike; it prints each round's median and best, and
the spread. --paths c is the step with gpu/kernels/cpu/ops.c (the default where it builds:
decode attention reading the paged cache in place, norms, rope, silu*mul), torch the same step
without it (TAILRACE_CPU_KERNELS=0: gather + SDPA, torch's elementwise ops).

    .venv/bin/python scripts/profile_cpu_step.py --dtype bfloat16 --residual-dtypes bfloat16 float32 --rounds 5
    .venv/bin/python scripts/profile_cpu_step.py --dtype bfloat16 --paths torch c --rounds 5

--fused on off (with gguf): the decode step's decoder stack in one C call (gpu/kernels/cpu/layer.c,
the default where it applies) against the per-layer path (TAILRACE_FUSED_LAYERS=0), alternating:

    .venv/bin/python scripts/profile_cpu_step.py --quantizations gguf --fused on off --num-seqs 1 --rounds 3

--quantizations gguf: the GGUF's linears kept packed (gpu/kernels/cpu/quant.c, float32 activations;
--dtype is then ignored); none (the default): dequantized to --dtype. A/B of both, at 1 stream:

    .venv/bin/python scripts/profile_cpu_step.py --quantizations none gguf --num-seqs 1 --rounds 3

--tiles fused buffered (with gguf): gpu/kernels/cpu/quant.c's small-M tiles that dequantize Q4_0/Q4_1/
Q8_0 blocks in registers (the default) against dequantizing each weight row into a buffer first:

    .venv/bin/python scripts/profile_cpu_step.py --quantizations gguf --tiles fused buffered --num-seqs 1 --rounds 3 --no-profile

--gemm on off (with gguf): gpu/kernels/cpu/quant_gemm.c's outer-product GEMM tiles at their default rows
against none (the fused or buffered tiles then serve), a number: up to that many rows, or A-B:
rows A to B:

    .venv/bin/python scripts/profile_cpu_step.py --quantizations gguf --gemm on off --num-seqs 32 --rounds 3 --no-profile

--prefill N: a prefill of N tokens (one sequence) per variant instead of the decode steps.

--int16 on off (with gguf): the GEMM tiles of Q4_0/Q4_1/Q8_0 with int16 activations and VNNI
(AVX512_VNNI builds, the default there), and the int16 GEMV tiles of every format at few rows
(AVX2 builds without AVX-512, the default there), against the fp32 tiles
(TAILRACE_CPU_QUANT_INT16=0):

    .venv/bin/python scripts/profile_cpu_step.py --quantizations gguf --int16 on off --num-seqs 32 --rounds 3 --no-profile
    OMP_NUM_THREADS=1 .venv/bin/python scripts/profile_cpu_step.py --quantizations gguf --int16 on off \
        --num-seqs 1 --rounds 5 --no-profile --cpu-time     # a shared machine: CPU time, one thread
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from gpu.kernels.cpu import layer as cpu_layer

from gpu.kernels.cpu import quant as cpu_quant

from gpu.layers import ops
from gpu.layers.attention import KVCache
from gpu.loader.decoder import cpu_threads, load_model
from gpu.interface import SamplingOptions, SeqChunk, SeqStart, StepPlan
from gpu.worker.runner import ModelRunner


cpu_ops = ops._cpu
CLOCK = time.perf_counter   # --cpu-time: time.process_time


def set_tiles(tiles: str) -> None:
    """gpu/kernels/cpu/quant.c's fused small-M tiles: "fused" (the default row limit), "buffered"
    (none) or a number of rows, in both libraries that hold them."""
    max_m = {"fused": -1, "buffered": 0}.get(tiles)
    max_m = int(tiles) if max_m is None else max_m
    if cpu_quant.kernels() is not None:
        cpu_quant.kernels().set_fused(max_m)
    if cpu_layer.library() is not None:
        cpu_layer.library().cpu_quant_set_fused(max_m)


def set_gemm(gemm: str) -> None:
    """gpu/kernels/cpu/quant_gemm.c's GEMM tiles: "on" (the default rows), "off" (none), a number: the
    most rows (from 1), or "A-B": rows A to B; in both libraries that hold them."""
    if gemm in ("on", "off"):
        min_m, max_m = -1, -1 if gemm == "on" else 0
    else:
        lo, _, hi = gemm.rpartition("-")
        min_m, max_m = int(lo or 1), int(hi)
    if cpu_quant.kernels() is not None:
        cpu_quant.kernels().set_gemm(max_m, min_m)
    if cpu_layer.library() is not None:
        cpu_layer.library().cpu_quant_set_gemm(min_m, max_m)


def set_int16(int16: str) -> None:
    """The int16-activation tiles "on" (where the build has them: gpu/kernels/cpu/quant_gemm.c's VNNI GEMM
    tiles with AVX512_VNNI, gpu/kernels/cpu/quant.c's GEMV tiles on AVX2 without AVX-512, at their default
    rows) or "off" (the fp32 tiles), in both libraries that hold them."""
    on = int(int16 == "on")
    if cpu_quant.kernels() is not None:
        cpu_quant.kernels().set_int16(on)
        cpu_quant.kernels().set_int16_gemv(-1 if on else 0)
    if cpu_layer.library() is not None:
        cpu_layer.library().cpu_quant_set_int16(on)
        cpu_layer.library().cpu_quant_set_int16_gemv(-1 if on else 0)


def make_decoder(lm, n: int, bs: int = 16, path: str = "c", fused: bool = True, tiles: str = "fused",
                 gemm: str = "on", int16: str = "on"):
    """A runner with n sequences prefilled; returns decode(step) -> seconds."""
    c = lm.config
    cache = KVCache(c.num_hidden_layers, n * 17, bs, c.num_key_value_heads, c.head_dim, lm.dtype, "cpu")
    runner = ModelRunner(lm, cache, device=torch.device("cpu"))
    if path == "torch":
        runner.attn.kernels = None
    elif cpu_ops() is None:
        raise SystemExit("--paths c: gpu/kernels/cpu/ops.c is not available here")
    # (c without AVX-512: C norms and rope, decode attention by gather + SDPA, as served)
    rng = random.Random(0)
    prompts = [tuple(rng.randrange(10000) for _ in range(128)) for _ in range(n)]
    tables = [tuple(range(i * 17, (i + 1) * 17)) for i in range(n)]
    greedy = SamplingOptions(temperature=0.0)
    runner.execute(StepPlan(0, tuple(SeqChunk(str(i), p, 0, tables[i], True) for i, p in enumerate(prompts)),
                            tuple(SeqStart(str(i), p, greedy) for i, p in enumerate(prompts))))

    def decode(step: int) -> float:
        # torch: gpu/layers/ops.py's torch code too, for this runner's steps only
        ops._cpu = (lambda: None) if path == "torch" else cpu_ops
        if lm.fused_decode is not None:   # gpu/kernels/cpu/layer.py: this runner's steps only
            lm.fused_decode.enabled = fused and path == "c"
        set_tiles(tiles)
        set_int16(int16)   # before set_gemm: its default rows follow the int16 switch
        set_gemm(gemm)
        t = CLOCK()
        # positions wrap inside the 17 blocks (272 slots) whatever the number of steps
        runner.execute(StepPlan(step, tuple(SeqChunk(str(i), (5,), 128 + step % 128, tables[i], True)
                                            for i in range(n))))
        return CLOCK() - t

    return decode


def make_prefiller(lm, tokens: int, bs: int = 16, tiles: str = "fused", gemm: str = "on", int16: str = "on"):
    """A runner for prefills of one sequence of `tokens` tokens; returns prefill(step) -> seconds
    (each step a new sequence in the same blocks, the last one released)."""
    c = lm.config
    nblk = (tokens + bs - 1) // bs
    cache = KVCache(c.num_hidden_layers, nblk, bs, c.num_key_value_heads, c.head_dim, lm.dtype, "cpu")
    runner = ModelRunner(lm, cache, device=torch.device("cpu"))
    rng = random.Random(0)
    prompt = tuple(rng.randrange(10000) for _ in range(tokens))
    greedy = SamplingOptions(temperature=0.0)

    def prefill(step: int) -> float:
        set_tiles(tiles)
        set_int16(int16)
        set_gemm(gemm)
        released = (str(step - 1),) if step > 1 else ()
        plan = StepPlan(step, (SeqChunk(str(step), prompt, 0, tuple(range(nblk)), True),),
                        (SeqStart(str(step), prompt, greedy),), released=released)
        t = CLOCK()
        runner.execute(plan)
        return CLOCK() - t

    return prefill


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--residual-dtypes", nargs="+", default=["auto"])
    ap.add_argument("--paths", nargs="+", default=["c"], choices=["c", "torch"])
    ap.add_argument("--num-seqs", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--quantizations", nargs="+", default=["none"], choices=["none", "gguf"])
    ap.add_argument("--fused", nargs="+", default=["on"], choices=["on", "off"],
                    help="gguf: the decoder stack in one C call (gpu/kernels/cpu/layer.c) or the per-layer path")
    ap.add_argument("--tiles", nargs="+", default=["fused"],
                    help="gguf: few rows of Q4_0/Q4_1/Q8_0 dequantized in registers (fused: the default "
                         "row limit; or a number of rows), or each weight row dequantized into a buffer "
                         "first (buffered); bit-identical results")
    ap.add_argument("--gemm", nargs="+", default=["on"],
                    help="gguf: the outer-product GEMM tiles (gpu/kernels/cpu/quant_gemm.c) at their default "
                         "rows (on), none (off), up to a number of rows (N), or rows A to B (A-B)")
    ap.add_argument("--int16", nargs="+", default=["on"], choices=["on", "off"],
                    help="gguf: the int16-activation tiles (AVX512_VNNI builds: the GEMM tiles of Q4_0/Q4_1/"
                         "Q8_0; AVX2 builds: the GEMV tiles; on, the default) or the fp32 tiles (off)")
    ap.add_argument("--prefill", type=int, default=0,
                    help="time a prefill of this many tokens (one sequence) per variant instead of decode steps "
                         "(--steps prefills a round)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time steps by the process's CPU time, not the wall clock (one thread, OMP_NUM_THREADS=1, "
                         "on a shared machine: other processes' load then costs no time, only cache)")
    a = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if a.cpu_time else time.perf_counter
    print(cpu_threads())
    decoders = {}
    for quant in a.quantizations:
        for r in a.residual_dtypes if quant == "none" else ["float32"]:
            lm = load_model(None, dtype="auto" if quant == "gguf" else a.dtype, residual_dtype=r,
                            quantization=quant, progress=False)
            kind = "GGUF packed" if quant == "gguf" else a.dtype
            for path in a.paths:
                for fused in a.fused if lm.model.fused_decode is not None else ["on"]:
                    for tiles in a.tiles if quant == "gguf" else ["fused"]:
                        for gemm, int16 in [(g, i) for g in a.gemm for i in a.int16] if quant == "gguf" \
                                else [("on", "on")]:
                            label = f", fused layers {fused}" if lm.model.fused_decode is not None else ""
                            label += f", {tiles} tiles, gemm {gemm}, int16 {int16}" if quant == "gguf" else ""
                            name = f"{kind}, residual {str(lm.model.residual_dtype).removeprefix('torch.')}, {path}{label}"
                            if a.prefill:
                                decoders[name] = (make_prefiller(lm.model, a.prefill, tiles=tiles, gemm=gemm,
                                                                 int16=int16), [])
                            else:
                                decoders[name] = (make_decoder(lm.model, a.num_seqs, path=path, fused=fused == "on",
                                                               tiles=tiles, gemm=gemm, int16=int16), [])
    layers = lm.model.config.num_hidden_layers
    step = 1
    for rnd in range(a.rounds):
        for name, (decode, medians) in decoders.items():
            times = sorted(decode(s) for s in range(step, step + a.steps))
            step += a.steps
            medians.append(times[len(times) // 2])
            what = f"prefill of {a.prefill} tokens" if a.prefill else f"decode step of {a.num_seqs}"
            print(f"round {rnd} {name}: {what}: median {medians[-1] * 1e3:.1f} ms, "
                  f"best {times[0] * 1e3:.1f} ms", flush=True)
    for name, (decode, medians) in decoders.items():
        spread = f" (rounds' medians {min(medians) * 1e3:.1f}-{max(medians) * 1e3:.1f})" if len(medians) > 1 else ""
        mid = statistics.median(medians)
        print(f"{name}: median of medians {mid * 1e3:.1f} ms{spread}, {mid / layers * 1e6:.0f} us a layer")
    if a.no_profile:
        return
    for name, (decode, _) in decoders.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for s in range(step, step + 5):
                decode(s)
        step += 5
        print(name)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
