"""Gated full attention (Qwen3-Next, Qwen3.5): q_proj gives each head's query and a gate
side by side ([T, Hq, 2 Dh]); q and k get a (1 + w) RMSNorm per head, then RoPE on the
first `rotary_dim` dims only (partial RoPE: a quarter of the head in the released
configs); the paged attention backend attends as for any layer, and the heads' output is
multiplied by sigmoid(gate) before o_proj."""
from __future__ import annotations

import attrs
import torch
from torch import nn

from gpu.config.model import ModelConfig
from gpu.layers.norms import OffsetRMSNorm
from gpu.layers.ops import apply_rope, build_rope_cache, skip_init
from gpu.parallel import SINGLE, TP


def partial_rope_cache(config: ModelConfig, max_positions: int, device=None) -> torch.Tensor:
    """[P, rotary_dim]: the cos/sin table of the rotated dims (build_rope_cache's layout)."""
    rot = attrs.evolve(config, head_dim=config.rope_dim, partial_rotary_factor=1.0, rotary_dim=0)
    return build_rope_cache(rot, max_positions, device)


def apply_partial_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                       cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, Dh], k [T, Hkv, Dh]: NeoX rotation of the first cos_sin.shape[-1] dims."""
    rot = cos_sin.shape[-1]
    if rot == q.shape[-1]:
        return apply_rope(q, k, positions, cos_sin)
    qr, kr = apply_rope(q[..., :rot].contiguous(), k[..., :rot].contiguous(), positions, cos_sin)
    return torch.cat([qr, q[..., rot:]], dim=-1), torch.cat([kr, k[..., rot:]], dim=-1)


class GatedAttention(nn.Module):
    def __init__(self, config: ModelConfig, kv_index: int, dtype, device, tp: TP = SINGLE):
        """kv_index: this layer's place among the layers with a KV cache (the backend's layer).
        tp: this rank's query heads (with their gates) and KV heads, as CausalLM's Attention
        splits them; o_proj's output is its part of the sum."""
        super().__init__()
        from gpu.models.causal_lm import Linear, kv_heads, q_heads
        c = config
        (q0, q1), (k0, k1) = q_heads(c, tp), kv_heads(c, tp)
        self.kv_index = kv_index
        self.num_heads, self.num_kv_heads, self.head_dim = q1 - q0, k1 - k0, c.head_dim
        q_size, kv_size = self.num_heads * c.head_dim, self.num_kv_heads * c.head_dim
        kw = dict(bias=c.attention_bias, dtype=dtype, device=device)
        self.q_proj = skip_init(Linear, c.hidden_size, 2 * q_size, **kw)
        self.k_proj = skip_init(Linear, c.hidden_size, kv_size, **kw)
        self.v_proj = skip_init(Linear, c.hidden_size, kv_size, **kw)
        self.o_proj = skip_init(Linear, q_size, c.hidden_size, **kw)
        self.q_norm = OffsetRMSNorm(c.head_dim, c.rms_norm_eps, dtype, device)
        self.k_norm = OffsetRMSNorm(c.head_dim, c.rms_norm_eps, dtype, device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, attn) -> torch.Tensor:
        T, H, Dh = x.shape[0], self.num_heads, self.head_dim
        q, gate = self.q_proj(x).view(T, H, 2 * Dh).chunk(2, dim=-1)    # [T, Hq, Dh] each
        k = self.k_proj(x).view(T, self.num_kv_heads, Dh)
        v = self.v_proj(x).view(T, self.num_kv_heads, Dh)
        q = self.q_norm(q.reshape(-1, Dh)).view(T, H, Dh)
        k = self.k_norm(k.reshape(-1, Dh)).view_as(k)
        q, k = apply_partial_rope(q, k, positions, cos_sin)
        o = attn.forward(self.kv_index, q, k, v)                            # [T, Hq, Dh]
        o = o * torch.sigmoid(gate.to(o.dtype))
        return self.o_proj(o.reshape(T, -1))
