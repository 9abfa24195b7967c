"""Qwen3-Next: the hybrid decoder (gpu/models/hybrid.py) with Gated DeltaNet's projections
grouped by key head (in_proj_qkvz, in_proj_ba), three linear layers to each gated
full-attention one, partial RoPE (a quarter of each head)."""
from __future__ import annotations

from typing import Any

from gpu.config.model import ModelConfig, hf_fields
from gpu.models.hybrid import HybridLM


class Model(HybridLM):
    linear_layout = "qkvz"


def hybrid_fields(d: dict[str, Any], architecture: str, *, max_positions: int) -> dict[str, Any]:
    """ModelConfig's fields of a Qwen3-Next / Qwen3.5 text config.json: the shared ones, the
    layer pattern (layer_types, else every full_attention_interval-th layer full), the
    Gated DeltaNet sizes, partial RoPE (rope_parameters' or the top level's
    partial_rotary_factor, 0.25 by default) and the attention output gate."""
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    partial = float(rope.pop("partial_rotary_factor", None) or d.get("partial_rotary_factor") or 0.25)
    # text-only: Qwen3.5's interleaved M-RoPE gives every token equal t, h, w positions,
    # which is plain RoPE (its sections only choose which of the three each frequency reads)
    for key in ("mrope_section", "mrope_interleaved"):
        rope.pop(key, None)
    if rope.get("rope_type", rope.get("type")) == "mrope":
        rope["rope_type"] = "default"
    d = {**d, "rope_parameters": rope or None, "rope_scaling": None}
    layers = d["num_hidden_layers"]
    interval = d.get("full_attention_interval", 4)
    layer_types = d.get("layer_types") or [
        "linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    return {
        **hf_fields(d, architecture, max_positions=max_positions),
        "layer_types": tuple(layer_types),
        "partial_rotary_factor": partial,
        "attn_output_gate": True,
        "linear_num_key_heads": d.get("linear_num_key_heads", 16),
        "linear_num_value_heads": d.get("linear_num_value_heads", 32),
        "linear_key_head_dim": d.get("linear_key_head_dim", 128),
        "linear_value_head_dim": d.get("linear_value_head_dim", 128),
        "linear_conv_kernel_dim": d.get("linear_conv_kernel_dim", 4),
        "mrope_section": None,
    }


def moe_layers(d: dict[str, Any]) -> list[int]:
    """The layers whose MLP is a mixture of experts (transformers' rule)."""
    if not d.get("num_experts"):
        return []
    step, dense = d.get("decoder_sparse_step", 1), set(d.get("mlp_only_layers") or ())
    return [i for i in range(d["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0]


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    if moe_layers(d):
        raise ValueError("Qwen3-Next's mixture-of-experts layers are not served yet (a checkpoint "
                         "with num_experts > 0); its dense layers and attention are")
    return ModelConfig(**hybrid_fields(d, "qwen3_next", max_positions=262144))
