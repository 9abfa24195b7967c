"""Host cost of the downstream stages alone: detokenize -> parse -> account -> emit over
N streaming completions of S tokens each, with SmolLM2's real tokenizer and no model.
Prints the best of 7 runs, in ms per engine step.

    .venv/bin/python scripts/bench_host_path.py --num-seqs 32 --steps 128
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the repo root: tests.support

from tests.support.rendered import rendered

from gpu.tokenizers.files import load_tokenizer
from stages.account import Accountant
from stages.delta import Delta, FinishReason
from stages.detokenize import Detokenizer
from stages.emit import Emitter
from stages.parse import Parser
from stages.messages import Step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-seqs", type=int, default=32)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    rng = random.Random(0)
    tok = load_tokenizer(None)
    n, s = args.num_seqs, args.steps
    reqs = tuple(rendered(f"r{i}", tuple(rng.randrange(100, 20000) for _ in range(128)),
                          stream=True, include_usage=False, max_tokens=s) for i in range(n))
    steps = [Step(k, reqs if k == 0 else (), tuple(
        Delta(r.request_id, (rng.randrange(100, 20000),),
              FinishReason.LENGTH if k == s - 1 else None) for r in reqs)) for k in range(s)]
    best = float("inf")
    for _ in range(args.repeats):
        d, p, a, e = Detokenizer(tok), Parser(None), Accountant(), Emitter()
        t = time.perf_counter()
        for step in steps:
            e.process(a.process(p.process(d.process(step)[0]))[0])
        best = min(best, time.perf_counter() - t)
    print(f"{best / s * 1e3:.3f} ms per step of {n} sequences "
          f"({best / (s * n) * 1e6:.2f} us per token)")


if __name__ == "__main__":
    main()
