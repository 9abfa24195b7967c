"""Llama 1-3.x, Mistral (v0.1's sliding window of 4096 too; v0.3 on, Nemo, Small have none),
SmolLM2: the reference decoder (gpu/models/causal_lm.py) as it is: RMSNorm, SwiGLU, RoPE
(default, linear, llama3 or YaRN scaling), grouped-query attention. Mistral's window makes
every layer a sliding one (a query sees the last sliding_window keys, its own included, as
transformers masks them); with no full layer beside them the KV cache stays one pool
(gpu/layers/attention.py hybrid_layout) and the window is a mask."""
from __future__ import annotations

from typing import Any

from gpu.config.model import ModelConfig, hf_fields
from gpu.models.causal_lm import CausalLM

Model = CausalLM


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    fields = hf_fields(d, "llama", max_positions=2048)
    if d.get("model_type") == "mistral" or "MistralForCausalLM" in (d.get("architectures") or ()):
        window = d.get("sliding_window")
        if window not in (None, 0) and window < fields["max_position_embeddings"]:
            fields.update(sliding_window=int(window),
                          layer_types=("sliding_attention",) * fields["num_hidden_layers"])
    return ModelConfig(**fields)
