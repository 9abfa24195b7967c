"""Per-layer inputs (PLE, Gemma 4's E2B/E4B) and the decoder layer that takes them, config-driven
(ModelConfig.per_layer_input_size, layer_scalars, double_wide_shared_mlp):

- each token gets, besides its embedding x (already times embed_scale), a vector of
  per_layer_input_size (P) for every layer: a second table's row (embed_tokens_per_layer
  [V, L x P], times sqrt(P) in the table's dtype) plus a projection of x
  (per_layer_model_projection, times hidden ** -0.5, RMS-normed over each layer's P), the sum
  times 2 ** -0.5 (`per_layer_inputs`);
- the layer is Gemma's sandwich (norms before and after attention and MLP,
  gpu/layers/typed_attention.py's attention); after the MLP's residual add it adds
  post_per_layer_input_norm(per_layer_projection(gelu_tanh(per_layer_input_gate(h)) * p_i))
  (the GeGLU op of gpu/layers/ops.py on [gate | p_i], so CUDA runs its Triton kernel), and
  multiplies its output by a loaded layer_scalar.
The residual stream is carried whole (no deferred add): the scalar multiplies it.
"""
from __future__ import annotations

import torch
from torch import nn

from gpu.config.model import ModelConfig
from gpu.layers.ops import fused_add_rms_norm, gelu_tanh_and_mul, skip_init
from gpu.layers.parallel_experts import add_parallel_experts, parallel_experts
from gpu.layers.typed_attention import TypedAttention
from gpu.parallel import SINGLE, TP


def per_layer_inputs(model, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """input_ids [T], x [T, D] (the scaled embeddings) -> [T, L, P]. model holds
    embed_tokens_per_layer, per_layer_model_projection and per_layer_projection_norm."""
    c: ModelConfig = model.config
    T, L, P = x.shape[0], c.num_hidden_layers, c.per_layer_input_size
    table = model.embed_tokens_per_layer
    tokens = table(input_ids) * torch.tensor(P ** 0.5, dtype=table.weight.dtype)     # [T, L * P]
    proj = model.per_layer_model_projection(x) * c.hidden_size ** -0.5
    norm = model.per_layer_projection_norm
    proj = norm(proj.reshape(T * L, P).to(norm.weight.dtype)).view(T, L, P)
    return (proj.float() + tokens.view(T, L, P).float()) * 2.0 ** -0.5


class PerLayerInputDecoderLayer(nn.Module):
    """causal_lm.DecoderLayer's signature; forward takes the whole residual stream h."""

    def __init__(self, config: ModelConfig, layer_idx: int, dtype, device, packed_experts: bool = False,
                 tp: TP = SINGLE):
        super().__init__()
        from gpu.models.causal_lm import MLP, Linear, RMSNorm   # causal_lm imports the layers

        c, kw = config, dict(dtype=dtype, device=device)
        if c.num_experts:
            raise ValueError(f"{c.architecture}: a mixture of experts in place of this layer's MLP is not supported")
        self.self_attn = TypedAttention(c, layer_idx, dtype, device, tp)
        wide = 2 if c.double_wide_shared_mlp and self.self_attn.shared else 1
        self.mlp = MLP(c, dtype, device, tp, c.intermediate_size * wide)
        D, eps = c.hidden_size, c.rms_norm_eps
        self.input_layernorm = RMSNorm(D, eps, **kw)
        self.post_attention_layernorm = RMSNorm(D, eps, **kw)
        self.pre_feedforward_layernorm = RMSNorm(D, eps, **kw)
        self.post_feedforward_layernorm = RMSNorm(D, eps, **kw)
        self.moe = bool(c.parallel_experts)   # a routed experts branch beside the MLP (parallel_experts.py)
        if self.moe:
            add_parallel_experts(self, c, dtype, device)
        self.layer_scalar = nn.Parameter(torch.ones(1, **kw)) if c.layer_scalars else None
        P = c.per_layer_input_size
        self.per_layer_input_gate = self.per_layer_projection = self.post_per_layer_input_norm = None
        if P:
            self.per_layer_input_gate = skip_init(Linear, D, P, bias=False, **kw)
            self.per_layer_projection = skip_init(Linear, P, D, bias=False, **kw)
            self.post_per_layer_input_norm = RMSNorm(D, eps, **kw)

    def forward(self, h: torch.Tensor, per_layer: torch.Tensor | None, positions: torch.Tensor,
                cos_sin: torch.Tensor, attn, shared: dict) -> torch.Tensor:
        """h [T, D] the residual stream, per_layer [T, P] this layer's input (or None) -> [T, D]."""
        a = self.self_attn(self.input_layernorm(h), positions, cos_sin, attn, shared)
        a = self.post_attention_layernorm(a)
        m, h = fused_add_rms_norm(a.to(h.dtype), h, self.pre_feedforward_layernorm.weight,
                                  self.pre_feedforward_layernorm.eps)
        m = self.mlp(m)
        if self.moe:
            m = parallel_experts(self, h, m)
        m = self.post_feedforward_layernorm(m)
        h = h + m.to(h.dtype)
        if per_layer is not None:
            g = self.per_layer_input_gate(h)
            g = gelu_tanh_and_mul(torch.cat([g, per_layer.to(g.dtype)], dim=-1))
            g = self.post_per_layer_input_norm(self.per_layer_projection(g))
            h = h + g.to(h.dtype)
        if self.layer_scalar is not None:
            h = h * self.layer_scalar.to(h.dtype)
        return h
