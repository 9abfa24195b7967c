"""Host cost of apply_logit_controls (logit_bias, allowed_token_ids, bad_words) next to
the sampler it runs before, on CPU logits of SmolLM2's vocabulary. Best of N, per step.

    .venv/bin/python scripts/bench_logit_controls.py --num-seqs 32 --vocab 49152
"""
from __future__ import annotations

import argparse
import time

import torch

from gpu.interface import SamplingOptions
from gpu.worker.sampler import SeqSamplingState, apply_logit_controls, sample


def best_us(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-seqs", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    b, v = args.num_seqs, args.vocab

    def seq(**controls) -> SeqSamplingState:
        st = SeqSamplingState(SamplingOptions(temperature=0.0, **controls), (), 0)
        st.output_ids = list(range(100))
        return st

    plain = [seq() for _ in range(b)]
    # a quarter each: 10 biased tokens, 50 allowed ids, 5 bad words (two multi-token), none
    kinds = [dict(logit_bias=tuple((i * 37, 1.0) for i in range(10))),
             dict(allowed_token_ids=tuple(range(0, 5000, 100))),
             dict(bad_words_token_ids=((5,), (98, 99, 7), (1, 2), (3,), (4, 4))), {}]
    mixed = [seq(**kinds[i * 4 // b]) for i in range(b)]
    logits = torch.randn(b, v, generator=torch.Generator().manual_seed(0))
    rows = [  # each timing includes one copy of the logits (the first row), except the no-op
        ("copy of the logits", best_us(lambda: logits.clone(), args.repeats)),
        ("apply_logit_controls, no row uses them", best_us(lambda: apply_logit_controls(logits, plain), args.repeats)),
        ("apply_logit_controls, 3/4 of the rows", best_us(lambda: apply_logit_controls(logits.clone(), mixed), args.repeats)),
        ("greedy sample(), no controls", best_us(lambda: sample(logits.clone(), plain), args.repeats)),
        ("greedy sample() after the controls", best_us(lambda: sample(apply_logit_controls(logits.clone(), mixed), mixed), args.repeats)),
    ]
    print(f"{b} sequences x {v} vocabulary, torch threads {torch.get_num_threads()}")
    for name, us in rows:
        print(f"{name:42s} {us:9.1f} us")


if __name__ == "__main__":
    main()
