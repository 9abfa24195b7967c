"""llama.cpp's own decode loop at one stream, from a prebuilt wheel (issue 39): no build.

The prebuilt `llama-cpp-py-sync` wheel ships llama.cpp's libllama/libggml-cpu (an AVX2
build, no AVX-512: it runs on every CPU seen here) behind cffi. This script is what
llama-bench's `tg` measures plus greedy sampling: a prompt of N_IN random ids, then N_OUT
decodes of one token each (llama_decode, the last row's logits, argmax), timed one by one.
No HTTP, no scheduler: the floor of what llama-server's TPOT can be on this machine, so a
tailrace server at or under it is at least as fast as llama-server at one stream.

Run it in a venv of its own (the wheel is a benchmark's, not a dependency of tailrace):

    python -m venv /tmp/lcvenv && /tmp/lcvenv/bin/pip install cffi llama-cpp-py-sync==0.11739
    /tmp/lcvenv/bin/python scripts/bench_llamacpp_lib.py --model GGUF --threads 2 --rounds 3

scripts/bench_vs_llamacpp.sh lib runs it beside `tailrace serve` + `tailrace bench serve`.

--parallel N (issue 60): N sequences at once, what llama-server does with `-np N` minus HTTP
and its scheduler: each wave of N random prompts prefilled one sequence at a time (N_IN tokens
each, a batch of its own), then N_OUT steps that decode the N sequences' next tokens in one
batch (llama_decode of N tokens, N rows of logits, argmax each). --prompts P (a multiple of N):
P / N waves. Reports output tok/s over the whole run (prefill included, as `tailrace bench
serve`'s output throughput is) and the median decode step:

    /tmp/lcvenv/bin/python scripts/bench_llamacpp_lib.py --model GGUF --threads 2 --parallel 32 --prompts 64
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def one_round(llm, n_in: int, n_out: int, seed: int) -> list[float]:
    import numpy as np

    lib, ctx = llm._lib, llm._ctx
    rng = random.Random(seed)
    vocab = llm.n_vocab
    llm._clear_context_state()
    prompt = [rng.randrange(vocab) for _ in range(n_in)]
    n_past = llm._eval_tokens(prompt, 0)
    gaps = []
    for _ in range(n_out):
        t0 = time.perf_counter()
        ptr = lib.llama_get_logits_ith(ctx, -1)
        logits = np.frombuffer(llm._ffi.buffer(ptr, vocab * 4), dtype=np.float32)
        tok = int(logits.argmax())
        n_past = llm._eval_tokens([tok], n_past)
        gaps.append(time.perf_counter() - t0)
    return gaps


def parallel_round(llm, n_in: int, n_out: int, n_par: int, prompts: int, seed: int) -> dict:
    """prompts / n_par waves of n_par sequences: prefill each, then n_out batched decode steps."""
    import numpy as np

    lib, ctx, ffi = llm._lib, llm._ctx, llm._ffi
    rng = random.Random(seed)
    vocab = llm.n_vocab
    mem = lib.llama_get_memory(ctx)
    steps, t_start, c_start = [], time.perf_counter(), time.process_time()
    batch = lib.llama_batch_init(max(n_in, n_par), 0, 1)
    try:
        for _ in range(prompts // n_par):
            lib.llama_memory_clear(mem, True)
            last = []
            for s in range(n_par):   # prefill: one sequence a batch
                batch.n_tokens = n_in
                for i in range(n_in):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i] = rng.randrange(vocab), i, 1
                    batch.seq_id[i][0], batch.logits[i] = s, 0
                batch.logits[n_in - 1] = 1
                if lib.llama_decode(ctx, batch):
                    raise RuntimeError("llama_decode failed (prefill)")
                ptr = lib.llama_get_logits_ith(ctx, -1)
                last.append(int(np.frombuffer(ffi.buffer(ptr, vocab * 4), dtype=np.float32).argmax()))
            for step in range(n_out - 1):   # the first output token came from the prefill
                t0 = time.perf_counter()
                batch.n_tokens = n_par
                for s in range(n_par):
                    batch.token[s], batch.pos[s], batch.n_seq_id[s] = last[s], n_in + step, 1
                    batch.seq_id[s][0], batch.logits[s] = s, 1
                if lib.llama_decode(ctx, batch):
                    raise RuntimeError("llama_decode failed (decode)")
                for s in range(n_par):
                    ptr = lib.llama_get_logits_ith(ctx, s)
                    last[s] = int(np.frombuffer(ffi.buffer(ptr, vocab * 4), dtype=np.float32).argmax())
                steps.append(time.perf_counter() - t0)
    finally:
        lib.llama_batch_free(batch)
    wall, cpu = time.perf_counter() - t_start, time.process_time() - c_start
    return {"output_tok_s": prompts * n_out / wall, "step_median_ms": statistics.median(steps) * 1e3,
            "wall_s": wall, "cpu_ms_per_token": cpu * 1e3 / (prompts * n_out)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the GGUF file")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-in", type=int, default=128)
    ap.add_argument("--n-out", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="one JSON line per round")
    ap.add_argument("--parallel", type=int, default=0, help="N sequences decoded together (0: one stream)")
    ap.add_argument("--prompts", type=int, default=0, help="with --parallel: prompts a round (default N)")
    args = ap.parse_args()

    from llama_cpp_py_sync import Llama, __llama_cpp_tag__, __version__

    n_par = max(args.parallel, 1)
    # as bench_vs_llamacpp.sh starts llama-server: -np N -c N * (N_IN + N_OUT + 64)
    llm = Llama(args.model, n_ctx=n_par * (args.n_in + args.n_out + (64 if args.parallel else 16)),
                n_batch=512, n_threads=args.threads, n_threads_batch=args.threads, verbose=False,
                n_seq_max=n_par)
    # the wheel's Llama keeps embeddings on for its audio API; a server's context does not
    llm._lib.llama_set_embeddings(llm._ctx, False)
    one_round(llm, 16, 8, seed=-1)      # warm-up: first-touch of the weights
    if args.parallel:
        prompts = args.prompts or n_par
        for r in range(args.rounds):
            row = parallel_round(llm, args.n_in, args.n_out, n_par, prompts, seed=r)
            row.update({"llama_cpp": __llama_cpp_tag__, "round": r, "threads": args.threads, "parallel": n_par})
            print(json.dumps(row) if args.json else
                  f"llama.cpp {__llama_cpp_tag__} (lib) round {r}: {n_par} sequences, {prompts} prompts: output "
                  f"{row['output_tok_s']:.1f} tok/s, decode step p50 {row['step_median_ms']:.1f} ms, "
                  f"{row['wall_s']:.1f} s, CPU {row['cpu_ms_per_token']:.1f} ms per output token "
                  f"({args.threads} threads)", flush=True)
        llm.close()
        return
    for r in range(args.rounds):
        c0 = time.process_time()
        gaps = one_round(llm, args.n_in, args.n_out, seed=r)
        cpu_ms = (time.process_time() - c0) * 1e3 / args.n_out   # prefill included
        ms = [g * 1e3 for g in gaps]
        row = {"llama_cpp": __llama_cpp_tag__, "wheel": __version__, "round": r,
               "threads": args.threads, "tpot_median_ms": statistics.median(ms),
               "tpot_mean_ms": statistics.fmean(ms), "tok_s": len(ms) / (sum(ms) / 1e3),
               "cpu_ms_per_token": cpu_ms}
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            print(f"llama.cpp {__llama_cpp_tag__} (lib) round {r}: TPOT p50 "
                  f"{row['tpot_median_ms']:.2f} ms, mean {row['tpot_mean_ms']:.2f} ms, "
                  f"{row['tok_s']:.1f} tok/s, CPU {cpu_ms:.1f} ms per output token ({args.threads} threads)",
                  flush=True)
    llm.close()


if __name__ == "__main__":
    main()
