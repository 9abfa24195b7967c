"""Multi-LoRA's cost per step, in process (issue 60): the model's forward over ROWS one-token
sequences (the linears and LoRA hooks of a decode step of ROWS rows; attention over a context
of one, so the ratio is an upper bound on the served step's), with the logits. Phases run
interleaved, REPS times each, and each reports its median and best time:
  base        no LoRA row
  mix4        rows round-robin over four adapters of ranks 8/16/32/64 (all seven linears),
              the CPU default path (gpu/kernels/cpu/lora.c where it builds)
  mix4_torch  the same rows through issue 33's torch grouped matmuls

    python scripts/bench_lora_step.py [--rows 32 --reps 20 --dtype auto]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    import torch

    from gpu.interface import LoRARef, SeqChunk
    from gpu.layers.attention_dense import DenseCausalAttention
    from gpu.loader.decoder import load_model
    from gpu.lora.adapters import LoRAManager
    from scripts.bench_lora import make_adapter

    loaded = load_model(args.model, dtype=args.dtype, progress=False)
    model, mc = loaded.model, loaded.model.config
    cfg = dict(head_dim=mc.head_dim, heads=mc.num_attention_heads, kv_heads=mc.num_key_value_heads,
               hidden=mc.hidden_size, inter=mc.intermediate_size, layers=mc.num_hidden_layers)
    tmp = Path(tempfile.mkdtemp(prefix="bench-lora-step-"))
    refs = []
    for i, r in enumerate((8, 16, 32, 64)):
        make_adapter(tmp / f"r{r}", r, cfg, i)
        refs.append(LoRARef(f"r{r}", i + 1, str(tmp / f"r{r}")))
    dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
    mgr = LoRAManager(model, max_loras=4, max_cpu_loras=4, max_rank=64, dtype=dtype,
                      device=torch.device("cpu"))
    backend = mgr.backend
    chunks = [SeqChunk(f"s{i}", (100 + i,), 0, (), True) for i in range(args.rows)]
    for i in range(args.rows):
        mgr.start(f"s{i}", refs[i % 4])
    ids = torch.tensor([c.token_ids[0] for c in chunks], dtype=torch.int64)
    positions = torch.zeros(args.rows, dtype=torch.int64)
    attn = DenseCausalAttention([1] * args.rows)

    def step(phase: str) -> float:
        mgr.backend = "torch" if phase == "mix4_torch" else backend
        if phase != "base":
            mgr.prepare(chunks)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.compute_logits(model(ids, positions, attn))
        dt = time.perf_counter() - t0
        mgr.done()
        return dt

    phases = ["base", "mix4", "mix4_torch"]
    times = {p: [] for p in phases}
    for p in phases:
        step(p)   # warm-up: adapters loaded and packed
    load0 = os.getloadavg()[0]
    for _ in range(args.reps):
        for p in phases:
            times[p].append(step(p))
    out = {"rows": args.rows, "reps": args.reps, "dtype": str(dtype), "lora_backend": backend,
           "threads": torch.get_num_threads(),
           "load_average": [round(load0, 1), round(os.getloadavg()[0], 1)]}
    for p in phases:
        out[p] = {"median_ms": round(1000 * statistics.median(times[p]), 1),
                  "best_ms": round(1000 * min(times[p]), 1)}
    for p in phases[1:]:
        out[p]["median_vs_base"] = round(out[p]["median_ms"] / out["base"]["median_ms"], 3)
        out[p]["best_vs_base"] = round(out[p]["best_ms"] / out["base"]["best_ms"], 3)
    mgr.close()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
