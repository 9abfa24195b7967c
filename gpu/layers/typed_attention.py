"""Attention whose shape and K/V come from its layer's type and place (Gemma 4), config-driven
(gpu/config/model.py), beside causal_lm.Attention's uniform one:
- the layer's head_dim and KV heads (ModelConfig.layer_head_dim / layer_kv_heads: the full
  layers' may differ from the sliding ones'); the KV cache holds each layer in its own shape
  (gpu/layers/attention.py KVCache layer_shapes);
- attention_k_eq_v: a full layer's k projection is its v as well (no v_proj): v is k's
  projection before k_norm and RoPE;
- v_norm: a weightless RMSNorm over each head of v;
- shared KV (ModelConfig.kv_source(i) != i, the last kv_shared_layers layers): a q
  projection only. The layer attends under its source layer's index, to the k/v its source
  computed this step (handed over in `shared`): the backend writes them to the same slots
  again (the same values) and reads the source's cache for the context, so a shared layer
  needs no KV memory and no backend of its own.
A paged backend scales every layer's scores by its one `scale` (config.head_dim ** -0.5), a
dense one by q's head_dim's; q times the ratio makes it the layer's (Gemma 4: 1.0).
"""
from __future__ import annotations

import torch
from torch import nn

from gpu.config.model import ModelConfig
from gpu.layers.ops import apply_rope, rms_norm, skip_init
from gpu.parallel import SINGLE, TP


class TypedAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype, device, tp: TP = SINGLE):
        super().__init__()
        from gpu.models.causal_lm import Linear, RMSNorm    # causal_lm imports the layers; its parts lazily

        c = config
        if tp.size != 1:
            raise ValueError(f"{c.architecture}: per-layer attention shapes are not split over "
                             "tensor-parallel ranks yet")
        self.layer_idx = layer_idx
        self.source = c.kv_source(layer_idx)
        self.shared = self.source != layer_idx
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = c.layer_kv_heads(layer_idx)
        self.head_dim = d = c.layer_head_dim(layer_idx)
        self.window = c.layer_window(layer_idx)
        self.k_eq_v = c.attention_k_eq_v and self.window is None
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        self.split = (q_size,) if self.shared else (q_size, kv_size) if self.k_eq_v else (q_size, kv_size, kv_size)
        kw = dict(dtype=dtype, device=device)
        self.qkv_proj = skip_init(Linear, c.hidden_size, sum(self.split), bias=c.attention_bias, **kw)
        self.o_proj = skip_init(Linear, q_size, c.hidden_size, bias=c.o_proj_bias, **kw)
        self.q_norm = RMSNorm(d, c.rms_norm_eps, **kw) if c.qk_norm else None
        self.k_norm = RMSNorm(d, c.rms_norm_eps, **kw) if c.qk_norm and not self.shared else None
        self.v_norm_eps = c.rms_norm_eps if c.v_norm and not self.shared else None
        self.register_buffer("v_norm_weight", torch.ones(d, **kw) if self.v_norm_eps else None, persistent=False)
        # the scores' scale: attention_scale (Gemma 4: 1.0), query_pre_attn_scalar ** -0.5, else d ** -0.5
        self.scale = (c.attention_scale if c.attention_scale is not None else
                      c.query_pre_attn_scalar ** -0.5 if c.query_pre_attn_scalar else d ** -0.5)
        self.softcap = c.attn_logit_softcapping
        self.local_rope = c.sliding_rope_theta is not None and self.window is not None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, attn,
                shared: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """x [T, D] -> [T, D]. shared: layer -> its (k, v) this step, normed and roped; a
        source layer puts its own there, a shared layer reads its source's."""
        T, d = x.shape[0], self.head_dim
        parts = self.qkv_proj(x).split(self.split, dim=-1)
        q = parts[0].reshape(T, self.num_heads, d)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, d)).view_as(q)
        if self.shared:
            k, v = shared[self.source]
            q, _ = apply_rope(q, q.new_zeros(T, 1, d), positions, cos_sin)
        else:
            k = parts[1].reshape(T, self.num_kv_heads, d)
            v = k if self.k_eq_v else parts[2].reshape(T, self.num_kv_heads, d)
            if self.k_norm is not None:
                k = self.k_norm(k.reshape(-1, d)).view_as(k)
            if self.v_norm_eps is not None:
                v = rms_norm(v.reshape(-1, d), self.v_norm_weight, self.v_norm_eps).view_as(v)
            q, k = apply_rope(q, k, positions, cos_sin)
            shared[self.layer_idx] = (k, v)
        # a paged backend scales by its one `scale` (config.head_dim's), a dense one by q's head_dim's
        q_scale = self.scale / (getattr(attn, "scale", None) or d ** -0.5)
        if q_scale != 1.0:
            q = q * q_scale
        kw = {"softcap": self.softcap} if self.softcap else {}
        o = attn.forward(self.source, q, k, v, window=self.window, **kw)   # [T, Hq, Dh]
        return self.o_proj(o.reshape(T, -1))
