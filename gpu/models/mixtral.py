"""Mixtral (8x7B, 8x22B): Mistral's decoder with a mixture of experts in every layer: softmax
over the top-k router logits (top-2 of 8), the experts a plain SwiGLU, stored per expert as
block_sparse_moe.experts.{e}.w1 (gate), w3 (up), w2 (down) (gpu/loader/experts.py)."""
from __future__ import annotations

from typing import Any

from gpu.config.model import ModelConfig, hf_fields
from gpu.config.moe import MoESpec
from gpu.models.causal_lm import CausalLM

Model = CausalLM


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    window = d.get("sliding_window")
    if window not in (None, 0) and window < d.get("max_position_embeddings", 0):
        raise ValueError("Mixtral with a sliding_window is not supported")
    return ModelConfig(**{
        **hf_fields(d, "mixtral", max_positions=32768, rope_theta=1e6),
        "num_experts": d.get("num_local_experts") or 8,
        "num_experts_per_tok": d.get("num_experts_per_tok") or 2,
        "moe": MoESpec(scoring="softmax", norm_topk_prob=True, router_bias=False, activation="swiglu",
                       expert_bias=False),
    })
