"""On paper: the H200 stand-in's decode step (gpu/worker/simulate.py CostModel) for a model's
decoder linears in bf16, FP8 and W4A16 (and W8A8), from the bytes the Triton GEMMs read
(simulate.WEIGHT_BYTES), with the bf16 and the fp8 KV cache.

    python scripts/quant_step_cost.py [--config CONFIG.json] [--ctx 1024] [--gpu h200]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpu.models.registry import config_from_hf  # noqa: E402
from gpu.worker.simulate import GPUS, CostModel  # noqa: E402

QWEN3_8B = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu/configs/qwen3-8b/config.json")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=QWEN3_8B, help="a config.json (default: gpu/configs/qwen3-8b's)")
    p.add_argument("--ctx", type=int, default=1024, help="each sequence's context (default 1024)")
    p.add_argument("--gpu", default="h200")
    args = p.parse_args()
    config = config_from_hf(json.load(open(args.config)))
    gpu = GPUS[args.gpu]
    print(f"{gpu.name}: decode step of {config.architecture}, {config.num_hidden_layers} layers, "
          f"context {args.ctx} a sequence (ms; weights GB)")
    print("| weights | KV cache | weight GB | 1 seq | 8 seqs | 32 seqs | 128 seqs | 32 seqs vs bf16 |")
    print("|---|---|---|---|---|---|---|---|")
    base = None
    for kv, kv_bytes in (("bf16", 2), ("fp8", 1)):
        for fmt in ("bf16", "fp8", "w8a8", "w4a16"):
            cost = CostModel.of(config, gpu, weights=fmt, kv_elem_bytes=kv_bytes)
            ms = [cost.step_seconds([1] * b, [args.ctx] * b, b) * 1e3 for b in (1, 8, 32, 128)]
            base = base or ms[2]
            print(f"| {fmt} | {kv} | {cost.weight_bytes / 1e9:.2f} | " + " | ".join(f"{m:.2f}" for m in ms)
                  + f" | {base / ms[2]:.2f}x |")


if __name__ == "__main__":
    main()
