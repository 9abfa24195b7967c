"""Speculative decoding with a draft model (`"method": "draft_model"`): the runner's half.

The scheduler plans a decode with drafts as the last token followed by DRAFT placeholders
(stages/schedule/drafter.py ModelDrafter). Before the verify forward, `DraftModel.fill`
runs the draft model over the step, K forwards, and writes the drafts into the step's
inputs; the target then verifies them exactly as it verifies n-gram drafts
(gpu/worker/runner.py), so a draft only ever changes how many tokens a step yields, never which.

- **Its own paged KV pool**: a KVCache with as many blocks as the target's, addressed by
  the target's block tables (the block manager allocates for both; KV sizing counts both,
  pipeline/core/startup.py).
- **Prefill in the draft when it drafts**: prompt chunks and decodes without drafts run in
  the target only. A sequence's first drafting step computes its prompt in the draft, in
  forwards of at most the step budget, with the decodes so far (and later ones, the
  decodes it missed since it last drafted): so a draft costs only where the cost gate
  (stages/schedule/spec.py) lets a sequence draft, which takes a catch-up's cost into account.
- **Which blocks hold draft KV**: `valid[block]` counts the leading slots of a KV block
  whose draft KV is that of the tokens the target's KV there holds (the target's writes
  cut it, the draft's extend it, a remote KV read zeroes it). A sequence handed blocks by
  the prefix cache starts drafting from the first slot they lack, so blocks a sequence
  filled without ever drafting are computed in the draft when one drafts, never read stale.
- **Rollback**: `done[seq]` is where the draft's KV stops being that of the sequence's
  tokens (at a prompt chunk: where its blocks' `valid` prefix ends). After a verify it is
  cut back to the accepted run; the next draft forward starts from there (one more token
  when every draft held: the last draft's position was never written), and catches up the
  prompt and the decodes that ran without drafts (steps the cost gate left off). Stale
  draft KV could only lower the acceptance: the target decides every token.
- **CUDA graphs** (`capture`, with the target's): the draft's decode forwards (a draft
  each) replay its own decode graphs, and the forward that catches a sequence up to the
  verify before (the accepted run's last token, or the last draft and the bonus token)
  replays its own verify graphs, over its KV cache; a longer catch-up (a prompt, decodes
  the gate left off) runs eagerly. `replays` counts the forwards a graph ran.
- **Sampling**: each draft is sampled as the target would sample that position (its
  penalties, logit controls, and the (seed, output index) draw: gpu/worker/sampler.py), from the
  draft's logits. A draft that is the target itself therefore proposes exactly what the
  target samples, greedy or seeded, and every draft holds.
"""
from __future__ import annotations

import attrs
import numpy as np
import torch

from gpu.layers.attention import KVCache, TorchPagedAttention
from gpu.worker.cuda_graphs import capture_graphs, run_graphed
from gpu.interface import SeqChunk, StepPlan
from gpu.worker.sampler import DraftRow, SeqSamplingState, apply_logit_controls, sample
from gpu.worker.staging import BlockTables, HostInputs, prepare_step


class DraftError(ValueError):
    """A draft model that cannot draft for this target (start-up refuses it)."""


def check_draft(target_config, draft_config, draft_path: str) -> None:
    """The draft must share the target's vocabulary (its token ids mean the same)."""
    if draft_config.vocab_size != target_config.vocab_size:
        raise DraftError(
            f"--speculative-config: the draft model {draft_path} has a vocabulary of "
            f"{draft_config.vocab_size} tokens, the target {target_config.vocab_size}: a draft "
            "model must share the target's vocabulary")


def tokens_of(st: SeqSamplingState, a: int, b: int) -> list[int]:
    """The sequence's tokens at positions [a, b): the prompt, then the outputs."""
    p = st.prompt_ids
    n = len(p)
    out = list(p[a:min(b, n)]) if a < n else []
    if b > n:
        out.extend(st.output_ids[max(a - n, 0):b - n])
    return out


class DraftModel:
    """The draft model, its KV cache, and where each sequence's draft KV stops."""

    reads_hidden = False             # it drafts from tokens: no target hidden states (EAGLE's do)
    aux_layers: tuple[int, ...] = ()

    def __init__(self, model, cache: KVCache, device: torch.device, use_triton: bool = False,
                 cost: float | None = None, chunk: int = 2048) -> None:
        self.model = model
        self.cost = cost                   # its multiply-adds a token over the target's
        self.chunk = chunk                 # the most tokens a catch-up forward takes (the step budget)
        self.cache = cache
        self.device = device
        self.use_triton = use_triton
        scale = model.config.head_dim ** -0.5
        if use_triton:
            from gpu.layers.attention import TritonPagedAttention
            self.attn = TritonPagedAttention(cache, scale)
        else:
            self.attn = TorchPagedAttention(cache, scale)
        self.tables = BlockTables()
        self.done: dict[str, int] = {}     # seq id -> positions [0, done) hold its draft KV
        # block -> its leading slots whose draft KV is that of the target's tokens there
        self.valid = np.zeros(cache.num_blocks, dtype=np.int64)
        self.forwards = 0                  # draft forwards run (a figure for the tests)
        self.replays = 0                   # ... of them, graph replays
        self.graphs = self.verify_graphs = None    # its CUDA graphs (`capture`)

    def capture(self, *, max_bs: int, max_model_len: int, verify_tokens: int) -> None:
        """CUDA graphs for the draft's forwards, as the runner captures the target's (the
        same batch sizes): decode graphs for its draft-a-token forwards, verify graphs of
        `verify_tokens` tokens a sequence for the forward that catches a sequence up to the
        verify before (1 or 2 tokens a sequence, so K + 1 is room enough)."""
        self.graphs, self.verify_graphs = capture_graphs(
            self.model, self.attn, max_bs=max_bs, max_model_len=max_model_len, device=self.device,
            verify_tokens=verify_tokens, label="the draft model's ")

    def release(self, seq_id: str) -> None:
        self.done.pop(seq_id, None)
        self.tables.release(seq_id)

    def _forward(self, chunks: list[SeqChunk]) -> torch.Tensor | None:
        """The draft's logits at the sampled rows of `chunks` ([R, V]), its KV written."""
        input_ids, positions, meta, sample_idx = prepare_step(
            tuple(chunks), self.cache.block_size, self.device, block_tables=self.tables)
        hidden = run_graphed(self.graphs, self.verify_graphs, input_ids, positions, meta)
        if hidden is None:
            self.attn.prepare(meta)
            fused = self.model.fused_decode     # a packed GGUF draft's C decode stack
            if fused is None or (hidden := fused(input_ids, positions, self.attn)) is None:
                hidden = self.model(input_ids, positions, self.attn)
        else:
            self.replays += 1
        self.forwards += 1
        if not any(c.sample for c in chunks):
            return None
        return self.model.compute_logits(hidden.index_select(0, sample_idx))

    def _catch_up(self, first: list[SeqChunk]) -> torch.Tensor | None:
        """`_forward(first)`, in forwards of at most `chunk` tokens where the chunks hold more
        (a prompt the draft never saw, caught up at its sequence's first drafting step): each
        chunk cut into pieces of `chunk` tokens, round r running every chunk's r-th piece, so
        that a piece's KV is written before the next one reads it and no forward is larger
        than the target's own prefill steps. The logits of each chunk's last token, in order."""
        size = self.chunk
        if sum(len(c.token_ids) for c in first) <= size:
            return self._forward(first)
        pieces = [[SeqChunk(c.seq_id, c.token_ids[a:a + size], c.start_pos + a, c.block_table,
                            a + size >= len(c.token_ids)) for a in range(0, len(c.token_ids), size)]
                  for c in first]
        out: list[torch.Tensor | None] = [None] * len(first)

        def run(batch: list[tuple[int, SeqChunk]]) -> None:
            logits = self._forward([p for _, p in batch])
            for row, i in enumerate(i for i, p in batch if p.sample):
                out[i] = logits[row]

        for r in range(max(map(len, pieces))):
            batch: list[tuple[int, SeqChunk]] = []
            tokens = 0
            for i, ps in enumerate(pieces):
                if r < len(ps):
                    if batch and tokens + len(ps[r].token_ids) > size:
                        run(batch)
                        batch, tokens = [], 0
                    batch.append((i, ps[r]))
                    tokens += len(ps[r].token_ids)
            run(batch)
        return torch.stack(out)

    def _sample(self, logits: torch.Tensor, rows: list) -> list[int]:
        logits = apply_logit_controls(logits, rows)
        return sample(logits.float().cpu(), rows)

    def overwritten(self, blocks) -> None:
        """Blocks whose target KV came from elsewhere (a remote prefill's read)."""
        self.valid[np.asarray(blocks, dtype=np.int64)] = 0

    def _valid_upto(self, table: tuple[int, ...], end: int) -> int:
        """Where the draft KV of positions [0, end) of a sequence with this block table
        first fails to be that of its tokens (end when none does)."""
        bs = self.cache.block_size
        n = -(-end // bs)
        if n == 0:
            return 0
        v = self.valid[np.asarray(table[:n], dtype=np.int64)]
        short = np.flatnonzero(v < bs)
        if not len(short):
            return end
        i = int(short[0])
        return min(end, i * bs + int(v[i]))

    def _wrote(self, table: tuple[int, ...], a: int, b: int, draft: bool) -> None:
        """The target's (draft False: the draft KV there is no longer its tokens') or the
        draft's KV of positions [a, b) was written."""
        bs = self.cache.block_size
        v = self.valid
        for i in range(a // bs, (b - 1) // bs + 1):
            blk, lo, hi = table[i], max(a - i * bs, 0), min(b - i * bs, bs)
            if not draft:
                v[blk] = min(v[blk], lo)
            elif lo <= v[blk] < hi:
                v[blk] = hi

    def fill(self, plan: StepPlan, host: HostInputs | None,
             states: dict[str, SeqSamplingState]) -> StepPlan:
        """Draft the plan's DRAFT placeholders, each sequence's draft KV first caught up to
        its tokens: the plan with its drafts written, and the same tokens in `host`'s input
        ids. Prompt chunks and decodes without drafts run in the target only."""
        first: list[SeqChunk] = []
        verify: list[int] = []          # indexes of the chunks that carry drafts
        for i, c in enumerate(plan.chunks):
            sid, n = c.seq_id, len(c.token_ids)
            done = self.done.get(sid)
            if done is None or (n > 1 and not c.num_drafts):   # a prompt chunk: the draft
                done = self._valid_upto(c.block_table, c.start_pos)  # KV its blocks hold
            begin = self.done[sid] = min(done, c.start_pos)
            self._wrote(c.block_table, c.start_pos, c.start_pos + n, False)   # the target's
            if c.num_drafts:    # from where its draft KV stops: the prompt too, the first time
                toks = tokens_of(states[sid], begin, c.start_pos) + [c.token_ids[0]]
                first.append(SeqChunk(sid, tuple(toks), begin, c.block_table, True))
                verify.append(i)
        if not verify:
            return plan
        with torch.inference_mode():
            logits = self._catch_up(first)
            chunks = [plan.chunks[i] for i in verify]
            drafted: list[list[int]] = [[] for _ in chunks]
            live = list(range(len(chunks)))     # those still drafting
            while True:
                rows = [DraftRow(states[chunks[j].seq_id], tuple(drafted[j])) for j in live]
                for j, tok in zip(live, self._sample(logits, rows)):
                    drafted[j].append(tok)
                live = [j for j in live if len(drafted[j]) < chunks[j].num_drafts]
                if not live:
                    break
                step = [SeqChunk(chunks[j].seq_id, (drafted[j][-1],),
                                 chunks[j].start_pos + len(drafted[j]), chunks[j].block_table, True)
                        for j in live]
                logits = self._forward(step)
        new = list(plan.chunks)
        for i, c, d, f in zip(verify, chunks, drafted, (f for f in first if f.sample)):
            # written: positions up to the last draft's (exclusive); verified() cuts it back
            self.done[c.seq_id] = c.start_pos + c.num_drafts
            self._wrote(c.block_table, f.start_pos, self.done[c.seq_id], True)
            new[i] = attrs.evolve(c, token_ids=(c.token_ids[0], *d))
            if host is not None:
                at = host.q_starts[i] + 1
                host.ids[at:at + len(d)] = np.asarray(d, dtype=np.int64)
        return attrs.evolve(plan, chunks=tuple(new))

    def verified(self, seq_id: str, start_pos: int, emitted: int) -> None:
        """A verify at `start_pos` kept `emitted` tokens (accepted drafts + 1): the draft's
        KV holds the sequence's tokens up to the last accepted draft's position."""
        done = self.done.get(seq_id)
        if done is not None:
            self.done[seq_id] = min(done, start_pos + emitted)
