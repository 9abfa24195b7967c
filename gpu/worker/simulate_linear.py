"""The GPU stand-in's price of a hybrid linear-attention model (Qwen3-Next, Qwen3.5: three
of every four layers Gated DeltaNet, gpu/layers/linear_attention.py), beside
gpu/worker/simulate.py's CostModel, which prices the rest as for any model.

A Gated DeltaNet layer keeps no KV cache. What it costs a step:

- its projections' weights, read once (CostModel's matmul_params):
  in_proj_qkvz [D, 2 Hk Dk + 2 Hv Dv] and in_proj_ba [D, 2 Hv] (Qwen3.5 splits the same
  columns into in_proj_qkv, _z, _b, _a), out_proj [Hv Dv, D]; the depthwise conv's weight
  [C, K] beside them (C = 2 Hk Dk + Hv Dv channels);
- each scheduled sequence's states, read from its StatePool slot and written back: the
  recurrent state [Hv, Dk, Dv] in fp32 and the conv state [C, K - 1] in the model's dtype
  (bf16), once per step whatever the sequence's tokens (the Triton kernels keep the state
  tile in registers along a prefill chunk: gpu/kernels/triton/delta_rule.py), at
  `state_efficiency` of the bandwidth;
- the delta rule's arithmetic, in fp32 (the kernels' dots are "ieee", not tf32 or bf16:
  DOT_PRECISION), so on the CUDA cores' fp32 rate, not the tensor cores' bf16 one. Per value
  head, a decode token: decay, k.S, the rank-one update and q.S, 7 Dk Dv. A prefill chunk
  of C = 64 tokens (a sequence's q_len in ceil(q_len / C) chunks, the last one padded), per
  BV = 32 columns of the value dim (each tile recomputes A, its inverse and W:
  Dv / BV tiles): A = beta k k^T exp(.) 2 C^2 Dk, the unitriangular inverse by forward
  substitution 2 C^3, W 2 C^2 Dk, q k^T 2 C^2 Dk; then once per head U 2 C^2 Dv, P V'
  2 C^2 Dv, W S, q S and the state update 3 x 2 C Dk Dv.
The mixer's part of a step is max(state bytes / (BW x E_state), fp32 FLOPs / fp32 peak),
added to the rest's roofline (its own kernels, after the projections' GEMMs).

The CUDA path runs these models without CUDA graphs (pipeline/core/startup.py: the state
pool's slots are not captured), so every step's kernels are launched eagerly. Their count,
from an aten-op count of a decode step of the tiny Qwen3-Next and Qwen3.5 models
(views and no-op casts left out; the torch forms of the conv and the recurrent step replaced
by the Triton path's 2 kernels and 3 row gathers), per layer:
- (1 + w) RMSNorm: 8 (the input and the post-attention one), the two residual adds and
  their casts: 4;
- Gated DeltaNet: 28 (Qwen3-Next's in_proj_qkvz/ba split into q, k, v, z, b, a and the
  cat; Qwen3.5's four projections 31) + 5;
- gated full attention: 35 (q/gate, k, v, o GEMMs, the q/k norms, partial RoPE, the KV
  write, attention, the gate);
- the MLP: 3 (gate_up, silu-and-mul, down), a mixture's gpu/layers/moe.py ops (MOE_KERNELS)
  with the shared expert's 4 and its sigmoid gate's 2.
"""
from __future__ import annotations

import math

import attrs

from gpu.config.model import ModelConfig

CHUNK = 64          # gpu/kernels/triton/delta_rule.py CHUNK
BV = 32             # its chunked kernel's value-dim tile
NORM_KERNELS = 8
RESIDUAL_KERNELS = 4
LINEAR_MIXER_KERNELS = 28 + 5
GATED_ATTENTION_KERNELS = 35
SHARED_GATE_KERNELS = 2


def linear_layer_params(c: ModelConfig) -> int:
    """One Gated DeltaNet layer's projection weights (the matmuls)."""
    D = c.hidden_size
    kd, vd = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
    return D * (2 * kd + 2 * vd) + D * 2 * c.linear_num_value_heads + vd * D


def mixer_params(c: ModelConfig) -> int:
    """Every layer's sequence mixer's projection weights: attention's (with the output gate's
    q_proj half where the model has one), Gated DeltaNet's for its linear layers."""
    gate = c.hidden_size * c.q_size if c.attn_output_gate else 0
    return c.num_kv_layers * (c.attention_params + gate) + c.num_linear_layers * linear_layer_params(c)


def hybrid_kernels(c: ModelConfig, moe_kernels: int) -> int:
    """A step's kernels in the forward of a hybrid model, launched eagerly (module docstring)."""
    L = c.num_hidden_layers
    moe_layers = sum(c.is_moe_layer(i) for i in range(L))
    shared = 4 + SHARED_GATE_KERNELS * c.moe.shared_gate if c.moe.shared_intermediate_size else 0
    per_layer = 2 * NORM_KERNELS + RESIDUAL_KERNELS
    return (1 + NORM_KERNELS + L * per_layer + c.num_linear_layers * LINEAR_MIXER_KERNELS
            + c.num_kv_layers * GATED_ATTENTION_KERNELS
            + moe_layers * (moe_kernels + shared) + (L - moe_layers) * 3)


@attrs.frozen
class LinearCost:
    """What a hybrid model's Gated DeltaNet layers cost a step beyond their weights."""
    layers: int
    value_heads: int
    key_dim: int
    value_dim: int
    state_bytes: int              # one sequence's recurrent + conv state, every linear layer

    @classmethod
    def of(cls, c: ModelConfig, elem_bytes: int = 2) -> LinearCost | None:
        if not c.num_linear_layers:
            return None
        channels = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
        per_layer = (c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
                     + channels * (c.linear_conv_kernel_dim - 1) * elem_bytes)
        return cls(c.num_linear_layers, c.linear_num_value_heads, c.linear_key_head_dim,
                   c.linear_value_head_dim, c.num_linear_layers * per_layer)

    def flops(self, q_len: int) -> float:
        """The delta rule's fp32 FLOPs for one sequence's q_len tokens of a step, every layer:
        a recurrent step for one token, the chunked form by chunks for more."""
        Dk, Dv, C = self.key_dim, self.value_dim, CHUNK
        if q_len == 1:
            head = 7 * Dk * Dv
        else:
            tiles = math.ceil(Dv / BV)
            per_chunk = tiles * (3 * 2 * C * C * Dk + 2 * C ** 3) + 2 * 2 * C * C * Dv + 3 * 2 * C * Dk * Dv
            head = math.ceil(q_len / C) * per_chunk
        return float(self.layers * self.value_heads * head)

    def seconds(self, q_lens: list[int], bandwidth: float, fp32_flops: float) -> float:
        """The mixers' part of a step: each scheduled sequence's states read and written,
        against the delta rule's arithmetic."""
        traffic = 2 * self.state_bytes * len(q_lens) / bandwidth
        return max(traffic, sum(self.flops(q) for q in q_lens) / fp32_flops)
