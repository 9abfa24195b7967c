"""Weight memory of gpt-oss-20b and gpt-oss-120b as tailrace would hold them, experts packed
(MXFP4) against dequantised (bf16): the model is built on the meta device exactly as the loader
builds it (CausalLM(..., packed_experts=...)), so the figures are the shapes and dtypes of the
tensors a load creates, with nothing allocated.

    .venv/bin/python scripts/moe_memory.py [--json out.json]

gpt-oss-120b: the 20b config with 36 layers and 128 experts (its published config differs
from the 20b's in exactly these two keys).

Then the KV cache those weights leave on an H200 (141 GB at --gpu-memory-utilization 0.9,
less the weights and an assumed 2 GB for one step's activations and the reserve), in tokens:
a plain cache against the hybrid one (sliding layers in their own pool: gpu/layers/attention.py
hybrid_layout, with 256 sequences and 2048-token steps, the engine's defaults).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from gpu.models.registry import config_from_hf
from gpu.layers.attention import KVCache, hybrid_layout
from gpu.config.model import ModelConfig
from gpu.models.causal_lm import CausalLM

H200_BYTES, UTILIZATION, STEP_AND_RESERVE = 141e9, 0.9, 2e9

CONFIG_20B = Path(__file__).resolve().parent.parent / "gpu/configs/gpt-oss-20b/config.json"


def configs() -> dict[str, ModelConfig]:
    d = json.loads(CONFIG_20B.read_text())
    big = {**d, "num_hidden_layers": 36, "num_local_experts": 128}
    del big["layer_types"]  # alternating sliding/full by default, for 36 layers
    return {"gpt-oss-20b": config_from_hf(d), "gpt-oss-120b": config_from_hf(big)}


def weight_bytes(config: ModelConfig, packed: bool, dtype=torch.bfloat16) -> dict[str, int]:
    """{"experts": bytes of the expert matrices, "other": everything else} of a meta-device load."""
    lm = CausalLM(config, dtype, "meta", packed_experts=packed, max_positions=16)
    out = {"experts": 0, "other": 0}
    for name, p in lm.named_parameters():              # tied lm_head counted once
        matrix = ".experts." in name and not name.endswith("_bias")
        out["experts" if matrix else "other"] += p.numel() * p.element_size()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="also write the figures here")
    a = ap.parse_args()
    rows = {}
    print(f"{'model':14s} {'experts':>8s} {'expert GB':>10s} {'other GB':>9s} {'total GB':>9s}")
    for name, c in configs().items():
        for packed in (False, True):
            b = weight_bytes(c, packed)
            total = b["experts"] + b["other"]
            kind = "mxfp4" if packed else "bf16"
            rows[f"{name}/{kind}"] = {**b, "total": total}
            print(f"{name:14s} {kind:>8s} {b['experts'] / 1e9:10.2f} {b['other'] / 1e9:9.2f} {total / 1e9:9.2f}")
    print(f"\n{'model':14s} {'experts':>8s} {'KV GB':>6s} {'plain tokens':>13s} {'hybrid tokens':>14s} {'ratio':>6s}")
    for name, c in configs().items():
        per_block = KVCache.bytes_per_block(c.num_hidden_layers, 16, c.num_key_value_heads, c.head_dim,
                                            torch.bfloat16)
        for kind in ("bf16", "mxfp4"):
            budget = H200_BYTES * UTILIZATION - rows[f"{name}/{kind}"]["total"] - STEP_AND_RESERVE
            plain = max(0, int(budget // per_block))
            full, sliding, slots = hybrid_layout(c, plain, 16, 256, 2048)
            rows[f"{name}/{kind}"].update(kv_bytes=max(0, budget), plain_tokens=plain * 16, hybrid_tokens=full * 16,
                                          sliding_slots=slots)
            ratio = f"{full / plain:6.2f}" if plain else "     -"
            print(f"{name:14s} {kind:>8s} {max(0, budget) / 1e9:6.1f} {plain * 16:13,d} {full * 16:14,d} {ratio}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
