"""Llama 4 text (Llama4ForCausalLM: Scout, Maverick's language model): Llama's attention with
RoPE on three layers in four and none on the fourth (whose queries get Llama 4's temperature
scaling by position), a weightless RMSNorm of q and k after RoPE on the RoPE layers, and a
mixture of experts on every interleave_moe_layer_step-th layer: top-1 by router logit, the
sigmoid of it scaling the expert's input, plus a shared expert (gpu/config/moe.py); the other
layers a dense MLP of intermediate_size_mlp.

Chunked local attention (the RoPE layers see only their attention_chunk_size chunk) is not in
the attention backends yet: within one chunk it is plain causal attention, so the context is
capped at attention_chunk_size (8,192 for the published models) and start-up says so.

Checkpoint layout undone at load: Meta's RoPE rotates interleaved pairs (complex
multiplication), reordered per head into the halves layout; the experts come stacked as
gate_up [E, D, 2I] (gate and up as halves) and down [E, I, D], made ours ([E, 2I, D]
interleaved, [E, D, I])."""
from __future__ import annotations

import logging
from typing import Any

import torch

from gpu.config.model import ModelConfig, hf_fields
from gpu.config.moe import MoESpec
from gpu.layers.ops import apply_rope
from gpu.models.causal_lm import Attention, CausalLM

log = logging.getLogger(__name__)


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    layers = d["num_hidden_layers"]
    step = int(d.get("interleave_moe_layer_step") or 1)
    moe_layers = d.get("moe_layers")
    if moe_layers is None:
        moe_layers = list(range(step - 1, layers, step))
    rope_flags = d.get("no_rope_layers") or [1] * layers      # transformers' name: 1 = this layer uses RoPE
    fields = hf_fields(d, "llama4", max_positions=131072, rope_theta=500000.0)
    chunk = d.get("attention_chunk_size")
    if chunk and fields["max_position_embeddings"] > chunk:
        log.warning("Llama 4: context capped at attention_chunk_size %d (chunked local attention is not "
                    "implemented)", chunk)
        fields["max_position_embeddings"] = chunk
    shared = d["intermediate_size"]
    return ModelConfig(**{
        **fields,
        "intermediate_size": d["intermediate_size"],
        "num_experts": d.get("num_local_experts") or 16,
        "num_experts_per_tok": d.get("num_experts_per_tok") or 1,
        "moe": MoESpec(scoring="sigmoid", norm_topk_prob=False, router_bias=False, weight_on_input=True,
                       activation="swiglu", expert_bias=False, shared_intermediate_size=shared,
                       dense_layers=tuple(i for i in range(layers) if i not in set(moe_layers)),
                       dense_intermediate_size=d.get("intermediate_size_mlp") or d["intermediate_size"]),
        "no_rope_layers": tuple(i for i, uses in enumerate(rope_flags) if not uses),
        "attn_temperature": ((float(d.get("floor_scale", 8192)), float(d.get("attn_scale", 0.1)))
                             if d.get("attn_temperature_tuning", True) else None),
        "qk_l2_norm": bool(d.get("use_qk_norm", True)),
    })


class Llama4Attention(Attention):
    """Attention with Llama 4's per-layer choices (no RoPE + temperature, or RoPE + q/k norm)."""

    def __init__(self, config: ModelConfig, layer_idx: int, dtype, device, tp):
        super().__init__(config, layer_idx, dtype, device, tp)
        self.use_rope = layer_idx not in config.no_rope_layers
        self.l2_eps = config.rms_norm_eps if config.qk_l2_norm and self.use_rope else None
        self.temperature = None if self.use_rope else config.attn_temperature

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, attn) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.reshape(T, self.num_heads, self.head_dim)
        k = k.reshape(T, self.num_kv_heads, self.head_dim)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        if self.use_rope:
            q, k = apply_rope(q, k, positions, cos_sin)
        if self.l2_eps is not None:
            q, k = _weightless_rms(q, self.l2_eps), _weightless_rms(k, self.l2_eps)
        if self.temperature is not None:
            floor_scale, scale = self.temperature
            t = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * scale + 1.0   # [T]
            q = (q * t[:, None, None]).to(q.dtype)
        o = attn.forward(self.layer_idx, q, k, v)
        return self.o_proj(o.reshape(T, -1))


def _weightless_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Model(CausalLM):
    def __init__(self, config: ModelConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        dtype = self.embed_tokens.weight.dtype
        device = self.embed_tokens.weight.device
        for i, layer in enumerate(self.layers):
            layer.self_attn = Llama4Attention(config, i, dtype, device, self.tp)

    def load_weights(self, named_tensors) -> None:
        super().load_weights(self._as_ours(named_tensors))

    def _as_ours(self, named_tensors):
        c = self.config
        d = c.head_dim
        pairs = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])   # interleaved pairs -> halves
        for name, t in named_tensors:
            if name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
                t = t.view(-1, d, t.shape[-1])[:, pairs].reshape(t.shape)
            elif name.endswith(("self_attn.q_proj.bias", "self_attn.k_proj.bias")):
                t = t.view(-1, d)[:, pairs].reshape(t.shape)
            elif name.endswith("feed_forward.experts.gate_up_proj"):         # [E, D, 2I], halves
                gate, up = t.transpose(1, 2).chunk(2, dim=1)                 # [E, I, D] each
                t = torch.stack([gate, up], dim=2).flatten(1, 2)             # [E, 2I, D], interleaved
            elif name.endswith("feed_forward.experts.down_proj"):            # [E, I, D]
                t = t.transpose(1, 2)
            yield name, t


