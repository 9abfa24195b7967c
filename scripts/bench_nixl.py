"""NIXL KV reads on loopback (issue 36): the time to read N blocks of SmolLM2-135M's cache
(30 layers, 3 KV heads of 64, fp32, 16-token blocks: 720 KiB a block) from one
gpu.kv_transfer.nixl.NixlKV into another, both agents in this process (UCX picks its transport:
shared memory or tcp on loopback).

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_nixl.py [--repeat 20]

Per request size (1 block; 64 blocks = a 1k-token prompt; 256 = 4k): median and best ms
per read, and the bandwidth. Consecutive blocks are one descriptor a layer (K, V); the
scattered case reads every other block (one descriptor per block and layer)."""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from gpu.layers.attention import KVCache
from gpu.kv_transfer.nixl import NixlKV


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--no-progress-thread", action="store_true",
                    help="both agents without NIXL's progress thread (what the KV connector "
                         "runs on the CPU): the reader's polls drive UCX")
    ap.add_argument("--sizes", default="1,64,64s,256,256s",
                    help="blocks per read; a trailing s: every other block (scattered)")
    args = ap.parse_args()
    n = 520
    src, dst = (KVCache(30, n, 16, 3, 64, torch.float32, "cpu") for _ in range(2))
    for t in (*src.k, *src.v):
        t.normal_()
    prog = not args.no_progress_thread
    p = NixlKV("bench-p", src, progress_thread=prog)
    d = NixlKV("bench-d", dst, progress_thread=prog)
    layout = p.layout()
    remote = d.add_remote(layout)
    block_bytes = 2 * sum(p.block_bytes)
    sizes = [(int(x.rstrip("s")), x.endswith("s")) for x in args.sizes.split(",")]
    for blocks, scattered in sizes:
        ids = list(range(0, 2 * blocks, 2)) if scattered else list(range(blocks))
        times = []
        for _ in range(args.repeat + 1):
            t0 = time.perf_counter()
            h = d.read(remote, layout, ids, ids)
            while not d.done(h):
                if not prog:
                    p.notifications()  # the owner's side progresses too (no thread)
            times.append(time.perf_counter() - t0)
        times = times[1:]          # the first read sets up the connection
        med = statistics.median(times)
        print(json.dumps({"blocks": blocks, "tokens": blocks * 16, "scattered": scattered,
                          "MiB": round(blocks * block_bytes / 2**20, 1),
                          "median_ms": round(med * 1e3, 2),
                          "best_ms": round(min(times) * 1e3, 2),
                          "ms_per_block": round(med * 1e3 / blocks, 3),
                          "GiB_s": round(blocks * block_bytes / med / 2**30, 2)}), flush=True)
    top = max(b for b, _ in sizes)
    assert torch.equal(dst.k[5][:top:2], src.k[5][:top:2])
    p.close()
    d.close()


if __name__ == "__main__":
    main()
