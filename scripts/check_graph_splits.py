"""CUDA graphs against eager, for every KV split count a graph may be captured with.

    python scripts/check_graph_splits.py --config gpu/configs/qwen3-0.6b --dtype bfloat16 \
        --out results/graph_splits.json

One decode step of a batch with mixed context lengths (some shorter than a split's share,
so some splits see nothing) runs four ways per split count S in --splits (1, 4, 8, 16):
eager with no split (the reference), eager with S splits, and the CUDA graph captured with
S splits (DecodeGraphs, its split count forced), each at every batch size in --batch-sizes
(a padded graph size included). The final hidden states must agree: bitwise is not
expected (a split changes the order of the softmax's sums), so within --tol of the
reference's magnitude. The KV cache holds random values; the step writes the same new
k/v every time, so the runs see the same cache.

Without CUDA it runs the eager half only, under the Triton interpreter, at a tiny config
(the dry run's smoke test); the graphs need a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gpu.layers.attention import KVCache, TritonPagedAttention  # noqa: E402
from gpu.loader.decoder import load_model  # noqa: E402
from gpu.interface import SeqChunk  # noqa: E402
from gpu.worker.staging import prepare_step  # noqa: E402


def check(config: str, dtype: str, splits: list[int], batch_sizes: list[int], max_ctx: int,
          block_size: int = 16, seed: int = 0, tol: float = 2e-2) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lm = load_model(config, load_format="dummy", dtype=dtype, device=str(device), seed=seed,
                    progress=False).model
    c = lm.config
    rng = random.Random(seed)
    max_bs = max(batch_sizes)
    blocks_per_seq = -(-max_ctx // block_size)
    cache = KVCache(c.num_hidden_layers, max_bs * blocks_per_seq, block_size, c.num_key_value_heads,
                    c.head_dim, lm.dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for t in cache.k + cache.v:
        t.copy_(torch.randn(t.shape, generator=gen, device=device, dtype=torch.float32).to(t.dtype))
    attn = TritonPagedAttention(cache, c.head_dim ** -0.5)
    results, ok = [], True
    for bs in batch_sizes:
        # mixed lengths: 1 token, a few, and long ones (splits that see nothing included)
        ctx = [rng.choice([1, 2, 17, max_ctx // 3, max_ctx]) for _ in range(bs)]
        chunks = tuple(SeqChunk(f"s{i}", (rng.randrange(min(c.vocab_size, 1000)),), n - 1,
                                tuple(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), True)
                       for i, n in enumerate(ctx))
        ids, pos, meta, _ = prepare_step(chunks, block_size, device)

        def eager(s: int) -> torch.Tensor:
            meta.num_kv_splits = s
            attn.prepare(meta)
            with torch.inference_mode():
                return lm(ids, pos, attn).float()

        ref = eager(1)
        scale = ref.abs().max().item() or 1.0
        for s in splits:
            row = dict(batch=bs, splits=s, ctx=ctx)
            row["eager_err"] = float(f"{(eager(s) - ref).abs().max().item() / scale:.3g}")
            if device.type == "cuda":
                from gpu.worker.cuda_graphs import DecodeGraphs
                graphs = DecodeGraphs(lm, attn, max_bs=max_bs, max_blocks=blocks_per_seq, device=device,
                                      max_context=max_ctx)
                graphs.num_kv_splits = {b: s for b in graphs.sizes}
                graphs.capture()
                with torch.inference_mode():
                    got = graphs.run(ids, pos, meta).float()
                row["graph_size"] = next(g for g in graphs.sizes if g >= bs)
                row["graph_err"] = float(f"{(got - ref).abs().max().item() / scale:.3g}")
                del graphs
            row["ok"] = row["eager_err"] <= tol and row.get("graph_err", 0.0) <= tol
            ok &= row["ok"]
            results.append(row)
            print(json.dumps(row), flush=True)
    return dict(device=str(device), dtype=dtype, config=config, tol=tol,
                graphs=device.type == "cuda", ok=ok, results=results)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="gpu/configs/qwen3-0.6b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--splits", default="1,4,8,16")
    p.add_argument("--batch-sizes", default="1,3,8",
                   help="decode batch sizes (3 replays the graph captured for 4: padding rows)")
    p.add_argument("--max-ctx", type=int, default=2000)
    p.add_argument("--tol", type=float, default=2e-2, help="largest error over the reference's largest value")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    result = check(args.config, args.dtype, [int(x) for x in args.splits.split(",")],
                   [int(x) for x in args.batch_sizes.split(",")], args.max_ctx, tol=args.tol)
    result["elapsed_s"] = round(time.perf_counter() - t0, 2)
    print(json.dumps({k: v for k, v in result.items() if k != "results"}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
