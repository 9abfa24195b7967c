"""Qwen3.5-MoE text model (Qwen3.5-35B-A3B, 122B-A10B, 397B-A17B): Qwen3.5's hybrid decoder
(gpu/models/qwen3_5.py, Gated DeltaNet's projections apart) with a mixture of experts in
every layer: softmax routing renormalised over the top k, and a shared expert times a
sigmoid gate (gpu/models/qwen3_next.py moe_fields, gpu/layers/moe.py). A
Qwen3_5MoeForConditionalGeneration folder is served as its text model (qwen3_5.py)."""
from __future__ import annotations

from typing import Any

from gpu.config.model import ModelConfig
from gpu.models.qwen3_5 import Model
from gpu.models.qwen3_next import hybrid_fields, moe_fields, text_part

__all__ = ["Model", "config_from_hf"]


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    d = text_part(d)
    if not d.get("num_experts"):
        raise ValueError("a qwen3_5_moe_text config needs num_experts > 0")
    d = {"intermediate_size": d.get("moe_intermediate_size"), **d}
    return ModelConfig(**{**hybrid_fields(d, "qwen3_5_moe", max_positions=262144),
                          **moe_fields(d, every_layer=True)})
