"""Qwen2 / Qwen2.5 (and Qwen2.5-VL's decoder): Llama's decoder with a bias on the q/k/v
projections (never on o_proj), whatever config.json's attention_bias says."""
from __future__ import annotations

from typing import Any

from gpu.config.model import ModelConfig, hf_fields
from gpu.models.causal_lm import CausalLM

Model = CausalLM


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    fields = hf_fields(d, "qwen2", max_positions=32768)
    return ModelConfig(**{**fields, "attention_bias": True, "o_proj_bias": False})
