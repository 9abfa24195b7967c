"""Qwen3.5 (dense) text model: the hybrid decoder (gpu/models/hybrid.py) with Gated
DeltaNet's projections apart (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a). A
Qwen3_5ForConditionalGeneration folder (model_type qwen3_5, as the checkpoints are
released) is served as its text model: the vision tower is skipped, so a request with an
image is refused as for any text model."""
from __future__ import annotations

from typing import Any

from gpu.config.model import ModelConfig
from gpu.models.hybrid import HybridLM
from gpu.models.qwen3_next import hybrid_fields, text_part


class Model(HybridLM):
    linear_layout = "split"


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    return ModelConfig(**hybrid_fields(text_part(d), "qwen3_5", max_positions=262144))
