"""Gated DeltaNet (Qwen3-Next, Qwen3.5): linear attention with a fixed-size state per
sequence, and the pool that holds those states beside the paged KV cache.

A layer projects each token to q, k, v (the conv's input), z (the output gate), b (beta's
logit) and a (the decay's), runs q, k, v through a causal depthwise conv1d (width K,
its state the K - 1 inputs before the chunk) and silu, then the gated delta rule
(gpu/layers/delta_rule.py, state [Hv, Dk, Dv]), a gated RMSNorm per value head and out_proj.

The states live in a `StatePool`: one slot a running sequence (the scheduler gives it,
stages/schedule/state_slots.py; SeqChunk.state_slot carries it), each holding every
linear layer's conv state (model dtype) and recurrent state (fp32). A step's layout is a
`StateStep`: the sequences whose chunk starts at position 0 begin from zeros; the others
continue from their slot, and every sequence with a slot leaves its new state there. Rows
that are one token of a sequence with a state are mixed together (a decode batch); the
others one sequence at a time, the chunked form.
"""
from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from gpu.config.model import ModelConfig
from gpu.layers import delta_rule
from gpu.layers.norms import GatedRMSNorm, gated_rms_norm
from gpu.layers.ops import skip_init


@attrs.frozen
class LinearDims:
    """A Gated DeltaNet layer's sizes, from the config."""
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_width: int

    @classmethod
    def of(cls, c: ModelConfig) -> LinearDims:
        return cls(c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                   c.linear_value_head_dim, c.linear_conv_kernel_dim)

    @property
    def conv_channels(self) -> int:       # q, k and v go through the conv
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


class StatePool:
    """Every linear layer's conv and recurrent state for `num_slots` sequences:
    conv [L, S, C, K - 1] in the model's dtype, recurrent [L, S, Hv, Dk, Dv] in fp32."""

    def __init__(self, num_layers: int, num_slots: int, dims: LinearDims, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.num_slots = num_slots
        self.conv = torch.zeros(num_layers, num_slots, dims.conv_channels, dims.conv_width - 1,
                                dtype=dtype, device=device)
        self.recurrent = torch.zeros(num_layers, num_slots, dims.value_heads, dims.key_dim,
                                     dims.value_dim, dtype=torch.float32, device=device)

    @staticmethod
    def bytes_per_slot(config: ModelConfig, dtype: torch.dtype) -> int:
        """One sequence's states over every linear layer."""
        d = LinearDims.of(config)
        conv = d.conv_channels * (d.conv_width - 1) * torch.empty((), dtype=dtype).element_size()
        recurrent = d.value_heads * d.key_dim * d.value_dim * 4
        return config.num_linear_layers * (conv + recurrent)

    def step(self, slots: list[int], q_starts: list[int], q_lens: list[int],
             start_positions: list[int]) -> StateStep:
        """A step's layout: per sequence (in batch order) its slot (-1: none, its state is
        neither read nor kept), its first row and row count, and the tokens before it."""
        seqs, step_rows, step_slots = [], [], []
        for slot, q0, n, start in zip(slots, q_starts, q_lens, start_positions):
            carried = slot >= 0 and start > 0
            if n == 1 and carried:
                step_rows.append(q0)
                step_slots.append(slot)
            else:
                seqs.append((q0, n, slot, carried))
        dev = self.conv.device
        return StateStep(self, tuple(seqs),
                         torch.tensor(step_rows, dtype=torch.long, device=dev) if step_rows else None,
                         torch.tensor(step_slots, dtype=torch.long, device=dev) if step_slots else None)


@attrs.frozen
class StateStep:
    pool: StatePool | None
    # (first row, rows, slot or -1, continues from the slot's state) for each sequence mixed alone
    seqs: tuple[tuple[int, int, int, bool], ...]
    step_rows: torch.Tensor | None = None     # [B] rows of one-token steps with a state
    step_slots: torch.Tensor | None = None    # [B] their slots


def state_step_of(attn, num_tokens: int) -> StateStep:
    """The step's layout from the attention backend: the paged backends' metadata (the
    runner puts the StateStep on it), or a dense test backend's whole sequences."""
    meta = getattr(attn, "meta", None)
    if meta is not None and getattr(meta, "states", None) is not None:
        return meta.states
    if meta is not None:    # a paged step without a pool: every sequence from zeros
        return StateStep(None, tuple((q0, n, -1, False) for q0, n in zip(meta.q_starts, meta.q_lens)))
    lens = getattr(attn, "seq_lens", None) or [num_tokens]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    return StateStep(None, tuple((q0, n, -1, False) for q0, n in zip(starts, lens)))


class GatedDeltaNet(nn.Module):
    """layout "qkvz": Qwen3-Next's in_proj_qkvz and in_proj_ba, grouped by key head
    ([q, k, v, z] and [b, a] of each key head's Hv / Hk value heads); "split": Qwen3.5's
    in_proj_qkv (all q, all k, all v), in_proj_z, in_proj_b, in_proj_a."""

    def __init__(self, config: ModelConfig, index: int, layout: str, dtype, device):
        super().__init__()
        from gpu.models.causal_lm import Linear
        self.index = index              # among the linear layers: the pool's layer axis
        self.layout = layout
        self.dims = d = LinearDims.of(config)
        self.eps = config.rms_norm_eps
        D, kd, vd = config.hidden_size, d.key_heads * d.key_dim, d.value_heads * d.value_dim
        kw = dict(bias=False, dtype=dtype, device=device)
        if layout == "qkvz":
            self.in_proj_qkvz = skip_init(Linear, D, 2 * kd + 2 * vd, **kw)
            self.in_proj_ba = skip_init(Linear, D, 2 * d.value_heads, **kw)
        elif layout == "split":
            self.in_proj_qkv = skip_init(Linear, D, 2 * kd + vd, **kw)
            self.in_proj_z = skip_init(Linear, D, vd, **kw)
            self.in_proj_b = skip_init(Linear, D, d.value_heads, **kw)
            self.in_proj_a = skip_init(Linear, D, d.value_heads, **kw)
        else:
            raise ValueError(f"unknown Gated DeltaNet projection layout {layout!r}")
        C = d.conv_channels
        self.conv1d = skip_init(nn.Conv1d, C, C, d.conv_width, groups=C, bias=False, dtype=dtype, device=device)
        self.dt_bias = nn.Parameter(torch.empty(d.value_heads, dtype=dtype, device=device))
        self.A_log = nn.Parameter(torch.empty(d.value_heads, dtype=dtype, device=device))
        self.norm = GatedRMSNorm(d.value_dim, config.rms_norm_eps, dtype, device)
        self.out_proj = skip_init(Linear, vd, D, **kw)

    def _project(self, x: torch.Tensor):
        """x [T, D] -> the conv's input [T, C], z [T, Hv, Dv], b and a [T, Hv]."""
        d, T = self.dims, x.shape[0]
        if self.layout == "qkvz":
            r = d.value_heads // d.key_heads
            qkvz = self.in_proj_qkvz(x).view(T, d.key_heads, -1)
            q, k, v, z = qkvz.split([d.key_dim, d.key_dim, r * d.value_dim, r * d.value_dim], dim=-1)
            b, a = self.in_proj_ba(x).view(T, d.key_heads, 2 * r).split([r, r], dim=-1)
            mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
            return mixed, z.reshape(T, d.value_heads, d.value_dim), b.reshape(T, -1), a.reshape(T, -1)
        return (self.in_proj_qkv(x), self.in_proj_z(x).view(T, d.value_heads, d.value_dim),
                self.in_proj_b(x), self.in_proj_a(x))

    def forward(self, x: torch.Tensor, step: StateStep) -> torch.Tensor:
        """x [T, D] -> [T, D], reading and writing the step's sequences' states."""
        d, T = self.dims, x.shape[0]
        mixed, z, b, a = self._project(x)
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())   # [T, Hv]
        weight = self.conv1d.weight[:, 0]                                # [C, K]
        kd = d.key_heads * d.key_dim
        out = torch.empty(T, d.value_heads, d.value_dim, dtype=torch.float32, device=x.device)
        pool, li = step.pool, self.index
        for q0, n, slot, carried in step.seqs:
            rows = slice(q0, q0 + n)
            conv_state = pool.conv[li, slot] if carried else None
            state = pool.recurrent[li, slot] if carried else None
            y, conv_state = delta_rule.conv1d(mixed[rows], weight, conv_state)
            q, k, v = y.split([kd, kd, d.value_heads * d.value_dim], dim=-1)
            o, state = delta_rule.chunked(q.view(n, d.key_heads, -1), k.view(n, d.key_heads, -1),
                                          v.view(n, d.value_heads, -1), g[rows], beta[rows], state)
            out[rows] = o
            if slot >= 0:
                pool.conv[li, slot] = conv_state
                pool.recurrent[li, slot] = state
        if step.step_rows is not None:
            rows, slots = step.step_rows, step.step_slots
            B = rows.shape[0]
            y, conv_state = delta_rule.conv1d_step(mixed.index_select(0, rows), weight,
                                                   pool.conv[li].index_select(0, slots))
            q, k, v = y.split([kd, kd, d.value_heads * d.value_dim], dim=-1)
            o, state = delta_rule.recurrent_step(
                q.view(B, d.key_heads, -1), k.view(B, d.key_heads, -1), v.view(B, d.value_heads, -1),
                g.index_select(0, rows), beta.index_select(0, rows), pool.recurrent[li].index_select(0, slots))
            out.index_copy_(0, rows, o)
            pool.conv[li].index_copy_(0, slots, conv_state)
            pool.recurrent[li].index_copy_(0, slots, state)
        o = gated_rms_norm(out.to(x.dtype).view(-1, d.value_dim), z.reshape(-1, d.value_dim),
                           self.norm.weight, self.eps)
        return self.out_proj(o.view(T, -1))

