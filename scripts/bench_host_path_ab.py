"""scripts/bench_host_path.py's workload, two trees side by side in one run: each tree in
a process of its own (its own PYTHONPATH), taking turns one pass at a time, so that both
see the same minutes of a shared machine. Prints, per tree, the best and the median CPU
time (thread_time: what other processes' load moves least) and wall time per token.

    .venv/bin/python scripts/bench_host_path_ab.py /work/wt/base . --num-seqs 32 --steps 128

A worker needs only what bench_host_path.py imports (Detokenizer, Parser, Accountant,
Emitter, Delta, Step, tests/support/rendered.py, before issue 54 tests/stages/rendered.py),
so any commit since issue 20 can be the other tree; each tree's worker is that tree's own
copy of this script (its own layout's imports), or this one where the tree has none.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def worker(num_seqs: int, steps: int, stop: bool) -> None:
    """One tree's side: builds the workload, then one timed pass per line read."""
    import random
    import time

    try:            # the tree's root is the working directory (on sys.path as PYTHONPATH)
        from tests.support.rendered import rendered
    except ImportError:     # a tree from before tests/support (issue 54)
        sys.path.insert(0, str(Path.cwd() / "tests" / "stages"))
        from rendered import rendered

    from gpu.tokenizers.files import load_tokenizer
    from stages.account import Accountant
    from stages.detokenize import Detokenizer
    from stages.emit import Emitter
    from stages.delta import Delta, FinishReason
    from stages.messages import Step
    from stages.parse import Parser

    rng = random.Random(0)
    tok = load_tokenizer(None)
    n, s = num_seqs, steps
    extra = {"stop": ("\x00never",)} if stop else {}
    reqs = tuple(rendered(f"r{i}", tuple(rng.randrange(100, 20000) for _ in range(128)),
                          stream=True, include_usage=False, max_tokens=s, **extra)
                 for i in range(n))
    plan = [Step(k, reqs if k == 0 else (), tuple(
        Delta(r.request_id, (rng.randrange(100, 20000),),
              FinishReason.LENGTH if k == s - 1 else None) for r in reqs)) for k in range(s)]
    for _ in sys.stdin:
        d, p, a, e = Detokenizer(tok), Parser(None), Accountant(), Emitter()
        c, t = time.thread_time(), time.perf_counter()
        for step in plan:
            e.process(a.process(p.process(d.process(step)[0]))[0])
        out = {"cpu": time.thread_time() - c, "wall": time.perf_counter() - t}
        print(json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="*", help="the repositories' roots to compare")
    ap.add_argument("--num-seqs", type=int, default=32)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--passes", type=int, default=30, help="timed passes per tree")
    ap.add_argument("--stop", action="store_true",
                    help="every request with a stop string that never matches (detokenize's "
                         "general path, not the plain-token one)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.num_seqs, args.steps, args.stop)
        return
    workers = []
    for tree in args.trees:
        root = Path(tree).resolve()
        env = dict(os.environ, PYTHONPATH=str(root))
        # each tree's own copy of this script is its worker: it imports that tree's layout
        own = root / "scripts" / Path(__file__).name
        cmd = [sys.executable, str(own if own.is_file() else Path(__file__).resolve()),
               "--worker", "--num-seqs",
               str(args.num_seqs), "--steps", str(args.steps)] + (["--stop"] if args.stop else [])
        workers.append((root, subprocess.Popen(cmd, cwd=root, env=env, text=True,
                                               stdin=subprocess.PIPE, stdout=subprocess.PIPE)))
    runs: dict[Path, list[dict]] = {root: [] for root, _ in workers}
    for _ in range(args.passes):
        for root, proc in workers:        # in turn: each pass of one, then of the other
            proc.stdin.write("\n")
            proc.stdin.flush()
            runs[root].append(json.loads(proc.stdout.readline()))
    for _, proc in workers:
        proc.stdin.close()
        proc.wait()
    tokens = args.num_seqs * args.steps
    for root, got in runs.items():
        cpu = sorted(r["cpu"] / tokens * 1e6 for r in got)
        wall = sorted(r["wall"] / tokens * 1e6 for r in got)
        print(f"{root}: cpu best {cpu[0]:.2f} median {statistics.median(cpu):.2f} us/token; "
              f"wall best {wall[0]:.2f} median {statistics.median(wall):.2f} us/token "
              f"({len(got)} passes of {args.num_seqs} x {args.steps})")


if __name__ == "__main__":
    main()
