"""Gemma 2 (`Gemma2ForCausalLM`): Gemma 3's decoder (gpu/models/gemma3.py gemma_fields) without
QK-norm or a second RoPE base, with sliding-window attention on every other layer and
soft-capping: cap * tanh(x / cap) on the attention scores (attn_logit_softcapping, 50: the
CPU attention and the Triton paged attention both apply it) and on the final logits
(final_logit_softcapping, 30)."""
from __future__ import annotations

from typing import Any

from gpu.config.model import ModelConfig
from gpu.models.causal_lm import CausalLM
from gpu.models.gemma3 import gemma_fields

Model = CausalLM


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    fields = gemma_fields(d, "gemma2", sliding_every=2, full_theta=10_000.0, window=4096)
    # Gemma2Config's defaults where config.json leaves the keys out (an explicit null turns a cap off)
    for key, default in (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0)):
        if key not in d:
            fields[key] = default
    return ModelConfig(**{**fields, "sliding_rope_theta": None})
