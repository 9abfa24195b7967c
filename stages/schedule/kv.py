"""The scheduler's KV connector half (issue 36; stages/kv_transfer.py has the
protocol): `KVConnectorSide`, an object `Scheduler` holds as `kv` and calls at named
hooks (`hold` when a do_remote_decode request finishes, `start_remote_prefill` at
admission, `results` after a step, `abandon` on an abort, `release` from the inbox); it
owns the connector's state (`held`, `receiving`, the reads to plan, the abandoned reads).

- The prefill side: a finished do_remote_decode request's prompt blocks are held by
  request id (`_hold`, from `update`) until a `KVRelease` in the inbox frees them (the
  decode side's read landed, or it refused the request) or the abort timeout passes.
- The decode side: a remote prefill is a waiting sequence like any other until it is
  admitted; then its blocks are allocated and its read goes to the GPU step in the plan
  (`_start_remote_prefill`), and it sits in `receiving`, in no queue, until the runner
  reports the read landed (it joins the running batch with all but its last prompt token
  computed) or failed (it ends with the error) (`_kv_results`)."""
from __future__ import annotations

import time

from gpu.interface import KVRead, StepResult
from stages.delta import FinishReason
from stages.kv_transfer import KVTransferConfig, response_params
from stages.schedule.blocks import BlockManager
from stages.schedule.sequence import Sequence


class KVConnectorSide:
    def __init__(self, config: KVTransferConfig | None, blocks: BlockManager,
                 port: int | None = None, tp_size: int = 1) -> None:
        """config: --kv-transfer-config (None: no connector; the side stays idle); port,
        tp_size: the side channel's port (default: the flag's) and the engine's TP size,
        which a prefill's response params name."""
        self.config = config
        self.blocks = blocks
        self.port = port if port is not None else config.side_channel_port if config is not None else 0
        self.tp_size = tp_size
        # Prefill side: a finished do_remote_decode request's prompt blocks, held by request
        # id until the decode side has read them (KVRelease) or the abort timeout passes.
        self.held: dict[str, tuple[list[int], float]] = {}     # request id -> (blocks, deadline)
        self.expired = 0
        # Decode side: a remote prefill is a sequence whose blocks are allocated and being
        # filled by the GPU step's read (plan.kv_reads), out of the queues until it lands;
        # one aborted meanwhile keeps its blocks until the read is over (the runner says).
        self.receiving: dict[str, Sequence] = {}
        self.reads: list[KVRead] = []
        self.abandoned: dict[str, list[int]] = {}

    @property
    def busy(self) -> bool:
        """Reads in flight (the scheduler keeps planning while they land)."""
        return bool(self.receiving or self.abandoned)

    def take_reads(self) -> tuple[KVRead, ...]:
        """The reads to start in the step planned now."""
        reads, self.reads = tuple(self.reads), []
        return reads

    def abandon(self, seq: Sequence) -> bool:
        """An aborted sequence: if its read is in flight it keeps its blocks until the read
        is over (True; the scheduler frees nothing of it)."""
        if seq.id not in self.receiving:
            return False
        del self.receiving[seq.id]
        self.abandoned[seq.id] = seq.table
        return True

    def hold(self, seq: Sequence) -> dict:
        """A do_remote_decode request has finished: keep its prompt's blocks for the decode
        side (the rest go back) and answer the params that name them."""
        keep = self.blocks.blocks_for(seq.prompt_len)
        table = seq.table
        self.blocks.release(table[keep:])
        rid = seq.req.request_id
        self.held[rid] = (table[:keep], time.monotonic() + self.config.abort_timeout_s)
        seq.table, seq.table_t = [], ()
        return response_params(self.config, rid, table[:keep], self.port, self.tp_size)

    def release(self, request_ids, expire: bool = False) -> None:
        """KVRelease: free held requests (read, or refused by the decode side); with
        `expire` those past their deadline too (vLLM's abort timeout)."""
        for rid in request_ids:
            got = self.held.pop(rid, None)
            if got is not None:
                self.blocks.release(got[0])
        if expire and self.held:
            now = time.monotonic()
            for rid in [r for r, (_, deadline) in self.held.items() if deadline <= now]:
                self.blocks.release(self.held.pop(rid)[0])
                self.expired += 1

    def start_remote_prefill(self, sched, seq: Sequence) -> bool:
        """A waiting remote prefill (at the head of `sched`'s waiting queue): its blocks
        allocated and its read planned (False: not enough free blocks yet). One whose
        blocks cannot be the prompt's fails."""
        rp = seq.remote_prefill
        need = self.blocks.blocks_for(seq.prompt_len)
        if len(rp.block_ids) != need:     # finish() takes it from the queue
            sched.finish(seq.req.request_id, FinishReason.ERROR,
                        f"kv_transfer_params.remote_block_ids has {len(rp.block_ids)} blocks; "
                        f"this prompt of {seq.prompt_len} tokens is {need} blocks of "
                        f"{self.blocks.block_size} (another prompt, or another --block-size "
                        f"on the prefill instance)")
            return True
        if not self.blocks.can_allocate(need):
            return False
        seq.table = list(self.blocks.allocate(need))
        seq.table_t = tuple(seq.table)
        sched.waiting.popleft()
        self.receiving[seq.id] = seq
        self.reads.append(KVRead(seq.id, rp.engine_id, rp.request_id, rp.block_ids,
                                     rp.host, rp.port, seq.table_t))
        return True

    def results(self, sched, result: StepResult) -> None:
        """Remote prefills the runner finished: landed, the prompt counts as computed and
        cached but for its last token, which the next step feeds as a decode does (its
        logits give the first token, as vLLM's decode side recomputes it); failed, the
        request ends with the error (a read that timed out and may still land keeps its
        blocks, as an aborted one does, until the runner names it again: `kv_late`)."""
        for sid in result.kv_loaded:
            if sid in self.abandoned:
                self.blocks.release(self.abandoned.pop(sid))
                continue
            seq = self.receiving.pop(sid, None)
            if seq is None:
                continue
            seq.remote_prefill = None
            done = seq.prompt_len - 1
            seq.num_computed = done
            seq.num_cached_tokens = done
            sched._computed(seq, done)
            sched.running.append(seq)
        late = result.kv_late
        for sid, error in result.kv_failed:
            if sid in self.abandoned:
                if sid not in late:         # over: its blocks are free to reuse
                    self.blocks.release(self.abandoned.pop(sid))
                continue
            seq = self.receiving.get(sid)
            if seq is None:
                continue
            del self.receiving[sid]
            seq.remote_prefill = None
            if sid in late:       # timed out, still in NIXL's hands: its blocks wait for it
                self.abandoned[sid] = seq.table
                seq.table, seq.table_t = [], ()
            sched.running.append(seq)        # finish() takes it from there, blocks and all
            sched.finish(seq.req.request_id, FinishReason.ERROR, error)
