"""Data parallel on the CPU (issue 36): `-dp 2` (two engines, one thread each) against one
engine with two threads, side by side in one run, the bundled SmolLM2, fp32.

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_dp.py [--rounds 1] [--num-prompts 32]

Each mode: `tailrace serve --port 0 --dtype float32 --max-model-len 1024
--kv-cache-memory-bytes 256Mi MODE_FLAGS` (dp2: `-dp 2`, each engine takes
cpu_count/2 threads; dp1: `-asc 1` with OMP_NUM_THREADS unset, torch's default
of every core), then `tailrace bench serve --backend openai-completions
--num-prompts 32 --max-concurrency 32 --random-input-len 128 --random-output-len 128
--random-range-ratio 0 --ignore-eos`, rounds alternating the modes. Prints one JSON line
per run (output tok/s, mean TTFT and TPOT in ms)."""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = {"dp2": ["--data-parallel-size", "2"], "dp1x2threads": ["--api-server-count", "1"]}


def tailrace() -> list[str]:
    exe = Path(sys.executable).with_name("tailrace")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "web.cli"]


def serve(flags: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    out = open(log, "wb")
    proc = subprocess.Popen([*tailrace(), "serve", "--port", "0", "--dtype", "float32",
                             "--max-model-len", "1024", "--kv-cache-memory-bytes", "256Mi",
                             "--log-level", "warning", *flags], stdout=out, stderr=out)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("tailrace: listening on "):
                return proc, line.split()[-1]
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {log.read_text()[-2000:]}")
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start")


def bench(url: str, n: int, result: Path) -> dict:
    subprocess.run([*tailrace(), "bench", "serve", "--backend", "openai-completions",
                    "--base-url", url, "--num-prompts", str(n), "--max-concurrency", str(n),
                    "--random-input-len", "128", "--random-output-len", "128",
                    "--random-range-ratio", "0", "--ignore-eos", "--disable-tqdm",
                    "--save-result", "--result-dir", str(result.parent),
                    "--result-filename", result.name], check=True, stdout=subprocess.DEVNULL)
    return json.loads(result.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=32)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_dp"))
    for r in range(args.rounds):
        for mode, flags in MODES.items():
            proc, url = serve(flags, tmp / f"{mode}-{r}.log")
            try:
                res = bench(url, args.num_prompts, tmp / f"{mode}-{r}.json")
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
            print(json.dumps({"mode": mode, "round": r, "load": os.getloadavg()[0],
                              "output_tok_s": round(res["output_throughput"], 1),
                              "mean_ttft_ms": round(res["mean_ttft_ms"], 1),
                              "mean_tpot_ms": round(res["mean_tpot_ms"], 1),
                              "completed": res["completed"]}), flush=True)


if __name__ == "__main__":
    main()
