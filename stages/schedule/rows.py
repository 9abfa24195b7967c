"""Scheduler.update's per-row work: each planned chunk's share of a step's result applied to
its sequence (tokens kept by the stop rule, KV counted, the downstream Delta built).

Most rows of most steps are one sampled token of a sequence with no drafts, no logprobs,
no prompt logprobs and no beam: `apply_rows` takes those through a straight-line path
(the stop rule's one-token case and the block hashing's test inlined, no per-token calls
beyond the Delta), which is the general path's result for such a row. The host path's
budget is a few microseconds a token (docs/benchmarks.md, issue 60's host path), and this
loop runs once per token of every step.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from stages.delta import Delta, FinishReason
from stages.schedule.beam import BeamGroup
from stages.schedule.spec import kept_logprobs
from stages.schedule.stop import EOS, LENGTH, Stop, check_stop

if TYPE_CHECKING:
    from stages.schedule.scheduler import Scheduler

_STOP = FinishReason.STOP
_LENGTH = FinishReason.LENGTH


def apply_rows(s: Scheduler, plan, planned, tokens: dict, logprobs: dict,
               verified: dict | None, deltas: list[Delta], beams: list[BeamGroup]) -> int:
    """Each chunk of `plan` with its (sequence, epoch) from `planned`: the step's tokens
    (`tokens`/`logprobs` by sequence id, step_outputs'), deltas appended to `deltas`.
    Returns vLLM's iteration tokens (prompts at their first token, and tokens out)."""
    iteration = 0
    bm = s.blocks
    hashing = bm.prefix_caching
    bs = bm.block_size
    sliding = bm.sliding is not None
    plain = verified is None and not logprobs
    came_back = s._token_came_back
    append = deltas.append
    for chunk, (seq, epoch) in zip(plan.chunks, planned):
        if seq.retired:
            continue    # finished while this step ran: its row is thrown away
        current = epoch == seq.epoch
        if current:
            seq.in_flight_tokens -= len(chunk.token_ids)
            seq.in_flight_drafts -= chunk.num_drafts
        if seq.beam is not None:
            iteration += s.beam_search.row(seq, chunk, epoch, tokens, logprobs, beams)
            continue
        got = tokens.get(seq.id, ()) if chunk.sample else ()
        if (plain and len(got) == 1 and not chunk.num_drafts and not chunk.floating
                and seq.max_tokens and seq.prompt_logprobs is None):
            # one sampled token, nothing else: check_stop's one-token case and _computed
            came_back(seq)
            tok = got[0]
            ids = seq.token_ids
            if tok in seq.stop_ids:
                stop = Stop(_STOP, tok) if tok in seq.stop_token_ids else EOS
            elif seq.end_len - len(ids) <= 1:
                stop = LENGTH
            else:
                stop = None
            ids.append(tok)
            if current:
                done = chunk.start_pos + len(chunk.token_ids)
                if (hashing and done // bs > seq.hash_cursor[0]) or sliding:
                    s._computed(seq, done)
                else:
                    seq.num_done = done
            iteration += 1 + (seq.prompt_len if len(ids) - seq.prompt_len == 1 else 0)
            # positional, in Delta's field order (per token: a keyword call costs ~3x)
            if stop is None:
                append(Delta(seq.req.request_id, got, None, None, seq.num_cached_tokens, None,
                             (), seq.scheduled_at, seq.index, (), 0, 0))
                continue
            delta = Delta(seq.req.request_id, got, stop.reason, stop.stop_token,
                          seq.num_cached_tokens, None, (), seq.scheduled_at, seq.index, (), 0, 0)
        else:
            kept, stop, toks = 0, None, got
            if got:
                came_back(seq)
                kept, stop = check_stop(seq, got)
                toks = got[:kept]
                seq.token_ids.extend(toks)
            if current:   # not preempted since: these blocks now hold the chunk's KV
                # (a floating chunk ran where the step before left the sequence's KV)
                start = seq.num_done if chunk.floating else chunk.start_pos
                if chunk.num_drafts or chunk.floating:
                    done = start + kept
                    s.spec_planning.rollback(seq, done)
                else:
                    done = start + len(chunk.token_ids)
                s._computed(seq, done)
            if not got:
                continue
            iteration += kept + (seq.prompt_len if seq.num_output == kept else 0)
            # verified drafts: the drafts that held, then the token sampled after them
            drafts = chunk.num_drafts if verified is None else verified.get(seq.id, chunk.num_drafts)
            accepted = len(got) - 1 if drafts else 0
            if drafts:
                s.speculation.verified(seq, drafts, accepted)
            prompt_logprobs = ()
            if seq.prompt_logprobs is not None and seq.num_output == kept:   # the first
                prompt_logprobs = (None, *seq.prompt_logprobs_so_far)   # none for the first
                seq.prompt_logprobs_so_far = []
            lps = kept_logprobs(logprobs.get(seq.id, ()), kept) if logprobs else ()
            delta = Delta(
                seq.req.request_id, toks, None if stop is None else stop.reason,
                None if stop is None else stop.stop_token, seq.num_cached_tokens, None, lps,
                seq.scheduled_at, seq.index, prompt_logprobs, drafts, accepted)
        if (stop is not None and current and seq.req.kv_transfer is not None
                and seq.req.kv_transfer.remote_decode and s.kv.config is not None):
            delta = attrs.evolve(delta, kv_transfer_params=s.kv.hold(seq))
        append(delta)
        if stop is not None:     # (waiting again if preempted while this step ran)
            (s.running if current else s.waiting).remove(seq)
            s._retire(seq)
    return iteration
