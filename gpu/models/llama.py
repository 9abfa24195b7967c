"""Llama 1-3.x, and Mistral without a sliding window (v0.3 on, Nemo, Small), SmolLM2: the
reference decoder (gpu/models/causal_lm.py) as it is: RMSNorm, SwiGLU, RoPE (default,
linear, llama3 or YaRN scaling), grouped-query attention."""
from __future__ import annotations

from typing import Any

from gpu.config.model import ModelConfig, hf_fields
from gpu.models.causal_lm import CausalLM

Model = CausalLM


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    if d.get("model_type") == "mistral" or "MistralForCausalLM" in (d.get("architectures") or ()):
        window = d.get("sliding_window")
        if window not in (None, 0) and window < d.get("max_position_embeddings", 0):
            raise ValueError("Mistral with a sliding_window is not supported")
    return ModelConfig(**hf_fields(d, "llama", max_positions=2048))
