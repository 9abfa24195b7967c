"""Gemma 3 (`Gemma3ForCausalLM`, and the text model of `Gemma3ForConditionalGeneration`):
the reference decoder (gpu/models/causal_lm.py) with Gemma's parts, all config-driven:
- GeGLU with GELU's tanh approximation (hidden_activation gelu_pytorch_tanh);
- RMSNorm scaling by (1 + w) (norm_unit_offset), with norms on the attention's and the MLP's
  outputs as well as their inputs (sandwich_norms);
- token embeddings times sqrt(hidden_size); attention scores scaled by
  query_pre_attn_scalar ** -0.5; a per-head RMSNorm on q and k (QK-norm);
- five sliding-window layers to one global (layer_types, on the sliding KV pool gpt-oss
  uses), the sliding layers with their own RoPE base (rope_local_base_freq, 10k), the
  global ones with rope_theta (1M) and its scaling (linear x8 on the 4B and larger).
Gemma 2 (gpu/models/gemma2.py) shares gemma_fields."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from gpu.config.model import ModelConfig, hf_fields
from gpu.models.causal_lm import CausalLM

# Gemma3ForConditionalGeneration's checkpoints name the text model's tensors under a prefix
# (transformers 4.5x's hub layout, and 5.x's); the vision tower and projector are skipped
_TEXT_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                  "language_model.lm_head.": "lm_head."}
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")


class Gemma3(CausalLM):
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(text_weights(named_tensors))


def text_weights(named_tensors: Iterable[tuple[str, torch.Tensor]]):
    """A checkpoint's text-model tensors under the names of Gemma3ForCausalLM's."""
    for name, tensor in named_tensors:
        if name.startswith(_VISION_PREFIXES):
            continue
        for prefix, ours in _TEXT_PREFIXES.items():
            if name.startswith(prefix):
                name = ours + name[len(prefix):]
                break
        yield name, tensor


Model = Gemma3


def text_config(d: dict[str, Any]) -> dict[str, Any]:
    """Gemma3ForConditionalGeneration's config.json keeps the decoder's under text_config."""
    text = d.get("text_config")
    if not text:
        return d
    return {**text, "architectures": d.get("architectures"),
            "model_type": text.get("model_type", "gemma3_text"),
            "tie_word_embeddings": text.get("tie_word_embeddings", d.get("tie_word_embeddings", True))}


def gemma_fields(d: dict[str, Any], architecture: str, *, sliding_every: int, full_theta: float,
                 window: int) -> dict[str, Any]:
    """The fields Gemma 2 and 3 read alike. sliding_every: transformers' default pattern (a
    global layer every that many); full_theta, window: its defaults for rope_theta and
    sliding_window."""
    if d.get("use_bidirectional_attention"):
        raise ValueError("Gemma with use_bidirectional_attention=true (an encoder) is not supported")
    rope = dict(d.get("rope_parameters") or {})
    if "full_attention" in rope or "sliding_attention" in rope:    # transformers 5: per layer type
        full, local = dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
    else:
        full = rope or {**(d.get("rope_scaling") or {}), "rope_theta": d.get("rope_theta", full_theta)}
        local = {"rope_theta": d.get("rope_local_base_freq")} if d.get("rope_local_base_freq") else {}
    full.setdefault("rope_theta", d.get("rope_theta", full_theta))
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ValueError(f"sliding layers' rope_type {local.get('rope_type')!r} is not supported (default only)")
    d = {"tie_word_embeddings": True, **d, "rope_parameters": full, "rope_scaling": None,
         "hidden_act": d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"}
    fields = hf_fields(d, architecture, max_positions=8192, rope_theta=full_theta)
    layers = fields["num_hidden_layers"]
    pattern = d.get("sliding_window_pattern") or sliding_every
    layer_types = d.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    hidden = fields["hidden_size"]
    return {
        **fields,
        "head_dim": d.get("head_dim") or 256,
        "norm_unit_offset": True,
        "sandwich_norms": True,
        "embed_scale": float(hidden) ** 0.5,
        "query_pre_attn_scalar": float(d.get("query_pre_attn_scalar") or 256),
        "sliding_window": d.get("sliding_window") or window,
        "layer_types": tuple(layer_types),
        "attn_logit_softcapping": d.get("attn_logit_softcapping"),
        "final_logit_softcapping": d.get("final_logit_softcapping"),
        "sliding_rope_theta": float(local["rope_theta"]) if local.get("rope_theta") else None,
    }


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    d = text_config(d)
    fields = gemma_fields(d, "gemma3", sliding_every=6, full_theta=1_000_000.0, window=4096)
    if fields["sliding_rope_theta"] is None:
        fields["sliding_rope_theta"] = 10_000.0    # Gemma3TextConfig's local base
    return ModelConfig(**{**fields, "qk_norm": True})
