"""Qwen3 (dense): Llama's decoder with a per-head RMSNorm on q and k before RoPE."""
from __future__ import annotations

from typing import Any

from gpu.config.model import ModelConfig, hf_fields
from gpu.models.causal_lm import CausalLM

Model = CausalLM


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    return ModelConfig(**{**hf_fields(d, "qwen3", max_positions=32768), "qk_norm": True})
