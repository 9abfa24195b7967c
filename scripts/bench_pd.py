"""Disaggregated prefill against one instance on the CPU (issue 36): TTFT of ~1k- and
~4k-token prompts, side by side in one run, the bundled SmolLM2, fp32, NIXL DRAM to DRAM
on loopback.

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_pd.py [--rounds 3] [--sizes 1024,4096]

One `tailrace cluster --prefill 1 --decode 1 --threads-per-replica 2` (each instance:
`--dtype float32 --max-model-len 8192 --kv-cache-memory-bytes 512Mi --block-size 16`).
Every round and prompt size, the modes alternate, each a streamed /v1/completions of
random token ids (a new prompt each time, so no prefix-cache hit), max_tokens 4:

- `one`: to the prefill instance directly (a single instance: its prefill, its first token);
- `pd`: through the P/D proxy (the prefill leg, the NIXL read, the decode leg's first token);
- `legs`: the two legs by hand, to split `pd`: the prefill leg (max_tokens 1,
  do_remote_decode, not streamed) and the decode leg's time to its first token (the side
  channel's layout is known by then: the NIXL read, one decode step, HTTP).

Prints one JSON line per request (ms) and a median per mode and size at the end."""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

LISTENING = "tailrace: listening on "
SERVE = ["--dtype", "float32", "--max-model-len", "8192", "--kv-cache-memory-bytes", "512Mi",
         "--block-size", "16", "--max-num-seqs", "4", "--log-level", "warning"]


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(tmp: Path, threads: int) -> tuple[subprocess.Popen, str, str, str]:
    ports = [free_port(), free_port()]
    out, err = tmp / "stdout.txt", tmp / "stderr.txt"
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(
            [sys.executable, "-m", "web.cli", "cluster", "--prefill", "1", "--decode", "1",
             "--port", "0", "--replica-ports", f"{ports[0]},{ports[1]}",
             "--threads-per-replica", str(threads), "--no-restart-replicas", *SERVE],
            stdout=o, stderr=e, env={**os.environ, "TQDM_DISABLE": "1"})
    deadline = time.monotonic() + 900
    while LISTENING not in out.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the cluster did not start:\n{err.read_text()[-3000:]}")
        time.sleep(0.5)
    url = out.read_text().split(LISTENING)[1].split()[0]
    return proc, url, f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}"


def stream_ttft(url: str, body: dict) -> tuple[float, float]:
    """(ms to the first chunk with text, ms to the end) of a streamed completion."""
    t0 = time.perf_counter()
    first = None
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                      timeout=600) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                first = time.perf_counter()
    end = time.perf_counter()
    return (first - t0) * 1e3, (end - t0) * 1e3


def legs(prefill: str, decode: str, body: dict) -> dict:
    t0 = time.perf_counter()
    r = httpx.post(f"{prefill}/v1/completions", timeout=600, json={
        **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    p_ms = (time.perf_counter() - t0) * 1e3
    params = r.json()["kv_transfer_params"]
    d_ttft, _ = stream_ttft(decode, {**body, "kv_transfer_params": params})
    return {"prefill_leg_ms": round(p_ms, 1), "decode_leg_ttft_ms": round(d_ttft, 1),
            "blocks": len(params["remote_block_ids"])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sizes", default="1024,4096")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url, prefill, decode = start(Path(tmp), args.threads)
        try:
            model = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]

            def body(n: int) -> dict:
                return {"model": model, "prompt": [rng.randrange(1000, 40000) for _ in range(n)],
                        "max_tokens": 4, "temperature": 0, "ignore_eos": True}

            for n in (64, 64):                      # warm-up: both paths, a short prompt
                stream_ttft(prefill, body(n))
                stream_ttft(url, body(n))
            got: dict[tuple[int, str], list[float]] = {}
            for rnd in range(args.rounds):
                for size in map(int, args.sizes.split(",")):
                    for mode in ("one", "pd", "legs") if rnd % 2 == 0 else ("legs", "pd", "one"):
                        row = {"round": rnd, "tokens": size, "mode": mode}
                        if mode == "legs":
                            row.update(legs(prefill, decode, body(size)))
                            for k in ("prefill_leg_ms", "decode_leg_ttft_ms"):
                                got.setdefault((size, k), []).append(row[k])
                        else:
                            ttft, total = stream_ttft(prefill if mode == "one" else url,
                                                      body(size))
                            row.update(ttft_ms=round(ttft, 1), total_ms=round(total, 1))
                            got.setdefault((size, mode), []).append(ttft)
                        print(json.dumps(row), flush=True)
            for (size, what), xs in got.items():
                print(json.dumps({"tokens": size, "median": what,
                                  "ms": round(statistics.median(xs), 1), "n": len(xs)}))
            text = httpx.get(f"{decode}/metrics", timeout=60).text
            cached = re.search(r"^tailrace:cached_tokens_total(?:{[^}]*})? (\S+)$", text, re.M)
            print(json.dumps({"decode_cached_tokens_total": float(cached.group(1))}))
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
