"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B): Qwen3's attention (a
per-head RMSNorm on q and k) with a mixture of experts in place of the MLP: softmax routing
over all experts, top-k, renormalised when norm_topk_prob; no shared expert; the layers in
mlp_only_layers (or off the decoder_sparse_step) keep a dense MLP of intermediate_size."""
from __future__ import annotations

from typing import Any

from gpu.config.model import ModelConfig, hf_fields
from gpu.config.moe import MoESpec, dense_layers_from_hf
from gpu.models.causal_lm import CausalLM

Model = CausalLM


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    return ModelConfig(**{**hf_fields(d, "qwen3_moe", max_positions=32768), **moe_fields(d), "qk_norm": True})


def moe_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Qwen-MoE's experts (Qwen2-MoE's and Qwen3-MoE's config keys; gguf.py's alike)."""
    layers = d["num_hidden_layers"]
    shared = int(d.get("shared_expert_intermediate_size") or 0)
    return {
        "intermediate_size": d.get("moe_intermediate_size") or d["intermediate_size"],
        "num_experts": d.get("num_experts") or d.get("num_local_experts"),
        "num_experts_per_tok": d.get("num_experts_per_tok") or 8,
        "moe": MoESpec(scoring="softmax", norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                       router_bias=False, activation="swiglu", expert_bias=False,
                       shared_intermediate_size=shared, shared_gate=bool(shared),
                       dense_layers=dense_layers_from_hf(d, layers),
                       dense_intermediate_size=d["intermediate_size"]),
    }
