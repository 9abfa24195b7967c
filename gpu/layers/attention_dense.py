"""Dense (unpaged) attention backends and a greedy decoding loop, for tests and sanity checks.

The serving path uses the paged backend in gpu/layers/attention.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gpu.layers.attention import sdpa, window_visible


class DenseCausalAttention:
    """Causal attention over a flat batch of whole sequences starting at position 0.

    seq_lens: lengths of the concatenated sequences; None means the batch is one sequence.
    """

    fused_qkv = False     # takes q, k, v normed and roped (gpu/models/causal_lm.py AttentionBackend)

    def __init__(self, seq_lens: Sequence[int] | None = None):
        self.seq_lens = None if seq_lens is None else list(seq_lens)

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                sinks: torch.Tensor | None = None, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        T, Hq, Dh = q.shape
        lens = self.seq_lens or [T]
        sink = None if sinks is None else sinks.view(-1, 1, 1)  # [Hq, 1, 1]
        out = []
        for qs, ks, vs in zip(q.split(lens), k.split(lens), v.split(lens)):
            pos = torch.arange(qs.shape[0], device=q.device)
            visible = window_visible(pos, pos, window) if window is not None or sink is not None else None
            o = sdpa(qs.transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],  # [1, H, t, Dh]
                     visible, None, sink, is_causal=visible is None, softcap=softcap)  # [1, Hq, t, Dh]
            out.append(o[0].transpose(0, 1))
        return torch.cat(out)  # [T, Hq, Dh]


class DenseCachedAttention:
    """One sequence decoded step by step: keeps every layer's k/v and attends to all of it."""

    fused_qkv = False     # takes q, k, v normed and roped (gpu/models/causal_lm.py AttentionBackend)

    def __init__(self):
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                sinks: torch.Tensor | None = None, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        if layer_idx in self.kv:
            k = torch.cat([self.kv[layer_idx][0], k])  # [L, Hkv, Dh]
            v = torch.cat([self.kv[layer_idx][1], v])
        self.kv[layer_idx] = (k, v)
        t, L = q.shape[0], k.shape[0]
        mask = window_visible(torch.arange(L - t, L, device=q.device), torch.arange(L, device=q.device), window)
        sink = None if sinks is None else sinks.view(-1, 1, 1)
        o = sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, None, sink,
                 softcap=softcap)
        return o[0].transpose(0, 1)  # [t, Hq, Dh]


@torch.inference_mode()
def greedy_generate(model, prompt_ids: Sequence[int], max_new_tokens: int,
                    eos_token_ids: Sequence[int] = ()) -> list[int]:
    """Argmax decoding; returns the new token ids (stopping after an eos id, which is included)."""
    device = model.cos_sin.device
    attn = DenseCachedAttention()
    step_ids, start = list(prompt_ids), 0
    new: list[int] = []
    for _ in range(max_new_tokens):
        input_ids = torch.tensor(step_ids, dtype=torch.int64, device=device)
        positions = torch.arange(start, start + len(step_ids), device=device)
        hidden = model(input_ids, positions, attn)  # [t, D]
        token = int(model.compute_logits(hidden[-1:]).argmax(-1))
        new.append(token)
        if token in eos_token_ids:
            break
        start, step_ids = start + len(step_ids), [token]
    return new
