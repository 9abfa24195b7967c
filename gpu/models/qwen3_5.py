"""Qwen3.5 (dense) text model: the hybrid decoder (gpu/models/hybrid.py) with Gated
DeltaNet's projections apart (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a). A
Qwen3_5ForConditionalGeneration config.json is read for its text_config (the text path;
the loader skips the vision tower's weights only where it does not take pictures)."""
from __future__ import annotations

from typing import Any

from gpu.config.model import ModelConfig
from gpu.models.hybrid import HybridLM
from gpu.models.qwen3_next import hybrid_fields


class Model(HybridLM):
    linear_layout = "split"


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    if isinstance(d.get("text_config"), dict):
        d = {**d["text_config"], **{k: d[k] for k in ("eos_token_id", "bos_token_id", "tie_word_embeddings")
                                    if k in d and k not in d["text_config"]}}
    return ModelConfig(**hybrid_fields(d, "qwen3_5", max_positions=262144))
