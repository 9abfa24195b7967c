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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the GGUF file")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-in", type=int, default=128)
    ap.add_argument("--n-out", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="one JSON line per round")
    args = ap.parse_args()

    from llama_cpp_py_sync import Llama, __llama_cpp_tag__, __version__

    llm = Llama(args.model, n_ctx=args.n_in + args.n_out + 16, n_batch=512,
                n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    # the wheel's Llama keeps embeddings on for its audio API; a server's context does not
    llm._lib.llama_set_embeddings(llm._ctx, False)
    one_round(llm, 16, 8, seed=-1)      # warm-up: first-touch of the weights
    for r in range(args.rounds):
        gaps = one_round(llm, args.n_in, args.n_out, seed=r)
        ms = [g * 1e3 for g in gaps]
        row = {"llama_cpp": __llama_cpp_tag__, "wheel": __version__, "round": r,
               "threads": args.threads, "tpot_median_ms": statistics.median(ms),
               "tpot_mean_ms": statistics.fmean(ms), "tok_s": len(ms) / (sum(ms) / 1e3)}
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            print(f"llama.cpp {__llama_cpp_tag__} (lib) round {r}: TPOT p50 "
                  f"{row['tpot_median_ms']:.2f} ms, mean {row['tpot_mean_ms']:.2f} ms, "
                  f"{row['tok_s']:.1f} tok/s ({args.threads} threads)", flush=True)
    llm.close()


if __name__ == "__main__":
    main()
