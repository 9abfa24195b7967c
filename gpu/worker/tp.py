"""Tensor parallelism's per-step plumbing (issue 25): rank 0's `StepBroadcast`, which hands
each step's inputs to the worker ranks, and `follow`, the worker ranks' loop.

Only rank 0 schedules and samples. The sampler state (seeds, RNG, penalties' counts), the
grammar matchers and the prompt-logprob bookkeeping live in rank 0's ModelRunner alone;
a worker needs only what the forward and the logits collectives take. So once rank 0 has
staged and uploaded a step (PLACEHOLDERs filled in), it broadcasts the host arrays it
uploaded, concatenated into one int64 payload after a fixed header: no Python object is
pickled per step. Two broadcasts, since a receiver must know the payload's size before it
can receive it: the 16-int header, then the payload. With --enable-lora a third follows,
the step's LoRA rows (the one pickled object: adapter refs and row ranges, `send_lora`);
each worker loads its shard of an adapter on first use (gpu/lora/adapters.py).

    header  [kind, T, B, W, all_sample, S, sample, K, L, step, payload length, N, 0...]
    payload ids[T] positions[T] slots[T] tables[B*W] cu_seqlens_q[B+1] seq_lens[B]
            sample_rows[S] kv_updates[2K] prompt_logprob_spans[2L] state_slots[3N]

A hybrid linear-attention model's state slots (N = B, else 0) travel as (state_slot,
state_load, state_save) per sequence: the slot numbers are the scheduler's, the same on every
rank, and each rank's StatePool holds its own heads' states under them (`StateSlots`).

`compute_logits` is a collective: a worker calls it on the same rows in the same order as
rank 0 (`logit_calls`): the prompt-logprob spans in pieces of PROMPT_LOGPROB_ROWS, then the
sampled rows when any chunk samples. A hybrid KV cache's remaps (plan.kv_updates) travel
with the next step that computes, and are applied before its forward, as rank 0 applied
them before it.

With the KV connector (--kv-transfer-config) a third kind of message, KV, carries the
remote prefills every rank starts reading (pickled `KVRead`s, usually none) and gathers each
rank's poll of its own reads to rank 0 (`kv_exchange`; gpu/kv_transfer/connector.py TPKVConnector
combines them); rank 0 sends it around each step that has reads in flight, and at start-up
`gather_layouts` brings every rank's NIXL layout to rank 0's side channel.

The plan goes over its own gloo group (CPU tensors; no device sync on either side) with a
timeout long enough for an idle server: a worker waits there for the next step. The
model's collectives run on the TP group (NCCL on CUDA) with the --tp-timeout.
"""
from __future__ import annotations

import datetime
import logging

import attrs
import numpy as np
import torch

from gpu.interface import TPLost
from gpu.worker.runner import PROMPT_LOGPROB_ROWS, ModelRunner
from gpu.worker.staging import HostInputs, upload_inputs

log = logging.getLogger("tailrace.gpu")

HEADER = 16
STEP, STOP, KV = 1, 2, 3
# the plan group waits for the next step as long as the server stays idle
PLAN_TIMEOUT = datetime.timedelta(days=365)


@attrs.frozen
class StateSlots:
    """A chunk's state slots as StatePool.load/save read them (gpu/interface.py SeqChunk's)."""
    state_slot: int
    state_load: int
    state_save: int


def pack(host: HostInputs, kv_updates, spans, sample: bool, step: int, states=()
         ) -> tuple[np.ndarray, np.ndarray]:
    """(header, payload) of one step: `host`'s uploaded arrays (ids filled in); states: its
    chunks' (state_slot, state_load, state_save), flat (a hybrid model's), or empty."""
    ids, pos, slots, tables, cu, seq_lens = host.arrays[:6]
    rows = host.arrays[6] if not host.all_sample else np.zeros(0, dtype=np.int64)
    kv = np.asarray(kv_updates, dtype=np.int64).reshape(-1)
    sp = np.asarray(spans, dtype=np.int64).reshape(-1)
    st = np.asarray(states, dtype=np.int64).reshape(-1)
    payload = np.concatenate([ids, pos, slots, tables.reshape(-1), cu, seq_lens, rows, kv, sp, st],
                             dtype=np.int64, casting="unsafe")
    header = np.zeros(HEADER, dtype=np.int64)
    header[:12] = (STEP, ids.size, seq_lens.size, tables.shape[1], host.all_sample, rows.size,
                   sample, kv.size // 2, sp.size // 2, step, payload.size, st.size // 3)
    return header, payload


def unpack(header: np.ndarray, payload: np.ndarray):
    """(host inputs, kv updates, spans, sample, state slots) from `pack`'s two arrays."""
    _, t, b, w, all_sample, s, sample, k, n_spans, _, _, n_states = (int(x) for x in header[:12])
    cuts = np.cumsum([t, t, t, b * w, b + 1, b, s, 2 * k, 2 * n_spans, 3 * n_states])
    ids, pos, slots, tables, cu, seq_lens, rows, kv, sp, st = np.split(payload, cuts[:-1])
    tables = tables.astype(np.int32).reshape(b, w)
    cu, seq_lens = cu.astype(np.int32), seq_lens.astype(np.int32)
    arrays = [ids, pos, slots, tables, cu, seq_lens] + ([] if all_sample else [rows])
    q_starts = cu.tolist()
    q_lens = np.diff(cu).tolist()
    ctx_lens = seq_lens.tolist()
    host = HostInputs(ids, np.zeros(0, dtype=np.int64), [], arrays, bool(all_sample), q_starts,
                      q_lens, ctx_lens, [c - q for c, q in zip(ctx_lens, q_lens)],
                      decode_rows=[i for i, q in enumerate(q_lens) if q == 1],
                      prefill_rows=[i for i, q in enumerate(q_lens) if q > 1], sampled=())
    kv_updates = tuple(map(tuple, kv.reshape(-1, 2).tolist()))
    spans = [tuple(x) for x in sp.reshape(-1, 2).tolist()]
    states = [StateSlots(*x) for x in st.reshape(-1, 3).tolist()]
    return host, kv_updates, spans, bool(sample), states


def logit_calls(spans) -> list[tuple[int, int]]:
    """The [a, b) row ranges of hidden, in call order, that rank 0's prompt logprobs pass to
    compute_logits (gpu/worker/runner.py compute_prompt_logprobs): each span in pieces."""
    return [(s, min(s + PROMPT_LOGPROB_ROWS, b)) for a, b in spans
            for s in range(a, b, PROMPT_LOGPROB_ROWS)]


class StepBroadcast:
    """Rank 0's end: ModelRunner calls `send` once per step that computes, after the upload
    and before the forward (in the runner thread); `stop` ends the workers' loops."""

    def __init__(self, group) -> None:
        self.group = group
        self.pending_kv: list[tuple[int, int]] = []

    def remapped(self, kv_updates) -> None:
        self.pending_kv.extend(kv_updates)

    def send(self, host: HostInputs, spans, sample: bool, step: int, states=()) -> None:
        header, payload = pack(host, self.pending_kv, spans, sample, step, states)
        self.pending_kv = []
        try:
            torch.distributed.broadcast(torch.from_numpy(header), 0, group=self.group)
            torch.distributed.broadcast(torch.from_numpy(payload), 0, group=self.group)
        except Exception as exc:   # a worker has gone
            raise TPLost(f"broadcasting step {step} to the tensor-parallel workers failed: "
                         f"{exc}") from exc

    def send_lora(self, groups) -> None:
        """With --enable-lora, after `send`: the step's LoRA rows (LoRAManager.groups, plain
        data: refs and row ranges), pickled, so each worker adds its shard of the adapters'
        terms to the same rows."""
        try:
            torch.distributed.broadcast_object_list([groups], 0, group=self.group)
        except Exception as exc:
            raise TPLost(f"broadcasting the LoRA rows to the tensor-parallel workers failed: "
                         f"{exc}") from exc

    def kv_exchange(self, reads, poll) -> list:
        """The KV connector's round (rank 0): every worker starts `reads` on its shard and
        polls its reads; `poll()` is rank 0's own poll, made meanwhile. Every rank's poll,
        by rank."""
        header = np.zeros(HEADER, dtype=np.int64)
        header[0] = KV
        size = torch.distributed.get_world_size(self.group)
        try:
            torch.distributed.broadcast(torch.from_numpy(header), 0, group=self.group)
            torch.distributed.broadcast_object_list([tuple(reads)], 0, group=self.group)
            polled = [None] * size
            torch.distributed.gather_object(poll(), polled, dst=0, group=self.group)
        except Exception as exc:   # a worker has gone
            raise TPLost(f"the KV connector's exchange with the tensor-parallel workers "
                         f"failed: {exc}") from exc
        return polled

    def stop(self) -> None:
        header = np.zeros(HEADER, dtype=np.int64)
        header[0] = STOP
        torch.distributed.broadcast(torch.from_numpy(header), 0, group=self.group)


def follow(runner: ModelRunner, group) -> int:
    """A worker rank's loop: each step rank 0 broadcasts, run the same forward and the same
    compute_logits calls on this rank's shard (the results are rank 0's to use), until
    the stop message. Returns the steps run."""
    model, steps = runner.model, 0
    header = torch.zeros(HEADER, dtype=torch.int64)
    while True:
        torch.distributed.broadcast(header, 0, group=group)
        h = header.numpy().copy()
        if h[0] == STOP:
            return steps
        if h[0] == KV:       # rank 0's kv_exchange: start these reads, report this rank's
            got = [None]
            torch.distributed.broadcast_object_list(got, 0, group=group)
            runner.kv_connector.start_reads(got[0])
            torch.distributed.gather_object(runner.kv_connector.poll(), None, dst=0,
                                            group=group)
            continue
        payload = torch.empty(int(h[10]), dtype=torch.int64)
        torch.distributed.broadcast(payload, 0, group=group)
        host, kv_updates, spans, sample, states = unpack(h, payload.numpy())
        if kv_updates:
            runner.cache.remap(kv_updates)
        input_ids, positions, meta, sample_idx = upload_inputs(host, runner.device, runner.staging)
        pool = runner.state_pool if states else None
        if pool is not None:     # as rank 0's runner: snapshots in, the step's layout
            pool.load(states)
            meta.states = pool.step([c.state_slot for c in states], meta.q_starts, meta.q_lens,
                                    meta.start_positions)
        lora = False
        if runner.lora is not None:      # rank 0's LoRA rows of this step (send_lora)
            got = [None]
            torch.distributed.broadcast_object_list(got, 0, group=group)
            lora = runner.lora.set_step(got[0])
        with torch.inference_mode():
            try:
                hidden, _ = runner.forward(input_ids, positions, meta, lora=lora)
                if pool is not None:
                    pool.save(states)
            finally:
                if lora:
                    runner.lora.done()
            for a, b in logit_calls(spans):
                model.compute_logits(hidden[a:b])
            if sample:
                model.compute_logits(hidden.index_select(0, sample_idx))
        steps += 1


def join(rank: int, size: int, device: torch.device, init_method: str, timeout_s: float):
    """Join the TP group as `rank` of `size` (gpu/parallel.py init_group: NCCL on CUDA,
    gloo on the CPU, the model's collectives bounded by timeout_s) and the plan's gloo
    group: (TP, plan group). Every rank calls it in the same order: rank 0 listens at
    init_method."""
    from gpu.parallel import init_group

    if device.type == "cuda":
        torch.cuda.set_device(device)
    tp = init_group(rank, size, backend="nccl" if device.type == "cuda" else "gloo",
                    init_method=init_method, timeout_s=timeout_s)
    plan = torch.distributed.new_group(backend="gloo", timeout=PLAN_TIMEOUT)
    return tp, plan


def min_over_ranks(value: int, group) -> int:
    """The smallest of every rank's value (each rank's KV cache fits the smallest memory)."""
    t = torch.tensor([value], dtype=torch.int64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=group)
    return int(t)


def same_on_every_rank(on: bool, group, flag: str) -> None:
    """At start-up, every rank: a ValueError naming the ranks unless `on` is the same on
    all (a worker started by hand without a flag rank 0 has, or the other way round)."""
    size = torch.distributed.get_world_size(group)
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    torch.distributed.all_gather(out, torch.tensor([int(on)]), group=group)
    ons = [r for r, t in enumerate(out) if int(t)]
    if 0 < len(ons) < size:
        offs = [r for r in range(size) if r not in ons]
        raise ValueError(f"{flag} is given to tensor-parallel rank(s) "
                         f"{', '.join(map(str, ons))} but not to rank(s) "
                         f"{', '.join(map(str, offs))}: every rank needs it")


def gather_layouts(layout, group) -> tuple | None:
    """At start-up, every rank with the KV connector: this rank's cache Layout
    (gpu/kv_transfer/nixl.py); rank 0 gets every rank's, by rank (the others None)."""
    rank = torch.distributed.get_rank(group)
    out = [None] * torch.distributed.get_world_size(group) if rank == 0 else None
    torch.distributed.gather_object(layout, out, dst=0, group=group)
    return tuple(out) if rank == 0 else None
