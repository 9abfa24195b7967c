"""The model runner: executes one StepPlan and returns a StepResult.

The runner's input and output are defined here so that the scheduler and the GPU stage
both import them from gpu/ (no import cycle). Synchronous; no trio, no globals.
"""
from __future__ import annotations

import time
from itertools import accumulate, chain

import attrs
import numpy as np
import torch

from gpu.attention import AttentionMetadata, KVCache, TorchPagedAttention
from gpu.grammar import Guide, accept, mask_logits
from gpu.sampler import (SamplingOptions, SeqSamplingState, apply_logit_controls, sample,
                         sample_on_device, token_logprobs)


@attrs.frozen
class SeqStart:
    """Registers a sequence's sampling state with the runner (sent once, on first schedule)."""
    seq_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingOptions
    grammar: object = attrs.field(default=None, eq=False)   # xgrammar CompiledGrammar, if constrained
    think: tuple[int, int] | None = None   # reasoning's (open, close) ids: constrain after it
    thinking: bool = False                 # the prompt leaves the reasoning open


@attrs.frozen
class SeqChunk:
    """Tokens of one sequence to compute this step."""
    seq_id: str
    token_ids: tuple[int, ...]
    start_pos: int                    # tokens of this sequence already in the KV cache
    block_table: tuple[int, ...]      # covers start_pos + len(token_ids) tokens
    sample: bool                      # sample after this chunk (decode, or a prefill's last chunk)


@attrs.frozen
class StepPlan:
    step: int
    chunks: tuple[SeqChunk, ...]
    new_seqs: tuple[SeqStart, ...] = ()
    released: tuple[str, ...] = ()     # sequences finished or aborted: drop their state


@attrs.frozen
class TokenLogprobs:
    """The sampled token's log-probability and the top-k alternatives (raw model output)."""
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@attrs.frozen
class StepResult:
    step: int
    seq_ids: tuple[str, ...]           # the chunks that sampled, in plan order
    token_ids: tuple[int, ...]
    duration_s: float
    error: str | None = None           # the step failed: every sequence in the plan is lost
    logprobs: tuple[TokenLogprobs | None, ...] = ()   # per sampled sequence, when any asked


class ModelRunner:
    def __init__(self, model, cache: KVCache, *, device: torch.device, seed: int = 0,
                 use_triton: bool = False, cuda_graph_max_bs: int = 0, max_model_len: int = 0) -> None:
        self.model = model
        self.cache = cache
        self.device = device
        self.use_triton = use_triton
        cfg = model.config
        scale = cfg.head_dim ** -0.5
        if use_triton:
            from gpu.attention import TritonPagedAttention
            self.attn = TritonPagedAttention(cache, scale)
        else:
            self.attn = TorchPagedAttention(cache, scale)
        self.states: dict[str, SeqSamplingState] = {}
        self._seed_rng = torch.Generator().manual_seed(seed)
        self.graphs = None
        if use_triton and cuda_graph_max_bs > 0:
            from gpu.cuda_graphs import DecodeGraphs
            graphs = DecodeGraphs(model, self.attn, max_bs=cuda_graph_max_bs,
                                  max_blocks=-(-max_model_len // cache.block_size), device=device)
            try:
                graphs.capture()
                self.graphs = graphs
            except Exception as exc:  # a capture failure costs speed, not correctness
                import logging
                logging.getLogger("tailrace.gpu").warning("CUDA graph capture failed, running eager: %s", exc)

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        for sid in plan.released:
            self.states.pop(sid, None)
        for ns in plan.new_seqs:
            fallback = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
            st = self.states[ns.seq_id] = SeqSamplingState(ns.sampling, ns.prompt_token_ids, fallback)
            if ns.grammar is not None:
                st.guide = Guide(ns.grammar, ns.think, ns.thinking)
        if not plan.chunks:
            return StepResult(plan.step, (), (), time.perf_counter() - t0)
        input_ids, positions, meta, sample_rows = self._prepare(plan.chunks)
        with torch.inference_mode():
            if (self.graphs is not None and not meta.prefill_rows
                    and self.graphs.fits(len(plan.chunks), meta.block_tables.shape[1])):
                hidden = self.graphs.run(input_ids, positions, meta)      # [T, D]
            else:
                self.attn.prepare(meta)
                hidden = self.model(input_ids, positions, self.attn)      # [T, D]
            seq_ids = tuple(c.seq_id for c in plan.chunks if c.sample)
            if not seq_ids:
                return StepResult(plan.step, (), (), time.perf_counter() - t0)
            idx = torch.tensor(sample_rows, device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, idx))  # [B, V]
            states = [self.states[s] for s in seq_ids]
            want = [i for i, st in enumerate(states) if st.opts.logprobs is not None]
            raw = torch.log_softmax(logits[want].float(), dim=-1) if want else None  # before sampling edits
            logits = apply_logit_controls(logits, states)   # logit_bias, allowed ids, bad words
            matchers = [st.guide for st in states]
            constrained = any(m is not None for m in matchers)
            if self.use_triton:
                if constrained:
                    logits = logits.float()
                    mask_logits(logits, matchers)
                tokens = sample_on_device(logits, states)
            else:
                host = logits.float().cpu()
                if constrained:
                    mask_logits(host, matchers)
                tokens = sample(host, states)
            if constrained:
                accept(matchers, tokens)
            logprobs: tuple[TokenLogprobs | None, ...] = ()
            if want:
                per_row = dict(zip(want, token_logprobs(raw, [tokens[i] for i in want],
                                                        [states[i].opts.logprobs for i in want])))
                logprobs = tuple(TokenLogprobs(*per_row[i]) if i in per_row else None
                                 for i in range(len(states)))
        for st, tok in zip(states, tokens):
            st.output_ids.append(tok)
        return StepResult(plan.step, seq_ids, tuple(tokens), time.perf_counter() - t0, logprobs=logprobs)

    def _prepare(self, chunks: tuple[SeqChunk, ...]):
        return prepare_step(chunks, self.block_size, self.device)


def prepare_step(chunks: tuple[SeqChunk, ...], bs: int, dev: torch.device):
    """The step's flat inputs and attention metadata, vectorised with numpy (this runs
    on the host every step, for every sequence): (input_ids, positions, meta, sample_rows)."""
    n = len(chunks)
    q_lens = [len(c.token_ids) for c in chunks]
    starts = [c.start_pos for c in chunks]
    q_starts = list(accumulate(q_lens, initial=0))
    ctx_lens = [s + q for s, q in zip(starts, q_lens)]
    tables = np.zeros((n, max(len(c.block_table) for c in chunks)), dtype=np.int32)
    for i, c in enumerate(chunks):
        tables[i, :len(c.block_table)] = c.block_table
    q_lens_np = np.asarray(q_lens)
    row = np.repeat(np.arange(n), q_lens_np)                                # [T]
    pos = np.repeat(np.asarray(starts) - np.asarray(q_starts[:-1]), q_lens_np) + np.arange(q_starts[-1])
    slots = tables[row, pos // bs].astype(np.int64) * bs + pos % bs
    sample_rows = [q_starts[i + 1] - 1 for i, c in enumerate(chunks) if c.sample]
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(dev),
        block_tables=torch.from_numpy(tables).to(dev),
        cu_seqlens_q=torch.tensor(q_starts, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=dev),
        q_starts=q_starts, q_lens=q_lens, ctx_lens=ctx_lens, start_positions=starts,
        decode_rows=[i for i, q in enumerate(q_lens) if q == 1],
        prefill_rows=[i for i, q in enumerate(q_lens) if q > 1],
        max_seqlen_q=max(q_lens),
    )
    input_ids = torch.tensor(list(chain.from_iterable(c.token_ids for c in chunks)),
                             dtype=torch.int64, device=dev)
    positions = torch.from_numpy(pos.astype(np.int64)).to(dev)
    return input_ids, positions, meta, sample_rows
