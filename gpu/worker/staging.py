"""A step's inputs, from plan to device: the host half (`stage_inputs`: positions, slots,
block tables, in numpy, while the step before still runs), the PLACEHOLDER tokens
(`StagedTokens`: one gather from the previous step's tokens) and the upload
(`upload_inputs`, through pinned `Staging` buffers on CUDA). `BlockTables` keeps the
block tables from step to step. Shared by ModelRunner and the simulated runner.
"""
from __future__ import annotations

from itertools import accumulate, chain

import attrs
import numpy as np
import torch

from gpu.layers.attention import AttentionMetadata
from gpu.interface import PLACEHOLDER, SeqChunk, StepPlan
from gpu.worker.sampler import SeqSamplingState


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
    if block_tables is None:
        block_tables = BlockTables()
    return host_inputs(chunks, bs, block_tables.gather(chunks))


def host_inputs(chunks: tuple[SeqChunk, ...], bs: int, tables: np.ndarray) -> HostInputs:
    """`stage_inputs` past the block tables' gather: tables [len(chunks), W] int32."""
    n = len(chunks)
    q_lens = [len(c.token_ids) for c in chunks]
    starts = [c.start_pos for c in chunks]
    q_starts = list(accumulate(q_lens, initial=0))
    ctx_lens = [s + q for s, q in zip(starts, q_lens)]
    q_lens_np = np.asarray(q_lens)
    row = np.repeat(np.arange(n), q_lens_np)                                # [T]
    pos = np.repeat(np.asarray(starts) - np.asarray(q_starts[:-1]), q_lens_np) + np.arange(q_starts[-1])
    slots = tables[row, pos // bs].astype(np.int64) * bs + pos % bs
    # a chunk with drafts samples its last 1 + num_drafts rows (speculative decoding)
    all_sample = all(c.sample and not c.num_drafts for c in chunks)
    ids = np.fromiter(chain.from_iterable(c.token_ids for c in chunks), dtype=np.int64, count=q_starts[-1])
    fill_rows, fill_ids = (np.flatnonzero(ids == PLACEHOLDER), [])
    if fill_rows.size:   # a PLACEHOLDER is only ever a chunk's last token
        fill_ids = [c.seq_id for c in chunks if c.token_ids[-1] == PLACEHOLDER]
    arrays = [ids, pos.astype(np.int64), slots, tables, np.asarray(q_starts, dtype=np.int32),
              np.asarray(ctx_lens, dtype=np.int32)]
    if not all_sample:
        arrays.append(np.asarray([r for i, c in enumerate(chunks) if c.sample
                                  for r in range(q_starts[i + 1] - 1 - c.num_drafts, q_starts[i + 1])],
                                 dtype=np.int64))
    return HostInputs(ids, fill_rows, fill_ids, arrays, all_sample, q_starts, q_lens, ctx_lens,
                      starts, decode_rows=[i for i, q in enumerate(q_lens) if q == 1],
                      prefill_rows=[i for i, q in enumerate(q_lens) if q > 1],
                      sampled=tuple(c.seq_id for c in chunks if c.sample))


def float_chunks(plan: StepPlan, host: HostInputs, bs: int, start_of, tokens_of
                 ) -> tuple[StepPlan, HostInputs]:
    """A plan's floating chunks (SeqChunk.floating: speculative decoding planned ahead of
    a verify step) made real once the steps before have run: each starts where its
    sequence's KV ends (`start_of(chunk)`), and its tokens are `tokens_of(chunk)` (the
    sequence's last sampled token, then the drafts found). The host inputs are rebuilt
    from the tables gathered when the plan was staged (which cover the start the plan
    assumed, never less): the persistent BlockTables are not touched, as the event loop
    may be staging the next plan meanwhile."""
    chunks = []
    for c in plan.chunks:
        if c.floating:
            tokens = tuple(tokens_of(c))
            c = SeqChunk(c.seq_id, tokens, start_of(c), c.block_table, True, len(tokens) - 1)
        chunks.append(c)
    chunks = tuple(chunks)
    new = host_inputs(chunks, bs, host.arrays[3])
    # the PLACEHOLDERs are the other chunks', in the same order (a floating chunk has none)
    new.fill_src, new.fill_step = host.fill_src, host.fill_step
    return attrs.evolve(plan, chunks=chunks), new


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
    if not host.all_sample:
        sample_idx = moved[6]
    elif dev.type == "cpu" and staging is None:
        # numpy, not a torch op: every torch op lets go of the GIL, and on the runner thread
        # taking it back waits out the event loop's switch interval (docs/benchmarks.md,
        # issue 60's host path)
        sample_idx = torch.from_numpy(host.arrays[4][1:] - 1)
    else:
        sample_idx = cu_seqlens_q[1:] - 1
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


