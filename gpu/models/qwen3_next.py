"""Qwen3-Next: the hybrid decoder (gpu/models/hybrid.py) with Gated DeltaNet's projections
grouped by key head (in_proj_qkvz, in_proj_ba), three linear layers to each gated
full-attention one, partial RoPE (a quarter of each head). As released (Qwen3-Next-80B-A3B)
its MLPs are a mixture of experts on the shared MoE layer (gpu/layers/moe.py, moe_fields);
a config with num_experts 0 has dense MLPs."""
from __future__ import annotations

from typing import Any

from gpu.config.model import ModelConfig, hf_fields
from gpu.config.moe import MoESpec, dense_layers_from_hf
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


def text_part(d: dict[str, Any]) -> dict[str, Any]:
    """A Qwen3.5 (or Qwen3.5-MoE) ForConditionalGeneration config.json keeps the decoder's
    fields under text_config: served as its text model (the vision tower's weights are
    skipped at load: HybridLM._destination), as Gemma 3's is; a text model's dict as it is."""
    text = d.get("text_config")
    if not text:
        return d
    return {**text, "architectures": d.get("architectures"),
            "model_type": text.get("model_type") or f"{d.get('model_type')}_text",
            **{k: d[k] for k in ("tie_word_embeddings", "eos_token_id", "bos_token_id")
               if k in d and k not in text}}


def moe_fields(d: dict[str, Any], *, every_layer: bool = False) -> dict[str, Any]:
    """The mixture's fields (none when num_experts is 0 or absent): softmax routing over all
    experts, top-k, renormalised (norm_topk_prob, always for Qwen3.5-MoE); experts apart in the
    checkpoint (stacked while loading, gpu/loader/experts.py); a shared expert of
    shared_expert_intermediate_size times sigmoid(x w_g). Qwen3-Next's dense layers
    (mlp_only_layers, decoder_sparse_step) keep an MLP of intermediate_size; every_layer:
    Qwen3.5-MoE's config has neither key, nor a dense intermediate_size."""
    experts = int(d.get("num_experts") or 0)
    if not experts:
        return {}
    layers = d["num_hidden_layers"]
    shared = int(d.get("shared_expert_intermediate_size") or 0)
    dense = () if every_layer else dense_layers_from_hf(d, layers)
    norm = True if every_layer else bool(d.get("norm_topk_prob", True))
    return {
        "intermediate_size": d["moe_intermediate_size"],
        "num_experts": experts,
        "num_experts_per_tok": d.get("num_experts_per_tok") or 10,
        "moe": MoESpec(scoring="softmax", norm_topk_prob=norm, router_bias=False, activation="swiglu",
                       expert_bias=False, shared_intermediate_size=shared, shared_gate=bool(shared),
                       dense_layers=dense,
                       dense_intermediate_size=d.get("intermediate_size") or 0 if dense else 0),
    }


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    d = {"intermediate_size": d.get("moe_intermediate_size"), **d}
    return ModelConfig(**{**hybrid_fields(d, "qwen3_next", max_positions=262144), **moe_fields(d)})
