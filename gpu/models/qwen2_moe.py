"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases) and
Qwen-MoE's experts, plus a shared expert every token runs, times a sigmoid gate."""
from __future__ import annotations

from typing import Any

from gpu.config.model import ModelConfig, hf_fields
from gpu.models.causal_lm import CausalLM
from gpu.models.qwen3_moe import moe_fields

Model = CausalLM


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    fields = hf_fields(d, "qwen2_moe", max_positions=32768)
    return ModelConfig(**{**fields, **moe_fields(d), "attention_bias": True, "o_proj_bias": False})
