"""The scheduler's KV connector half (issue 36; stages/kv_transfer.py has the
protocol): a mixin of `Scheduler`, whose state it reads and changes (`held`, `receiving`,
`_kv_reads`, `_abandoned_reads`, set up in `Scheduler.__init__`).

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
from stages.kv_transfer import response_params
from stages.schedule.sequence import Sequence


class KVConnectorSide:
    def _hold(self, seq: Sequence) -> dict:
        """A do_remote_decode request has finished: keep its prompt's blocks for the decode
        side (the rest go back) and answer the params that name them."""
        keep = self.blocks.blocks_for(seq.prompt_len)
        table = seq.table
        self.blocks.release(table[keep:])
        rid = seq.req.request_id
        self.held[rid] = (table[:keep], time.monotonic() + self.kv_transfer.abort_timeout_s)
        seq.table, seq.table_t = [], ()
        return response_params(self.kv_transfer, rid, table[:keep], self.kv_port,
                               self.kv_tp_size)

    def release_held(self, request_ids, expire: bool = False) -> None:
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
                self.kv_holds_expired += 1

    def _start_remote_prefill(self, seq: Sequence) -> bool:
        """A waiting remote prefill: its blocks allocated and its read planned (False: not
        enough free blocks yet). One whose blocks cannot be the prompt's fails."""
        rp = seq.remote_prefill
        need = self.blocks.blocks_for(seq.prompt_len)
        if len(rp.block_ids) != need:     # finish() takes it from the queue
            self.finish(seq.req.request_id, FinishReason.ERROR,
                        f"kv_transfer_params.remote_block_ids has {len(rp.block_ids)} blocks; "
                        f"this prompt of {seq.prompt_len} tokens is {need} blocks of "
                        f"{self.blocks.block_size} (another prompt, or another --block-size "
                        f"on the prefill instance)")
            return True
        if not self.blocks.can_allocate(need):
            return False
        seq.table = list(self.blocks.allocate(need))
        seq.table_t = tuple(seq.table)
        self.waiting.popleft()
        self.receiving[seq.id] = seq
        self._kv_reads.append(KVRead(seq.id, rp.engine_id, rp.request_id, rp.block_ids,
                                     rp.host, rp.port, seq.table_t))
        return True

    def _kv_results(self, result: StepResult) -> None:
        """Remote prefills the runner finished: landed, the prompt counts as computed and
        cached but for its last token, which the next step feeds as a decode does (its
        logits give the first token, as vLLM's decode side recomputes it); failed, the
        request ends with the error (a read that timed out and may still land keeps its
        blocks, as an aborted one does, until the runner names it again: `kv_late`)."""
        for sid in result.kv_loaded:
            if sid in self._abandoned_reads:
                self.blocks.release(self._abandoned_reads.pop(sid))
                continue
            seq = self.receiving.pop(sid, None)
            if seq is None:
                continue
            seq.remote_prefill = None
            done = seq.prompt_len - 1
            seq.num_computed = done
            seq.num_cached_tokens = done
            self._computed(seq, done)
            self.running.append(seq)
        late = result.kv_late
        for sid, error in result.kv_failed:
            if sid in self._abandoned_reads:
                if sid not in late:         # over: its blocks are free to reuse
                    self.blocks.release(self._abandoned_reads.pop(sid))
                continue
            seq = self.receiving.get(sid)
            if seq is None:
                continue
            del self.receiving[sid]
            seq.remote_prefill = None
            if sid in late:       # timed out, still in NIXL's hands: its blocks wait for it
                self._abandoned_reads[sid] = seq.table
                seq.table, seq.table_t = [], ()
            self.running.append(seq)        # finish() takes it from there, blocks and all
            self.finish(seq.req.request_id, FinishReason.ERROR, error)
