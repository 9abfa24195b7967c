"""Pooling models (issue 32): a backbone's hidden states -> one vector per sequence.

A `PoolingModel` is a backbone (gpu/models/bert.py's Encoder, or gpu/models/causal_lm.py's CausalLM
built without its LM head: `--convert embed|classify`), a pooler (MEAN, CLS or LAST over
each sequence's rows) and, for a classifier, a head. `finish` applies what each request
asked: a Matryoshka cut, L2 normalization, the classifier's activation.

Nothing is cached: the attention backend here, `VarlenAttention`, attends within each
sequence of the step over the step's own k/v (bidirectional for an encoder, causal for a
decoder) and keeps nothing after it. On CPU an encoder's step runs in the padded layout
(slabs of sequences sorted by length, a key mask hiding each one's padding, no gathers
between layers); a decoder's sequences are gathered into padded SDPA groups a layer; on CUDA the prefill kernel runs in its non-causal mode
(gpu/kernels/triton/paged_attention.py, causal=False) with the step's k/v as a cache of
one-token pages.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu.interface import PoolingOptions
from gpu.models.causal_lm import Linear
from gpu.config.pooling import PoolingSpec
from gpu.layers.ops import skip_init


class VarlenAttention:
    """Attention within each sequence of a flat batch, over the step's own k/v only."""

    fused_qkv = False   # the decoder's Attention takes the unfused path (q, k, v)

    def __init__(self, scale: float, *, causal: bool, use_triton: bool = False, padded: bool = False) -> None:
        self.scale = scale
        self.causal = causal
        self.use_triton = use_triton
        self.padded = padded and not use_triton
        self.lens: list[int] = []
        self.rows: torch.Tensor | None = None

    def prepare(self, seq_lens: list[int], device: torch.device) -> torch.Tensor | None:
        """The step's layout, shared by every layer. In the padded layout, the gather index
        that lays the step's flat token rows out as its slabs (the caller applies it to the
        model's inputs; `unpad` takes the hidden states back); else None."""
        self.lens = list(seq_lens)
        self.rows = None
        if self.padded:
            return self._prepare_padded(seq_lens, device)
        B, L = len(seq_lens), max(seq_lens)
        starts = [0]
        for n in seq_lens:
            starts.append(starts[-1] + n)
        T = starts[-1]
        if self.use_triton:
            # the step's k/v as a paged cache of one-token pages: page t is token t
            rows = torch.tensor(starts[:-1])[:, None] + torch.arange(L)[None, :]
            self.block_tables = rows.clamp(max=max(T - 1, 0)).to(torch.int32).to(device)
            self.cu_seqlens = torch.tensor(starts, dtype=torch.int32, device=device)
            self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
            self.max_len = L
            return
        self.groups = [self._group(g, seq_lens, starts, device) for g in _buckets(seq_lens)]

    def _group(self, members: list[int], lens: list[int], starts: list[int], device) -> tuple:
        """One SDPA call's sequences: (start, end) of a lone one's rows; else the gather
        index of the padded [G, L] layout (a padding slot repeats its sequence's last row,
        which the key mask hides), the key mask (None when all are as long), the valid
        slots of the padded layout and the rows they go to."""
        if len(members) == 1:
            b = members[0]
            return (starts[b], starts[b + 1])
        L = max(lens[b] for b in members)
        cols = torch.arange(L)
        glens = torch.tensor([lens[b] for b in members])
        first = torch.tensor([starts[b] for b in members])
        valid = cols[None, :] < glens[:, None]                                   # [G, L]
        gather = (first[:, None] + torch.minimum(cols[None, :], glens[:, None] - 1)).reshape(-1)
        mask = None
        if not bool(valid.all()):
            mask = valid[:, None, None, :]
            if self.causal:
                mask = mask & torch.ones(L, L, dtype=torch.bool).tril()
            mask = mask.to(device)
        keep = valid.reshape(-1).nonzero()[:, 0]
        dest = gather.index_select(0, keep)
        return (gather.to(device), mask, keep.to(device), dest.to(device), len(members), L)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
        """q [T, Hq, Dh], k/v [T, Hkv, Dh] -> [T, Hq, Dh]."""
        if sinks is not None or window is not None:
            raise ValueError("a pooling model's attention has no sinks or sliding windows")
        if self.use_triton:
            from gpu.kernels.triton.paged_attention import paged_attention
            T, hkv, dh = k.shape
            return paged_attention(q, k.reshape(T, 1, hkv, dh), v.reshape(T, 1, hkv, dh), self.block_tables,
                                   self.cu_seqlens, self.seq_lens, self.scale, causal=self.causal,
                                   max_seqlen_q=self.max_len)
        gqa = q.shape[1] != k.shape[1]
        if self.padded:
            return self._forward_padded(q, k, v, gqa)
        if len(self.groups) == 1 and len(self.groups[0]) == 2:      # one sequence: no copy
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                               is_causal=self.causal, scale=self.scale, enable_gqa=gqa)
            return o.transpose(0, 1)
        out = q.new_empty(q.shape)
        for group in self.groups:
            if len(group) == 2:
                s, e = group
                o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1),
                                                   v[s:e].transpose(0, 1), is_causal=self.causal,
                                                   scale=self.scale, enable_gqa=gqa)
                out[s:e] = o.transpose(0, 1)
                continue
            gather, mask, keep, dest, G, L = group

            def padded(x: torch.Tensor) -> torch.Tensor:                       # -> [G, H, L, Dh]
                return x.index_select(0, gather).view(G, L, *x.shape[1:]).transpose(1, 2)

            o = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=mask,
                                               is_causal=self.causal and mask is None,
                                               scale=self.scale, enable_gqa=gqa)
            out.index_copy_(0, dest, o.transpose(1, 2).reshape(G * L, *q.shape[1:]).index_select(0, keep))
        return out


    # -- the padded layout (an encoder's step on the CPU) --------------------------------

    def _prepare_padded(self, lens: list[int], device: torch.device) -> torch.Tensor:
        """The step's sequences sorted by length into slabs of [G, L] rows (DENSE_SLACK), each
        sequence's tokens then its padding (copies of its last token, hidden by the key
        mask). Every layer then runs on these rows as they are: each slab's q/k/v are views
        of the qkv projection's output, one SDPA call a slab, and no row is gathered or
        scattered between layers (sentence-transformers' shape: it pads batches it sorted by
        length). The padding rows cost their GEMM rows, at most DENSE_SLACK - 1 of the step."""
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        index, rows = [], [0] * starts[-1]
        self.slabs = []
        for members in _buckets(lens, DENSE_SLACK):
            L = max(lens[b] for b in members)
            off = len(index)
            for g, b in enumerate(members):
                n, first = lens[b], starts[b]
                rows[first:first + n] = range(off + g * L, off + g * L + n)
                index.extend(range(first, first + n))
                index.extend([first + n - 1] * (L - n))
            mask = None
            if any(lens[b] != L for b in members):
                valid = torch.arange(L)[None, :] < torch.tensor([lens[b] for b in members])[:, None]
                mask = valid[:, None, None, :]
                if self.causal:
                    mask = mask & torch.ones(L, L, dtype=torch.bool).tril()
                mask = mask.to(device)
            self.slabs.append((off, len(members), L, mask))
        self.rows = torch.tensor(rows, dtype=torch.int64, device=device)
        return torch.tensor(index, dtype=torch.int64)

    def _forward_padded(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> torch.Tensor:
        H, Dh = q.shape[1:]
        if len(self.slabs) == 1 and self.slabs[0][1] == 1:         # one sequence: no copy
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                               is_causal=self.causal, scale=self.scale, enable_gqa=gqa)
            return o.transpose(0, 1)
        out = q.new_empty(q.shape)
        for off, G, L, mask in self.slabs:
            qs, ks, vs = (x[off:off + G * L].view(G, L, *x.shape[1:]).transpose(1, 2)   # [G, H, L, Dh]
                          for x in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask,
                                               is_causal=self.causal and mask is None,
                                               scale=self.scale, enable_gqa=gqa)
            out[off:off + G * L].view(G, L, H, Dh).copy_(o.transpose(1, 2))
        return out

    def unpad(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [rows of the layout, D] -> [the step's tokens, D] in their flat order."""
        return hidden if self.rows is None else hidden.index_select(0, self.rows)


# A bucket of sequences padded to its longest may hold this much more than its tokens.
PAD_SLACK = 1.25
# The padded layout's slabs: their padding rows go through every GEMM (each row about as dear
# as a real token), while one more slab costs only an SDPA call and a copy a layer.
DENSE_SLACK = 1.04


def _buckets(lens: list[int], slack: float = PAD_SLACK) -> list[list[int]]:
    """The sequences (by index) in groups of similar length, one SDPA call each: sorted by
    length, a group grows while padding it to its longest costs at most `slack` x its
    tokens (and attention's L^2 at most slack^2)."""
    order = sorted(range(len(lens)), key=lens.__getitem__)
    groups: list[list[int]] = []
    cur: list[int] = []
    total = 0
    for b in order:
        n = lens[b]
        if cur and n * (len(cur) + 1) > slack * (total + n):
            groups.append(cur)
            cur, total = [], 0
        cur.append(b)
        total += n
    if cur:
        groups.append(cur)
    return groups


def pool(hidden: torch.Tensor, seq_lens: list[int], pooling_type: str) -> torch.Tensor:
    """hidden [T, D] of sequences of these lengths, in order -> [B, D] in fp32."""
    starts = [0]
    for n in seq_lens:
        starts.append(starts[-1] + n)
    dev = hidden.device
    if pooling_type == "CLS":
        return hidden.index_select(0, torch.tensor(starts[:-1], device=dev)).float()
    if pooling_type == "LAST":
        return hidden.index_select(0, torch.tensor(starts[1:], device=dev) - 1).float()
    if pooling_type == "MEAN":
        seg = torch.repeat_interleave(torch.arange(len(seq_lens), device=dev),
                                      torch.tensor(seq_lens, device=dev))
        sums = torch.zeros(len(seq_lens), hidden.shape[1], dtype=torch.float32, device=dev)
        sums.index_add_(0, seg, hidden.float())
        return sums / torch.tensor(seq_lens, dtype=torch.float32, device=dev)[:, None]
    raise ValueError(f"unsupported pooling type {pooling_type!r}")


class ClassifierHead(nn.Module):
    """A sequence classifier's head over the pooled hidden state [B, D] -> logits [B, labels]:
    BERT's (its pooler's dense + tanh, then `classifier`), RoBERTa's (`classifier.dense` +
    tanh, `classifier.out_proj`) or a decoder's (`score`, no bias)."""

    def __init__(self, kind: str, hidden: int, num_labels: int, dtype, device):
        super().__init__()
        self.kind = kind
        kw = dict(dtype=dtype, device=device)
        if kind == "decoder":
            self.dense = None
            self.out = skip_init(Linear, hidden, num_labels, bias=False, **kw)
        else:
            self.dense = skip_init(Linear, hidden, hidden, bias=True, **kw)
            self.out = skip_init(Linear, hidden, num_labels, bias=True, **kw)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        x = pooled.to(self.out.weight.dtype)
        if self.dense is not None:
            x = torch.tanh(self.dense(x))
        return self.out(x).float()

    def checkpoint_names(self) -> dict[str, str]:
        """HF name -> our parameter name (without a model prefix)."""
        if self.kind == "decoder":
            return {"score.weight": "out.weight"}
        if self.kind == "bert":
            return {"pooler.dense.weight": "dense.weight", "pooler.dense.bias": "dense.bias",
                    "classifier.weight": "out.weight", "classifier.bias": "out.bias"}
        return {"classifier.dense.weight": "dense.weight", "classifier.dense.bias": "dense.bias",
                "classifier.out_proj.weight": "out.weight", "classifier.out_proj.bias": "out.bias"}


class PoolingModel(nn.Module):
    """backbone + pooler (+ head): one vector per sequence."""

    def __init__(self, backbone: nn.Module, spec: PoolingSpec, head: ClassifierHead | None = None):
        super().__init__()
        self.backbone = backbone
        self.spec = spec
        self.head = head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: VarlenAttention,
                seq_lens: list[int], token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The step's sequences -> [B, out] fp32: embeddings (before finish) or logits."""
        if self.spec.encoder:
            hidden = self.backbone(input_ids, positions, attn, token_type_ids)
        else:
            hidden = self.backbone(input_ids, positions, attn)
        pooled = pool(attn.unpad(hidden), seq_lens, self.spec.pooling_type)
        return self.head(pooled) if self.head is not None else pooled


def finish(pooled: torch.Tensor, options: list[PoolingOptions], spec: PoolingSpec) -> list[torch.Tensor]:
    """Each row as its request asked: an embedding cut to its dimensions (Matryoshka) and
    L2-normalized; a classifier's logits through its activation (sigmoid for one label,
    softmax for several). Rows with the same options are done together."""
    out: list[torch.Tensor | None] = [None] * len(options)
    groups: dict[PoolingOptions, list[int]] = {}
    for i, o in enumerate(options):
        groups.setdefault(o, []).append(i)
    for o, rows in groups.items():
        x = pooled[rows] if len(rows) < len(options) else pooled
        if spec.task == "embed":
            dims = o.dimensions or spec.dimensions
            if dims is not None:
                x = x[:, :dims]
            if spec.normalize if o.normalize is None else o.normalize:
                x = F.normalize(x, p=2.0, dim=-1)
        elif spec.use_activation if o.use_activation is None else o.use_activation:
            x = torch.sigmoid(x) if x.shape[1] == 1 else x.softmax(-1)
        for j, r in enumerate(rows):
            out[r] = x[j]
    return out
