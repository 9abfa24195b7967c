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
from gpu.parallel import SINGLE, TP


@attrs.frozen
class LinearDims:
    """A Gated DeltaNet layer's sizes, from the config."""
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_width: int

    @classmethod
    def of(cls, c: ModelConfig, tp: TP = SINGLE) -> LinearDims:
        """This rank's sizes: key and value heads split evenly over the ranks (each key head
        keeps its Hv / Hk value heads), the head dims whole."""
        k0, k1 = tp.split(c.linear_num_key_heads, "linear_num_key_heads")
        v0, v1 = tp.split(c.linear_num_value_heads, "linear_num_value_heads")
        return cls(k1 - k0, v1 - v0, c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim)

    @property
    def conv_channels(self) -> int:       # q, k and v go through the conv
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


class StatePool:
    """Every linear layer's conv and recurrent state for `num_slots` slots (the running
    sequences' and, after them, the prefix cache's snapshots: stages/schedule/state_slots.py):
    conv [L, S, C, K - 1] in the model's dtype, recurrent [L, S, Hv, Dk, Dv] in fp32."""

    def __init__(self, num_layers: int, num_slots: int, dims: LinearDims, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.num_slots = num_slots
        self.conv = torch.zeros(num_layers, num_slots, dims.conv_channels, dims.conv_width - 1,
                                dtype=dtype, device=device)
        self.recurrent = torch.zeros(num_layers, num_slots, dims.value_heads, dims.key_dim,
                                     dims.value_dim, dtype=torch.float32, device=device)

    @staticmethod
    def bytes_per_slot(config: ModelConfig, dtype: torch.dtype, tp: TP = SINGLE) -> int:
        """One sequence's states over every linear layer (this rank's heads)."""
        d = LinearDims.of(config, tp)
        conv = d.conv_channels * (d.conv_width - 1) * torch.empty((), dtype=dtype).element_size()
        recurrent = d.value_heads * d.key_dim * d.value_dim * 4
        return config.num_linear_layers * (conv + recurrent)

    def load(self, chunks) -> None:
        """Before a step: each chunk's snapshot (a prefix-cache hit) into its slot."""
        self._copy([(c.state_load, c.state_slot) for c in chunks if c.state_load >= 0])

    def save(self, chunks) -> None:
        """After a step's forward: each snapshotting chunk's slot into its snapshot."""
        self._copy([(c.state_slot, c.state_save) for c in chunks if c.state_save >= 0])

    def _copy(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src, dst = (torch.tensor(x, device=self.conv.device) for x in zip(*pairs))
        self.conv.index_copy_(1, dst, self.conv.index_select(1, src))
        self.recurrent.index_copy_(1, dst, self.recurrent.index_select(1, src))

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
        return StateStep.of(self, seqs, step_rows, step_slots, self.conv.device)


@attrs.frozen
class Chunks:
    """The sequences mixed in the chunked form, together: padded on the right to one length
    L (a pad has beta = 0 and g = 0, so it writes nothing and decays nothing: each
    sequence's state after its last real token is exact), their heads side by side."""
    rows: torch.Tensor          # [N] the real rows, sequence after sequence
    gather: torch.Tensor        # [B, L] the row of each padded position (a pad: row 0)
    valid: torch.Tensor         # [B, L] a real token
    lens: torch.Tensor          # [B] tokens of each
    slots: torch.Tensor         # [B] slot (0 where none: not read, not written)
    carried: torch.Tensor       # [B] continues from its slot's state
    kept: torch.Tensor | None   # [B'] the sequences that have a slot (their states are kept)
    kept_slots: torch.Tensor | None

    @classmethod
    def of(cls, seqs, device) -> Chunks:
        """seqs: (first row, rows, slot or -1, continues from the slot) of each sequence."""
        def t(x, dtype=torch.long):
            return _tensor(x, device, dtype)
        L = max(n for _, n, _, _ in seqs)
        kept = [b for b, (_, _, slot, _) in enumerate(seqs) if slot >= 0]
        return cls(t([q0 + j for q0, n, _, _ in seqs for j in range(n)]),
                   t([[q0 + j if j < n else 0 for j in range(L)] for q0, n, _, _ in seqs]),
                   t([[j < n for j in range(L)] for _, n, _, _ in seqs], torch.bool),
                   t([n for _, n, _, _ in seqs]), t([max(slot, 0) for _, _, slot, _ in seqs]),
                   t([c for _, _, _, c in seqs], torch.bool),
                   t(kept) if kept else None, t([seqs[b][2] for b in kept]) if kept else None)


@attrs.frozen
class StateStep:
    pool: StatePool | None
    chunks: tuple[Chunks, ...] = ()     # the prefill chunks, in groups of like lengths
    step_rows: torch.Tensor | None = None     # [B] rows of one-token steps with a state
    step_slots: torch.Tensor | None = None    # [B] their slots

    @classmethod
    def of(cls, pool: StatePool | None, seqs, step_rows=(), step_slots=(), device=None) -> StateStep:
        """seqs: (first row, rows, slot or -1, continues from the slot) of each sequence
        mixed in the chunked form; step_rows, step_slots: the one-token steps'."""
        groups = []
        for seq in sorted(seqs, key=lambda s: -s[1]):    # padding at most doubles a group's rows
            g = groups[-1] if groups else None
            if g is None or (len(g) + 1) * g[0][1] > 2 * (sum(s[1] for s in g) + seq[1]):
                groups.append([seq])
            else:
                g.append(seq)
        return cls(pool, tuple(Chunks.of(g, device) for g in groups),
                   _tensor(step_rows, device) if step_rows else None,
                   _tensor(step_slots, device) if step_slots else None)


def _tensor(x, device, dtype=torch.long) -> torch.Tensor:
    return torch.tensor(x, dtype=dtype, device=device)


def state_step_of(attn, num_tokens: int) -> StateStep:
    """The step's layout from the attention backend: the paged backends' metadata (the
    runner puts the StateStep on it), or a dense test backend's whole sequences."""
    meta = getattr(attn, "meta", None)
    if meta is not None and getattr(meta, "states", None) is not None:
        return meta.states
    if meta is not None:    # a paged step without a pool: every sequence from zeros
        starts, lens = meta.q_starts, meta.q_lens
    else:
        lens = getattr(attn, "seq_lens", None) or [num_tokens]
        starts = [sum(lens[:i]) for i in range(len(lens))]
    return StateStep.of(None, [(q0, n, -1, False) for q0, n in zip(starts, lens)])


class GatedDeltaNet(nn.Module):
    """layout "qkvz": Qwen3-Next's in_proj_qkvz and in_proj_ba, grouped by key head
    ([q, k, v, z] and [b, a] of each key head's Hv / Hk value heads); "split": Qwen3.5's
    in_proj_qkv (all q, all k, all v), in_proj_z, in_proj_b, in_proj_a.

    use_triton: None runs gpu/kernels/triton/delta_rule.py on CUDA and the torch forms
    (gpu/layers/delta_rule.py) elsewhere; True or False forces the choice (tests)."""

    use_triton: bool | None = None

    def __init__(self, config: ModelConfig, index: int, layout: str, dtype, device, tp: TP = SINGLE):
        """tp: this rank's key and value heads (LinearDims.of): its slice of every projection,
        conv channel and gate, its state in its own pool; out_proj's output is its part of
        the sum (HybridLayer all-reduces it)."""
        super().__init__()
        from gpu.models.causal_lm import Linear
        self.index = index              # among the linear layers: the pool's layer axis
        self.layout = layout
        self.dims = d = LinearDims.of(config, tp)
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
        out = torch.empty(T, d.value_heads, d.value_dim, dtype=torch.float32, device=x.device)
        for group in step.chunks:
            out.index_copy_(0, group.rows, self._chunked(mixed, g, beta, weight, group, step.pool))
        if step.step_rows is not None:
            out.index_copy_(0, step.step_rows, self._steps(mixed, g, beta, weight, step))
        o = gated_rms_norm(out.to(x.dtype).view(-1, d.value_dim), z.reshape(-1, d.value_dim),
                           self.norm.weight, self.eps)
        return self.out_proj(o.view(T, -1))

    def _kernels(self, x: torch.Tensor):
        """gpu/kernels/triton/delta_rule.py where it runs (CUDA; use_triton forces it either
        way, as the interpreter tests do), else None: the torch forms."""
        if not (x.is_cuda if self.use_triton is None else self.use_triton):
            return None
        from gpu.kernels.triton import delta_rule as kernels
        return kernels

    def _steps(self, mixed, g, beta, weight, step: StateStep) -> torch.Tensor:
        """The one-token steps: conv and recurrent state updated in their slots -> [B, Hv, Dv] fp32."""
        d, li, pool = self.dims, self.index, step.pool
        rows, slots = step.step_rows, step.step_slots
        B, kd = rows.shape[0], d.key_heads * d.key_dim
        g, beta = g.index_select(0, rows), beta.index_select(0, rows)
        if (kernels := self._kernels(mixed)) is not None:       # the pool updated in place
            y = kernels.conv1d_step(mixed.index_select(0, rows), weight, pool.conv[li], slots)
            q, k, v = y.split([kd, kd, d.value_heads * d.value_dim], dim=-1)
            return kernels.recurrent_step(q.view(B, d.key_heads, -1), k.view(B, d.key_heads, -1),
                                          v.view(B, d.value_heads, -1), g, beta, pool.recurrent[li], slots)
        y, conv_state = delta_rule.conv1d_step(mixed.index_select(0, rows), weight,
                                               pool.conv[li].index_select(0, slots))
        q, k, v = y.split([kd, kd, d.value_heads * d.value_dim], dim=-1)
        o, state = delta_rule.recurrent_step(
            q.view(B, d.key_heads, -1), k.view(B, d.key_heads, -1), v.view(B, d.value_heads, -1),
            g, beta, pool.recurrent[li].index_select(0, slots))
        pool.conv[li].index_copy_(0, slots, conv_state)
        pool.recurrent[li].index_copy_(0, slots, state)
        return o

    def _chunked(self, mixed, g, beta, weight, c: Chunks, pool: StatePool | None) -> torch.Tensor:
        """The chunked form over the step's prefill chunks at once -> their rows' outputs
        [N, Hv, Dv] (fp32), each sequence's states left in its slot."""
        d, li = self.dims, self.index
        B, K = c.gather.shape[0], d.conv_width
        x = mixed[c.gather] * c.valid[..., None]                          # [B, L, C]
        conv_state = None
        if pool is not None:                                              # zeros unless carried
            conv_state = torch.where(c.carried[:, None, None], pool.conv[li].index_select(0, c.slots), 0)
        full = torch.cat([x.new_zeros(B, x.shape[-1], K - 1) if conv_state is None
                          else conv_state.to(x.dtype), x.transpose(1, 2)], dim=-1)   # [B, C, K-1+L]
        y = F.silu(F.conv1d(full.to(weight.dtype), weight[:, None], groups=full.shape[1]))
        y = y.transpose(1, 2).contiguous().to(x.dtype)                    # [B, L, C]
        kd, vd = d.key_heads * d.key_dim, d.value_heads * d.value_dim
        q, k, v = y.split([kd, kd, vd], dim=-1)
        if (kernels := self._kernels(mixed)) is not None:
            o = self._chunked_kernel(kernels, q, k, v, g[c.gather], beta[c.gather], c, pool)
        else:
            o = self._chunked_torch(q, k, v, g, beta, c, pool)
        if pool is not None and c.kept is not None:
            # the last K - 1 inputs of each: full's columns lens .. lens + K - 2
            cols = c.lens[:, None] + torch.arange(K - 1, device=full.device)
            new_conv = full.gather(2, cols[:, None, :].expand(B, full.shape[1], K - 1))
            pool.conv[li].index_copy_(0, c.kept_slots, new_conv.index_select(0, c.kept).to(pool.conv.dtype))
        return o

    def _chunked_kernel(self, kernels, q, k, v, g, beta, c: Chunks, pool: StatePool | None) -> torch.Tensor:
        """q, k, v [B, L, *] padded, g, beta [B, L, Hv] -> [N, Hv, Dv]; the recurrent states
        read and written in the pool by slot (kept sequences only)."""
        d, (B, L) = self.dims, c.gather.shape
        slots = torch.full((B,), -1, dtype=torch.long, device=q.device)
        if pool is None:
            state = torch.zeros(1, d.value_heads, d.key_dim, d.value_dim, device=q.device)
        else:
            state = pool.recurrent[self.index]
            if c.kept is not None:
                slots.index_copy_(0, c.kept, c.kept_slots)
        o = kernels.chunked(q.view(B, L, d.key_heads, d.key_dim), k.view(B, L, d.key_heads, d.key_dim),
                            v.view(B, L, d.value_heads, d.value_dim), g.contiguous(), beta.contiguous(),
                            c.lens, state, slots, c.carried)
        return o[c.valid]

    def _chunked_torch(self, q, k, v, g, beta, c: Chunks, pool: StatePool | None) -> torch.Tensor:
        d, li = self.dims, self.index
        B, L = c.gather.shape
        # sequences side by side as heads: [L, B * H, D]
        def heads(z, h):
            return z.reshape(B, L, h, -1).transpose(0, 1).reshape(L, B * h, -1)
        valid = c.valid[..., None].float()
        gp, bp = (g[c.gather] * valid).transpose(0, 1).reshape(L, -1), \
            (beta[c.gather] * valid).transpose(0, 1).reshape(L, -1)
        state = None
        if pool is not None:
            state = torch.where(c.carried[:, None, None, None], pool.recurrent[li].index_select(0, c.slots),
                                0).reshape(B * d.value_heads, d.key_dim, d.value_dim)
        o, state = delta_rule.chunked(heads(q, d.key_heads), heads(k, d.key_heads),
                                      heads(v, d.value_heads), gp, bp, state)
        o = o.reshape(L, B, d.value_heads, d.value_dim).transpose(0, 1)[c.valid]   # [N, Hv, Dv]
        if pool is not None and c.kept is not None:
            state = state.reshape(B, d.value_heads, d.key_dim, d.value_dim)
            pool.recurrent[li].index_copy_(0, c.kept_slots, state.index_select(0, c.kept))
        return o

