"""The model runner: executes one StepPlan and returns a StepResult.

The runner's input and output are defined here so that the scheduler and the GPU stage
both import them from gpu/ (no import cycle). Synchronous; no trio, no globals.

Interface (issue 14): ``execute(plan) -> StepResult`` is unchanged. Added:
``warm_up(max_num_batched_tokens, max_num_seqs)`` (the engine calls it on CUDA before
serving), the start-up facts ``cuda_graphs``, ``cuda_graph_sizes``,
``cuda_graph_capture_s``, ``warmup_s``, and ``profile_step_bytes`` / ``kv_budget_bytes``
for KV sizing. ``prepare_step(chunks, block_size, device, staging=None)`` now returns the
rows to sample as a device tensor (``sample_idx``) rather than a list; on CUDA the
runner passes its pinned ``Staging`` buffers.

Staging ahead (issue 11): ``stage(plan) -> HostInputs`` does the host half of input
preparation (`stage_inputs`: positions, slots, block tables, in numpy) as soon as a plan
arrives, while the step before it still runs; ``execute(plan, staged)`` is left with
filling in the PLACEHOLDERs (one gather from the previous step's tokens, `StagedTokens`)
and the upload. ``execute(plan)`` alone stages as well.

Prompt logprobs (issue 8): ``SeqStart.prompt_logprobs`` asks for them (top k);
``StepResult.prompt_logprobs`` carries each prompt position's once (``PromptLogprobs``).
"""
from __future__ import annotations

import logging
import time
from itertools import accumulate, chain

import attrs
import numpy as np
import torch

from gpu.attention import AttentionMetadata, KVCache, TorchPagedAttention
from gpu.grammar import Guide, accept, mask_logits
from gpu.sampler import (DeviceSampler, SamplingOptions, SeqSamplingState, apply_logit_controls,
                         sample, token_logprobs)

_log = logging.getLogger("tailrace.gpu")


# A token the scheduler does not know yet when it plans a step (async scheduling: step
# N+1 is planned while step N runs): the sequence's last sampled token, which the runner
# has and fills in. Only ever a chunk's last token.
PLACEHOLDER = -1


@attrs.frozen
class SeqStart:
    """Registers a sequence's sampling state with the runner (sent once, on first schedule)."""
    seq_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingOptions
    grammar: object = attrs.field(default=None, eq=False)   # xgrammar CompiledGrammar, if constrained
    think: tuple[int, int] | None = None   # reasoning's (open, close) ids: constrain after it
    thinking: bool = False                 # the prompt leaves the reasoning open
    prompt_logprobs: int | None = None     # the prompt tokens' logprobs (top k); None: off


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
    # hybrid KV cache: (block, sliding slot or -1) changes, applied before the step (KVCache.remap)
    kv_updates: tuple[tuple[int, int], ...] = ()


@attrs.frozen
class TokenLogprobs:
    """The sampled token's log-probability and the top-k alternatives (raw model output)."""
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    rank: int = 0                      # prompt logprobs: the token's rank in the vocabulary (from 1)


@attrs.frozen
class PromptLogprobs:
    """A prefill chunk's prompt logprobs for one sequence: the logprob of each prompt token
    it covered given the tokens before it (positions from 1 on, in order, each once)."""
    seq_id: str
    entries: tuple[TokenLogprobs, ...]


@attrs.frozen
class StepResult:
    step: int
    seq_ids: tuple[str, ...]           # the chunks that sampled, in plan order
    token_ids: tuple[int, ...]
    duration_s: float
    error: str | None = None           # the step failed: every sequence in the plan is lost
    logprobs: tuple[TokenLogprobs | None, ...] = ()   # per sampled sequence, when any asked
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()  # for the sequences that asked


class ModelRunner:
    def __init__(self, model, cache: KVCache, *, device: torch.device, seed: int = 0,
                 use_triton: bool = False, cuda_graph_max_bs: int = 0, max_model_len: int = 0) -> None:
        self.model = model
        self.cache = cache
        self.device = device = torch.device(device)
        self.use_triton = use_triton
        cfg = model.config
        scale = cfg.head_dim ** -0.5
        if use_triton:
            from gpu.attention import TritonPagedAttention
            self.attn = TritonPagedAttention(cache, scale)
        else:
            self.attn = TorchPagedAttention(cache, scale)
        self.states: dict[str, SeqSamplingState] = {}
        # prompt_logprobs: seq id -> [top k, the next prompt position still owed]
        self.prompt_lp: dict[str, list[int]] = {}
        self.block_tables = BlockTables()
        self.staged_tokens = StagedTokens()
        self._seed_rng = torch.Generator().manual_seed(seed)
        self.staging = Staging(device) if device.type == "cuda" else None
        self.device_sampler = DeviceSampler(device) if use_triton else None
        # What happened before the first request (bench throughput reports these).
        self.cuda_graphs = False
        self.cuda_graph_sizes: list[int] = []
        self.cuda_graph_capture_s = 0.0
        self.cuda_graph_error: str | None = None
        self.warmup_s = 0.0
        self.graphs = None
        if use_triton and cuda_graph_max_bs > 0:
            from gpu.cuda_graphs import DecodeGraphs
            t0 = time.perf_counter()
            graphs = DecodeGraphs(model, self.attn, max_bs=cuda_graph_max_bs,
                                  max_blocks=-(-max_model_len // cache.block_size), device=device,
                                  max_context=max_model_len)
            try:
                graphs.capture()
                self.graphs = graphs
                self.cuda_graphs, self.cuda_graph_sizes = True, list(graphs.sizes)
            except Exception as exc:  # a capture failure costs speed, not correctness
                _log.warning("CUDA graph capture failed, running eager: %s", exc, exc_info=exc)
                self.cuda_graph_error = f"{type(exc).__name__}: {exc}"[:500]   # bench reports it
            self.cuda_graph_capture_s = round(time.perf_counter() - t0, 3)

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    def stage(self, plan: StepPlan) -> HostInputs | None:
        """The plan's host-side input preparation, which needs nothing from the steps
        before it: the GPU stage calls it as a plan arrives, while the step before still
        runs, and hands the result to `execute`. Plans are staged in order, one at a time."""
        return stage_plan(plan, self.block_size, self.block_tables, self.staged_tokens)

    def execute(self, plan: StepPlan, staged: HostInputs | None = None) -> StepResult:
        """Run one step; `staged` is `stage(plan)`'s result when the caller staged it
        ahead (otherwise it is staged here)."""
        t0 = time.perf_counter()
        if staged is None:
            staged = self.stage(plan)
        if plan.kv_updates:
            self.cache.remap(plan.kv_updates)
        for sid in plan.released:
            self.states.pop(sid, None)
            self.prompt_lp.pop(sid, None)
        for ns in plan.new_seqs:
            fallback = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
            st = self.states[ns.seq_id] = SeqSamplingState(ns.sampling, ns.prompt_token_ids, fallback)
            if ns.grammar is not None:
                st.guide = Guide(ns.grammar, ns.think, ns.thinking)
            if ns.prompt_logprobs is not None:
                self.prompt_lp[ns.seq_id] = [ns.prompt_logprobs, 1]
        if not plan.chunks:
            return StepResult(plan.step, (), (), time.perf_counter() - t0)
        input_ids, positions, meta, sample_idx = upload_inputs(
            staged, self.device, self.staging, self.last_token, self.staged_tokens.previous(staged))
        with torch.inference_mode():
            if (self.graphs is not None and not meta.prefill_rows
                    and self.graphs.fits(len(plan.chunks), meta.block_tables.shape[1])):
                hidden = self.graphs.run(input_ids, positions, meta)      # [T, D]
            else:
                self.attn.prepare(meta)
                hidden = self.model(input_ids, positions, self.attn)      # [T, D]
            prompt_lps = self._prompt_logprobs(plan.chunks, hidden) if self.prompt_lp else ()
            seq_ids = tuple(c.seq_id for c in plan.chunks if c.sample)
            if not seq_ids:
                return StepResult(plan.step, (), (), time.perf_counter() - t0,
                                  prompt_logprobs=prompt_lps)
            logits = self.model.compute_logits(hidden.index_select(0, sample_idx))  # [B, V]
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
                tokens = self.device_sampler.sample(logits, seq_ids, states)
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
        self.staged_tokens.executed(plan.step, tokens)
        return StepResult(plan.step, seq_ids, tuple(tokens), time.perf_counter() - t0,
                          logprobs=logprobs, prompt_logprobs=prompt_lps)

    def _prompt_logprobs(self, chunks: tuple[SeqChunk, ...], hidden: torch.Tensor
                         ) -> tuple[PromptLogprobs, ...]:
        """The prompt logprobs the step's chunks owe: row p of a chunk (position p) gives
        the logprob of prompt token p + 1. A position is reported once, even when a
        preempted sequence computes its prompt again."""
        out = []
        row0 = 0
        for c in chunks:
            want = self.prompt_lp.get(c.seq_id)
            if want is not None:
                k, owed = want
                prompt = self.states[c.seq_id].prompt_ids
                first = max(c.start_pos, owed - 1)
                end = min(c.start_pos + len(c.token_ids), len(prompt) - 1)
                if end > first:
                    rows = hidden[row0 + first - c.start_pos:row0 + end - c.start_pos]
                    entries = prompt_token_logprobs(self.model, rows, prompt[first + 1:end + 1], k)
                    out.append(PromptLogprobs(c.seq_id, entries))
                    want[1] = end + 1
            row0 += len(c.token_ids)
        return tuple(out)

    def last_token(self, seq_id: str) -> int:
        return last_token(self.states, seq_id)

    def warm_up(self, max_num_batched_tokens: int, max_num_seqs: int) -> float:
        """Compile before the first request: one prefill step, one mixed step (a prefill
        chunk beside decodes) and the eager decode sizes past the captured ones, on
        blocks no request holds yet (call it before serving). The captured decode sizes
        were compiled when the graphs were captured. Returns (and keeps in warmup_s) the
        seconds it took."""
        t0 = time.perf_counter()
        bs = self.block_size
        nblocks = self.cache.num_blocks
        greedy = SamplingOptions(temperature=0.0)
        prompt = max(3, min(max_num_batched_tokens // 2, 256, (nblocks // 2) * bs))
        table = tuple(range(min(nblocks, -(-(prompt + 1) // bs))))
        warm = "__warmup__"
        steps = [StepPlan(-1, (SeqChunk(warm, (0,) * prompt, 0, table, True),),
                          (SeqStart(warm, (0,) * prompt, greedy),)),
                 StepPlan(-2, (SeqChunk(warm, (0,), prompt, table, True),
                               SeqChunk(warm + "b", (0,) * 3, 0, table[:-(-3 // bs)], True)),
                          (SeqStart(warm + "b", (0,) * 3, greedy),))]
        # decode batches larger than the largest graph run eagerly: compile that path too
        largest = self.graphs.max_bs if self.graphs is not None else 0
        if max_num_seqs > largest:
            n = min(max_num_seqs, largest + 1)
            steps.append(StepPlan(-3, tuple(SeqChunk(f"{warm}{i}", (0,), 1, table[:1], True)
                                            for i in range(n)),
                                  tuple(SeqStart(f"{warm}{i}", (0,), greedy) for i in range(n))))
        for plan in steps:
            self.execute(plan)
        self.execute(StepPlan(-4, (), released=tuple(self.states)))   # forget the warm-up
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.warmup_s = round(time.perf_counter() - t0, 3)
        return self.warmup_s


class Staging:
    """Pinned host buffers for a step's inputs (CUDA only).

    numpy writes every per-step array into one pinned int64 and one pinned int32 buffer,
    and two ``non_blocking`` copies move them to the device: no blocking copy from
    pageable memory. The device buffers are reused step after step (copies and kernels are
    ordered on the one stream); before the host overwrites a pinned buffer it waits for
    the previous step's copy out of it (an event, normally long done).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host: dict[torch.dtype, torch.Tensor] = {}
        self._dev: dict[torch.dtype, torch.Tensor] = {}
        self._copied = None    # torch.cuda.Event after the last copies

    def _buffers(self, dtype: torch.dtype, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        host = self._host.get(dtype)
        if host is None or host.numel() < n:
            size = max(1024, 1 << (n - 1).bit_length())
            host = torch.empty(size, dtype=dtype)
            # pinned on CUDA; a CPU Staging (the --variants check) packs the same way
            self._host[dtype] = host.pin_memory() if self.device.type == "cuda" else host
            self._dev[dtype] = torch.empty(size, dtype=dtype, device=self.device)
        return self._host[dtype], self._dev[dtype]

    def upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Device copies of the arrays (int64 or int32), in two non-blocking copies."""
        if self._copied is not None:
            self._copied.synchronize()
        out: list[torch.Tensor | None] = [None] * len(arrays)
        for dtype, np_dtype in ((torch.int64, np.int64), (torch.int32, np.int32)):
            mine = [i for i, a in enumerate(arrays) if a.dtype == np_dtype]
            if not mine:
                continue
            offsets, total = staged_offsets([arrays[i].size for i in mine], arrays[mine[0]].itemsize)
            host, dev = self._buffers(dtype, total)
            view = host.numpy()
            for i, at in zip(mine, offsets):
                a = arrays[i]
                view[at:at + a.size] = a.reshape(-1)
                out[i] = dev[at:at + a.size].view(a.shape)
            dev[:total].copy_(host[:total], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        return out


STAGING_ALIGN = 16   # bytes: Triton specialises a pointer argument on 16-byte alignment


def staged_offsets(sizes: list[int], itemsize: int, align: int = STAGING_ALIGN) -> tuple[list[int], int]:
    """Element offsets of arrays packed back to back in one buffer, each rounded up to
    `align` bytes, and the elements the buffer needs. Unpadded, an array's alignment would
    depend on the sizes of the arrays before it, which change every step, and each new
    alignment would be a new Triton variant compiled in the middle of a run."""
    step = max(1, align // itemsize)
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += -(-n // step) * step
    return offsets, at


_PROMPT_LOGPROB_ROWS = 256   # rows of [rows, vocab] logits at a time


def prompt_token_logprobs(model, hidden: torch.Tensor, targets: tuple[int, ...], k: int
                          ) -> tuple[TokenLogprobs, ...]:
    """hidden [R, D] at positions p..p+R-1 and the prompt tokens that follow each: their
    raw log-softmax logprob, rank (1 + the tokens more likely) and the top k."""
    out = []
    for s in range(0, len(targets), _PROMPT_LOGPROB_ROWS):
        lp = torch.log_softmax(model.compute_logits(hidden[s:s + _PROMPT_LOGPROB_ROWS]).float(),
                               dim=-1)                                          # [r, V]
        t = torch.tensor(targets[s:s + _PROMPT_LOGPROB_ROWS], device=lp.device)[:, None]
        picked = lp.gather(1, t)                                               # [r, 1]
        ranks = ((lp > picked).sum(dim=-1) + 1).tolist()
        picked = picked[:, 0].tolist()
        if k:
            top_v, top_i = lp.topk(k, dim=-1)
            top_v, top_i = top_v.tolist(), top_i.tolist()
        for r in range(len(picked)):
            out.append(TokenLogprobs(picked[r], tuple(top_i[r]) if k else (),
                                     tuple(top_v[r]) if k else (), ranks[r]))
    return tuple(out)


class BlockTables:
    """The block tables kept from step to step (a persistent batch): a row per sequence,
    rewritten only when the sequence's table changed (a new block every block_size
    tokens, a preemption), so a step costs a gather instead of copying every table."""

    def __init__(self) -> None:
        self.rows = np.zeros((16, 16), dtype=np.int32)
        self.row_of: dict[str, int] = {}
        self.table_of: dict[str, tuple[int, ...]] = {}
        self.free_rows: list[int] = []

    def release(self, seq_id: str) -> None:
        row = self.row_of.pop(seq_id, None)
        if row is not None:
            del self.table_of[seq_id]
            self.free_rows.append(row)

    def gather(self, chunks) -> np.ndarray:
        """[len(chunks), longest table] int32, zero-padded."""
        idx = []
        width = 1
        for c in chunks:
            t = c.block_table
            row = self.row_of.get(c.seq_id)
            if row is None:
                row = self.row_of[c.seq_id] = (self.free_rows.pop() if self.free_rows
                                               else len(self.row_of))
            prev = self.table_of.get(c.seq_id)
            if prev is not t and prev != t:     # the scheduler passes the same tuple on
                self._write(row, t)
                self.table_of[c.seq_id] = t
            idx.append(row)
            width = max(width, len(t))
        return self.rows[idx, :width]

    def _write(self, row: int, table: tuple[int, ...]) -> None:
        rows, cols = self.rows.shape
        if row >= rows or len(table) > cols:
            grown = np.zeros((max(rows, 2 * (row + 1)), max(cols, 2 * len(table))), dtype=np.int32)
            grown[:rows, :cols] = self.rows
            self.rows = grown
        self.rows[row, :len(table)] = table
        self.rows[row, len(table):] = 0


def last_token(states: dict[str, SeqSamplingState], seq_id: str) -> int:
    """What a PLACEHOLDER stands for: the sequence's last sampled token. A sequence whose
    previous step failed has none; its row is computed and thrown away (the scheduler
    finished it), so any token does."""
    st = states.get(seq_id)
    return st.output_ids[-1] if st is not None and st.output_ids else 0


@attrs.define
class HostInputs:
    """A step's inputs as host arrays, built before the step may run (`stage_inputs`):
    everything but the PLACEHOLDER tokens, which need the step before it to have ended."""
    ids: np.ndarray                 # [T] int64, PLACEHOLDERs still in
    fill_rows: np.ndarray           # [P] the rows of ids that hold a PLACEHOLDER
    fill_ids: list                  # [P] their sequences
    arrays: list                    # [ids, positions, slots, tables, cu_seqlens_q, seq_lens(, rows)]
    all_sample: bool
    q_starts: list
    q_lens: list
    ctx_lens: list
    starts: list
    decode_rows: list
    prefill_rows: list
    sampled: tuple                  # the sequences that sample, in order
    # [P] where each PLACEHOLDER's token is among the previous staged step's sampled
    # tokens (-1: not there); set by the runner's `stage`
    fill_src: np.ndarray | None = None
    fill_step: int | None = None    # that previous step


def stage_inputs(chunks: tuple[SeqChunk, ...], bs: int,
                 block_tables: BlockTables | None = None) -> HostInputs:
    """The host half of input preparation, vectorised with numpy: it needs only the plan
    (and the persistent block tables), so it runs while the step before is still on the
    device. `block_tables` keeps the tables from one step to the next (the runner's;
    without it every table is copied)."""
    n = len(chunks)
    q_lens = [len(c.token_ids) for c in chunks]
    starts = [c.start_pos for c in chunks]
    q_starts = list(accumulate(q_lens, initial=0))
    ctx_lens = [s + q for s, q in zip(starts, q_lens)]
    if block_tables is None:
        block_tables = BlockTables()
    tables = block_tables.gather(chunks)
    q_lens_np = np.asarray(q_lens)
    row = np.repeat(np.arange(n), q_lens_np)                                # [T]
    pos = np.repeat(np.asarray(starts) - np.asarray(q_starts[:-1]), q_lens_np) + np.arange(q_starts[-1])
    slots = tables[row, pos // bs].astype(np.int64) * bs + pos % bs
    all_sample = all(c.sample for c in chunks)
    ids = np.fromiter(chain.from_iterable(c.token_ids for c in chunks), dtype=np.int64, count=q_starts[-1])
    fill_rows, fill_ids = (np.flatnonzero(ids == PLACEHOLDER), [])
    if fill_rows.size:   # a PLACEHOLDER is only ever a chunk's last token
        fill_ids = [c.seq_id for c in chunks if c.token_ids[-1] == PLACEHOLDER]
    arrays = [ids, pos.astype(np.int64), slots, tables, np.asarray(q_starts, dtype=np.int32),
              np.asarray(ctx_lens, dtype=np.int32)]
    if not all_sample:
        arrays.append(np.asarray([q_starts[i + 1] - 1 for i, c in enumerate(chunks) if c.sample],
                                 dtype=np.int64))
    return HostInputs(ids, fill_rows, fill_ids, arrays, all_sample, q_starts, q_lens, ctx_lens,
                      starts, decode_rows=[i for i, q in enumerate(q_lens) if q == 1],
                      prefill_rows=[i for i, q in enumerate(q_lens) if q > 1],
                      sampled=tuple(c.seq_id for c in chunks if c.sample))


def stage_plan(plan: StepPlan, bs: int, block_tables: BlockTables,
               staged_tokens: StagedTokens) -> HostInputs | None:
    """A runner's `stage`: the released sequences' table rows freed, then the chunks'
    host inputs, noted in `staged_tokens`; None for a plan with nothing to compute."""
    for sid in plan.released:
        block_tables.release(sid)
    if not plan.chunks:
        return None
    host = stage_inputs(plan.chunks, bs, block_tables)
    staged_tokens.stage(plan.step, host)
    return host


class StagedTokens:
    """Where a staged step's PLACEHOLDERs find their tokens: the previous staged step's
    sampled tokens, by position, so filling them in is one numpy gather on the critical
    path instead of a lookup per sequence. `stage` runs in plan order in one thread and
    `executed` in the same order in another."""

    def __init__(self) -> None:
        self.staged_step: int | None = None
        self.staged_rows: dict[str, int] = {}
        self.step: int | None = None          # the last executed step with its tokens
        self.tokens = np.zeros(1, dtype=np.int64)

    def stage(self, step: int, host: HostInputs) -> None:
        if host.fill_ids:
            rows = self.staged_rows
            host.fill_src = np.fromiter((rows.get(s, -1) for s in host.fill_ids), dtype=np.int64,
                                        count=len(host.fill_ids))
            host.fill_step = self.staged_step
        self.staged_step = step
        self.staged_rows = {s: i for i, s in enumerate(host.sampled)}

    def executed(self, step: int, tokens) -> None:
        # one spare 0 at the end: index -1 (a sequence the previous step did not sample,
        # whose row is thrown away) reads it
        self.step, self.tokens = step, np.fromiter((*tokens, 0), dtype=np.int64)

    def previous(self, host: HostInputs) -> np.ndarray | None:
        """The tokens `host.fill_src` indexes, or None when that step did not run here
        (it failed): then `last_token` fills them."""
        return self.tokens if host.fill_step is not None and host.fill_step == self.step else None


def upload_inputs(host: HostInputs, dev: torch.device, staging: Staging | None = None,
                  last_token=None, previous: np.ndarray | None = None):
    """The device half: fill in the PLACEHOLDERs (`last_token(seq_id)`: the sequence's
    token from the step that just ended; or, faster, `previous`: that step's sampled
    tokens, which `host.fill_src` indexes) and move the arrays to the device:
    (input_ids, positions, meta, sample_idx).

    sample_idx [S] indexes the rows of the flat batch to sample (each sampling chunk's
    last token), on the device: computed there from cu_seqlens_q when every chunk samples.
    With ``staging`` (CUDA) every array reaches the device through pinned buffers in two
    non-blocking copies; otherwise each is copied on its own."""
    ids = host.ids
    if host.fill_rows.size:
        if previous is not None and host.fill_src is not None:
            ids[host.fill_rows] = previous[host.fill_src]
        else:
            for i, seq_id in zip(host.fill_rows.tolist(), host.fill_ids):
                ids[i] = last_token(seq_id)
    if staging is not None:
        moved = staging.upload(host.arrays)
    elif dev.type == "cpu":   # no copy; and no .to(), which lets go of the GIL for nothing
        moved = [torch.from_numpy(a) for a in host.arrays]
    else:
        moved = [torch.from_numpy(a).to(dev) for a in host.arrays]
    input_ids, positions, slot_mapping, block_tables, cu_seqlens_q, seq_lens = moved[:6]
    sample_idx = (cu_seqlens_q[1:] - 1) if host.all_sample else moved[6]
    q_lens = host.q_lens
    meta = AttentionMetadata(
        slot_mapping=slot_mapping, block_tables=block_tables, cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens,
        q_starts=host.q_starts, q_lens=q_lens, ctx_lens=host.ctx_lens,
        start_positions=host.starts,
        decode_rows=host.decode_rows, prefill_rows=host.prefill_rows, max_seqlen_q=max(q_lens),
    )
    return input_ids, positions, meta, sample_idx


def prepare_step(chunks: tuple[SeqChunk, ...], bs: int, dev: torch.device, staging: Staging | None = None,
                 last_token=None, block_tables: BlockTables | None = None):
    """The step's flat inputs and attention metadata: `stage_inputs` then `upload_inputs`
    (input_ids, positions, meta, sample_idx)."""
    return upload_inputs(stage_inputs(chunks, bs, block_tables), dev, staging, last_token)


def profile_plan(max_tokens: int, max_seqs: int, block_size: int) -> tuple[StepPlan, int]:
    """One full-size step for memory profiling: max_tokens prompt tokens over
    min(max_seqs, max_tokens) sequences, every one sampled (so the logits are as wide as
    a full decode batch's), on blocks 0..n-1. Returns (plan, blocks it needs)."""
    n = max(1, min(max_seqs, max_tokens))
    lens = [max_tokens // n + (i < max_tokens % n) for i in range(n)]
    chunks, starts, next_block = [], [], 0
    greedy = SamplingOptions(temperature=0.0)
    for i, length in enumerate(lens):
        nblk = -(-length // block_size)
        table = tuple(range(next_block, next_block + nblk))
        next_block += nblk
        chunks.append(SeqChunk(f"__profile__{i}", (0,) * length, 0, table, True))
        starts.append(SeqStart(f"__profile__{i}", (0,) * length, greedy))
    return StepPlan(-100, tuple(chunks), tuple(starts)), next_block


def profile_step_bytes(model, *, block_size: int, max_tokens: int, max_seqs: int,
                       device: torch.device, use_triton: bool = True) -> int:
    """CUDA: the peak memory one full-size step allocates beyond the weights (activations,
    logits, sampling), measured by running it on a throwaway KV cache of just its size.
    Also compiles the prefill kernels, before anything is timed."""
    c = model.config
    plan, nblocks = profile_plan(max_tokens, max_seqs, block_size)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    cache = KVCache(c.num_hidden_layers, nblocks, block_size, c.num_key_value_heads, c.head_dim,
                    model.dtype, device)
    cache_bytes = torch.cuda.memory_allocated(device) - base
    torch.cuda.reset_peak_memory_stats(device)
    runner = ModelRunner(model, cache, device=device, use_triton=use_triton)
    runner.execute(plan)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base - cache_bytes
    del runner, cache
    torch.cuda.empty_cache()
    return max(0, peak)


def kv_budget_bytes(*, total: int, free: int, step_peak: int, utilization: float,
                    reserve: int = 512 << 20) -> int:
    """KV cache bytes on a GPU: the share of its memory this server may use
    (--gpu-memory-utilization), less what is in use now (the weights, other processes),
    the profiled peak of one full-size step, and a reserve for CUDA graphs and the
    allocator's slack."""
    return int(total * utilization) - (total - free) - step_peak - reserve
