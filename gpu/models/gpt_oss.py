"""gpt-oss: a mixture of experts (softmax over the top-k router logits, a router bias, the
experts' clamped SwiGLU: gpu/layers/moe.py), attention sinks, sliding-window attention on
alternate layers, YaRN RoPE, biases on every attention projection."""
from __future__ import annotations

from typing import Any

from gpu.config.model import ModelConfig, hf_fields
from gpu.models.causal_lm import CausalLM

Model = CausalLM

# transformers' GptOssConfig default when config.json has no rope parameters.
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "truncate": False, "original_max_position_embeddings": 4096}


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    if not (d.get("rope_parameters") or d.get("rope_scaling")):
        d = {"rope_parameters": _DEFAULT_ROPE, **d}
    layers = d["num_hidden_layers"]
    layer_types = d.get("layer_types") or [  # transformers' default: sliding on even layers
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    bias = bool(d.get("attention_bias", True))
    return ModelConfig(**{
        **hf_fields(d, "gpt_oss", max_positions=131072, rope_theta=150000.0),
        "attention_bias": bias, "o_proj_bias": bias,
        "num_experts": d.get("num_local_experts") or d.get("num_experts") or 128,
        "num_experts_per_tok": d.get("num_experts_per_tok") or d.get("experts_per_token") or 4,
        "swiglu_alpha": float(d.get("swiglu_alpha", 1.702)),
        "swiglu_limit": float(d.get("swiglu_limit", 7.0)),
        "attention_sinks": True,
        "sliding_window": d.get("sliding_window", 128),
        "layer_types": tuple(layer_types),
    })
