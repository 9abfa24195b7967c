"""On paper: the H200 stand-in's steps (gpu/worker/simulate.py CostModel, a hybrid's Gated
DeltaNet layers priced by gpu/worker/simulate_linear.py) for Qwen3-Next-80B-A3B's FP8 release
against Qwen3-30B-A3B in bf16 (both fit one H200): decode at 1, 32 and 256 sequences of 1024
tokens of context and one 8192-token prefill, with the hybrid's part for its states and delta
rule and the kernels' launches, and the KV blocks each keeps.

    python scripts/hybrid_step_cost.py
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gpu.loader.decoder import load_shell  # noqa: E402
from gpu.worker.simulate import GPUS, CostModel  # noqa: E402

CONFIGS = ("qwen3-next-80b-a3b-fp8", "qwen3-30b-a3b")


def main() -> None:
    g = GPUS["h200"]
    print("| config | step | ms | of which states + delta rule | of which launches |")
    print("|---|---|---|---|---|")
    for name in CONFIGS:
        shell = load_shell(os.path.join(ROOT, "gpu/configs", name))
        m = CostModel.of(shell.config, g, weights=shell.weight_format)
        steps = [(f"decode, {n} x 1024", [1] * n, [1024] * n, n) for n in (1, 32, 256)]
        steps.append(("prefill, 8192", [8192], [8192], 1))
        for what, q, ctx, rows in steps:
            mixers = m.linear.seconds(q, g.bandwidth * g.state_efficiency, g.fp32_flops) if m.linear else 0.0
            print(f"| {name} | {what} | {m.step_seconds(q, ctx, rows) * 1e3:.2f} | {mixers * 1e3:.2f} "
                  f"| {m.launch_seconds(q) * 1e3:.2f} |")
        slots = 256 if m.linear else 0
        print(f"| {name} | KV blocks of 16 at 0.9 of the memory, 256 sequences | "
              f"{m.kv_blocks(16, 0.9, slots)} | with prefix-cache snapshots: "
              f"{m.kv_blocks(16, 0.9, 2 * slots)} | |")


if __name__ == "__main__":
    main()
