"""Token sampling on the host path (CPU): penalties, temperature, top-k/top-p/min-p.

Each sequence owns a torch.Generator seeded from its request seed (or from the engine's
seed sequence), so a seeded request samples the same tokens whatever else is in the
batch. Greedy rows never touch a generator.
"""
from __future__ import annotations

import attrs
import torch


@attrs.frozen
class SamplingOptions:
    temperature: float = 1.0        # 0: greedy
    top_p: float = 1.0
    top_k: int = 0                  # <= 0: off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_tokens: int = 0               # stop_token_ids are masked until this many outputs
    stop_token_ids: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5

    @property
    def penalised(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)


class SeqSamplingState:
    """Per-sequence sampling state: its generator and the token history penalties need."""

    def __init__(self, opts: SamplingOptions, prompt_ids: tuple[int, ...], fallback_seed: int) -> None:
        self.opts = opts
        self.prompt_ids = prompt_ids
        self.output_ids: list[int] = []
        self.generator: torch.Generator | None = None
        if not opts.greedy:
            self.generator = torch.Generator().manual_seed(
                opts.seed if opts.seed is not None else fallback_seed)


def apply_penalties(logits: torch.Tensor, state: SeqSamplingState) -> torch.Tensor:
    """HF-style repetition penalty over prompt+output; OpenAI frequency/presence over output."""
    o = state.opts
    vocab = logits.shape[-1]
    if o.repetition_penalty != 1.0:
        seen = torch.tensor(list(state.prompt_ids) + state.output_ids, dtype=torch.int64)
        seen = seen[seen < vocab].unique()
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / o.repetition_penalty, vals * o.repetition_penalty)
    if state.output_ids and (o.frequency_penalty or o.presence_penalty):
        out = torch.tensor(state.output_ids, dtype=torch.int64)
        counts = torch.bincount(out[out < vocab], minlength=vocab).to(logits.dtype)
        logits -= o.frequency_penalty * counts + o.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, o: SamplingOptions) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks (masked entries become -inf)."""
    logits = logits / o.temperature
    vocab = logits.shape[-1]
    if 0 < o.top_k < vocab:
        kth = torch.topk(logits, o.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if o.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < o.min_p * probs.max(), float("-inf"))
    if o.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p (always keep the first token)
        drop = (cum - torch.softmax(sorted_logits, dim=-1)) >= o.top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, states: list[SeqSamplingState]) -> list[int]:
    """logits: [B, V] float32 -> one token per row."""
    for i, st in enumerate(states):
        o = st.opts
        if o.stop_token_ids and len(st.output_ids) < o.min_tokens:
            logits[i, list(o.stop_token_ids)] = float("-inf")
    out = logits.argmax(dim=-1).tolist()
    for i, st in enumerate(states):
        o = st.opts
        if o.penalised:
            row = apply_penalties(logits[i].clone(), st)
            if o.greedy:
                out[i] = int(row.argmax())
        else:
            row = logits[i]
        if not o.greedy:
            probs = torch.softmax(filter_logits(row, o), dim=-1)
            out[i] = int(torch.multinomial(probs, 1, generator=st.generator))
    return out
