"""The H200 stand-in's offline run (`tailrace bench throughput --simulate-gpu h200 --workload
nano-vllm`) in two or more trees, taking turns, each run a fresh process with its own
PYTHONPATH and one OpenMP thread, so that every tree sees the same minutes of a shared machine.
Prints, per run, the load average at its start, the fraction of the stand-in's ceiling it
reached, the host time per step on the critical path (and its split: back late from the wait,
waiting for the plan), and the process's CPU time in the timed window per output token (what
the load moves least); then each tree's medians.

    .venv/bin/python scripts/bench_standin_ab.py /tmp/before . --rounds 3 [--config gpu/configs/qwen3-30b-a3b]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def one(tree: Path, config: str, tokenizer: str) -> dict:
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "r.json"
        cmd = [sys.executable, "-c", "import sys; from web.cli import main; sys.argv[0] = 'tailrace'; sys.exit(main())",
               "bench", "throughput", config, "--tokenizer", tokenizer, "--simulate-gpu", "h200",
               "--workload", "nano-vllm", "--output-json", str(out)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(tree))
        subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True)
        r = json.loads(out.read_text())
    r["load"] = load
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trees", nargs="+", type=Path)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--config", default="gpu/configs/qwen3-0.6b")
    p.add_argument("--tokenizer", default=None, help="default: the bundled SmolLM2 GGUF")
    a = p.parse_args()
    tok = a.tokenizer
    if tok is None:
        from gpu.loader.decoder import default_model_path
        tok = str(default_model_path())
    seen: dict[str, list[dict]] = {}
    for _ in range(a.rounds):
        for tree in a.trees:
            r = one(tree.resolve(), a.config, tok)
            seen.setdefault(str(tree), []).append(r)
            print(f"{time.strftime('%H:%M:%S')} load {r['load']:5.2f} {tree!s:24s} reached "
                  f"{r['fraction_of_ceiling'] * 100:5.1f}%  host {r['host_ms_per_step']:6.2f} ms/step "
                  f"(late {r['late_ms_per_step']:5.2f}, starved {r['starved_ms_per_step']:5.2f})  CPU "
                  f"{r['cpu_s'] / r['output_tokens'] * 1e6:5.1f} us/token", flush=True)
    for tree, rs in seen.items():
        f = [r["fraction_of_ceiling"] * 100 for r in rs]
        c = [r["cpu_s"] / r["output_tokens"] * 1e6 for r in rs]
        print(f"{tree}: reached median {statistics.median(f):.1f}% ({min(f):.1f}-{max(f):.1f}), CPU median "
              f"{statistics.median(c):.1f} us/token ({min(c):.1f}-{max(c):.1f})")


if __name__ == "__main__":
    main()
