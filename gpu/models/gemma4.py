"""Gemma 4's text models (`Gemma4ForCausalLM`, `gemma4_text`, and the text model of
`Gemma4ForConditionalGeneration`: E2B, E4B, 31B, 26B-A4B). Gemma 3's parts (gpu/models/gemma3.py: GeGLU,
sandwich norms, sqrt(hidden) embedding scale, QK-norm, sliding/full interleave with a RoPE
base each, final-logit soft-capping) and what Gemma 4 adds, all config-driven:
- per layer type attention shapes: the full layers' head_dim (global_head_dim, 512) and KV
  heads (num_global_key_value_heads, where attention_k_eq_v), in config.json as those keys or
  as transformers 5's `per_layer_config`; attention_k_eq_v (the full layers' v is k's
  projection), a weightless v-norm, attention scale 1.0 (gpu/layers/typed_attention.py);
- the full layers' "proportional" RoPE: head_dim's frequencies, the first
  partial_rotary_factor of them turning (gpu/layers/ops.py rope_inv_freq);
- shared KV: the last num_kv_shared_layers layers read the cache of the last earlier layer of
  their type, and own none (ModelConfig.kv_source, KVCache layer_shapes); with
  use_double_wide_mlp their MLPs are twice as wide;
- per-layer inputs and a loaded scalar on each layer's output (gpu/layers/per_layer_inputs.py);
- norms scale by w itself (not Gemma 3's 1 + w).
- the MoE variant (26B-A4B, enable_moe_block): a routed GeGLU experts branch beside each
  layer's dense MLP (gpu/layers/parallel_experts.py).
Refused at start-up: bidirectional attention over all tokens. The vision and audio towers of a Gemma4ForConditionalGeneration checkpoint are
skipped: its text model is served, on text.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs
import torch
from torch import nn

from gpu.config.model import ModelConfig
from gpu.layers.ops import build_rope_cache, rms_norm, skip_init
from gpu.layers.per_layer_inputs import PerLayerInputDecoderLayer, per_layer_inputs
from gpu.models.causal_lm import CausalLM, Linear, RMSNorm
from gpu.models.gemma3 import gemma_fields, text_config
from gpu.parallel import SINGLE, TP

_TEXT_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                  "language_model.lm_head.": "lm_head."}
_TOWER_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.",
                   "vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.")
_SHARED_SKIPPED = ("k_proj", "v_proj", "k_norm", "v_norm")   # a shared-KV layer's, if a checkpoint has them


class Gemma4(CausalLM):
    layer_cls = PerLayerInputDecoderLayer

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device="cpu",
                 max_positions: int | None = None, packed_experts: bool = False,
                 residual_dtype: torch.dtype | None = None, tp: TP = SINGLE, lm_head: bool = True):
        super().__init__(config, dtype, device, max_positions, packed_experts, residual_dtype, tp, lm_head)
        c = config
        positions = max_positions or c.max_position_embeddings
        # the full layers' table at their own head_dim (the sliding ones': cos_sin_local)
        self.register_buffer("cos_sin", build_rope_cache(attrs.evolve(c, head_dim=c.full_head_dim or c.head_dim),
                                                         positions, device), persistent=False)
        if c.per_layer_input_size:
            L, P, V = c.num_hidden_layers, c.per_layer_input_size, c.per_layer_vocab_size or c.vocab_size
            self.embed_tokens_per_layer = nn.Embedding(V, L * P, _weight=torch.empty(V, L * P, dtype=dtype, device=device))
            self.per_layer_model_projection = skip_init(Linear, c.hidden_size, L * P, bias=False,
                                                        dtype=dtype, device=device)
            self.per_layer_projection_norm = RMSNorm(P, c.rms_norm_eps, dtype, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
                aux_layers: tuple[int, ...] = ()) -> torch.Tensor:
        """CausalLM.forward's, without embeds (pictures) or aux_layers (EAGLE3)."""
        if embeds is not None or aux_layers:
            raise ValueError("gemma4: picture embeddings and EAGLE3's captured layers are not supported")
        x = self.embed(input_ids)
        x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        ple = per_layer_inputs(self, input_ids, x) if self.config.per_layer_input_size else None
        h = x.to(self.residual_dtype)
        shared: dict = {}    # layer -> its (k, v) this step, for the shared-KV layers
        for i, layer in enumerate(self.layers):
            table = self.cos_sin_local if layer.self_attn.local_rope else self.cos_sin
            h = layer(h, None if ple is None else ple[:, i], positions, table, attn, shared)
        return rms_norm(h, self.norm.weight, self.norm.eps)

    @property
    def local_kv_heads(self) -> int:
        return self.config.num_key_value_heads

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._text_weights(named_tensors))

    def _text_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]):
        """The text model's tensors under Gemma4ForCausalLM's names; the towers' and a shared
        layer's k/v projections and norms (which it never reads) skipped."""
        for name, tensor in named_tensors:
            if name.startswith(_TOWER_PREFIXES):
                continue
            for prefix, ours in _TEXT_PREFIXES.items():
                if name.startswith(prefix):
                    name = ours + name[len(prefix):]
                    break
            parts = name.split(".")
            if (len(parts) > 4 and parts[1] == "layers" and parts[3] == "self_attn" and parts[4] in _SHARED_SKIPPED
                    and self.layers[int(parts[2])].self_attn.shared):
                continue
            yield name, tensor


Model = Gemma4


def _per_layer_type(d: dict[str, Any], layer_types: list[str]) -> tuple[int, int]:
    """(full layers' head_dim, their KV heads), 0 where they keep the sliding layers': from
    global_head_dim / num_global_key_value_heads, or transformers 5's per_layer_config."""
    per_layer = d.get("per_layer_config")
    if per_layer:
        seen = set()
        for key, over in per_layer.items():
            i = int(key)
            unknown = set(over) - {"head_dim", "num_key_value_heads"}
            if unknown:
                raise ValueError(f"gemma4: per_layer_config sets {sorted(unknown)} for layer {i}; only "
                                 "head_dim and num_key_value_heads per layer type are supported")
            if layer_types[i] != "full_attention":
                raise ValueError(f"gemma4: per_layer_config overrides layer {i}, a {layer_types[i]} layer; "
                                 "only the full-attention layers' shape may differ")
            seen.add((over.get("head_dim", 0), over.get("num_key_value_heads", 0)))
        fulls = sum(t == "full_attention" for t in layer_types)
        if len(seen) > 1 or len(per_layer) != fulls:
            raise ValueError("gemma4: per_layer_config gives the full-attention layers different shapes; "
                             "one shape per layer type is supported")
        return seen.pop() if seen else (0, 0)
    heads = d.get("num_global_key_value_heads") if d.get("attention_k_eq_v", False) else None
    return d.get("global_head_dim") or 512, heads or 0


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    d = {**text_config(d)}
    d["model_type"] = d.get("model_type") or "gemma4_text"
    moe = bool(d.get("enable_moe_block"))
    if moe and not (d.get("num_experts") and d.get("top_k_experts") and d.get("moe_intermediate_size")):
        raise ValueError("gemma4: enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size")
    if d.get("use_bidirectional_attention") == "all":
        raise ValueError("gemma4 with use_bidirectional_attention='all' (an encoder) is not supported")
    layers = d["num_hidden_layers"]
    layer_types = list(d.get("layer_types") or [
        "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)])
    layer_types[-1] = "full_attention"     # transformers forces the last layer full
    rope = dict(d.get("rope_parameters") or {})
    full = dict(rope.get("full_attention") or {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                               "rope_theta": 1_000_000.0})
    local = dict(rope.get("sliding_attention") or {"rope_type": "default", "rope_theta": 10_000.0})
    full_head_dim, full_kv_heads = _per_layer_type(d, layer_types)
    # gemma_fields reads Gemma 2/3's keys; use_bidirectional_attention 'vision' acts on pictures only
    fields = gemma_fields({**d, "layer_types": layer_types, "use_bidirectional_attention": None,
                           "query_pre_attn_scalar": None,
                           "rope_parameters": {"full_attention": full, "sliding_attention": local}},
                          "gemma4", sliding_every=6, full_theta=1_000_000.0, window=512)
    shared = int(d.get("num_kv_shared_layers") or 0)
    return ModelConfig(**{
        **fields,
        "norm_unit_offset": False,
        "query_pre_attn_scalar": None,
        "attention_scale": 1.0,
        "qk_norm": True,
        "v_norm": True,
        "attn_logit_softcapping": None,
        "sliding_rope_theta": float(local.get("rope_theta", 10_000.0)),
        "full_head_dim": 0 if full_head_dim == fields["head_dim"] else full_head_dim,
        "full_kv_heads": 0 if full_kv_heads == fields["num_key_value_heads"] else full_kv_heads,
        "attention_k_eq_v": bool(d.get("attention_k_eq_v", False)),
        "kv_shared_layers": shared,
        "per_layer_input_size": int(d.get("hidden_size_per_layer_input") or 0),
        "per_layer_vocab_size": int(d.get("vocab_size_per_layer_input") or d["vocab_size"]),
        "layer_scalars": True,
        "double_wide_shared_mlp": bool(d.get("use_double_wide_mlp", False)) and shared > 0,
        "parallel_experts": int(d["num_experts"]) if moe else 0,
        "parallel_experts_top_k": int(d["top_k_experts"]) if moe else 0,
        "parallel_expert_intermediate_size": int(d["moe_intermediate_size"]) if moe else 0,
    })
