"""schedule: waiting/running queues, the KV block manager, prefix hashes.

Each step it builds a StepPlan under a token budget (--max-num-batched-tokens) and a
sequence budget (--max-num-seqs): running sequences first (one decode token each, or
the next chunk of a chunked prefill), then waiting ones. When blocks run out it preempts
the most recently admitted running sequence by recompute: its blocks are freed and it
goes back to the front of the waiting queue, keeping the tokens it already generated.
"""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future

import attrs
import trio

from gpu.grammar import GrammarCompiler
from gpu.interface import (PLACEHOLDER, SamplingOptions, SeqChunk, SeqStart, StepPlan, StepResult,
                           TokenLogprobs)
from stages.lib.histogram import ITERATION_BUCKETS, PREEMPTION_BUCKETS, Histogram
from stages.schedule.blocks import BlockManager
from stages.lib.delta import Delta, FinishReason
from stages.schedule.drafter import Drafter
from stages.messages import Abort, FinishRequest, RenderedRequest, Step

_PLACEHOLDER = (PLACEHOLDER,)


class Sequence:
    """The scheduler's state for one choice of a request (one sequence of tokens)."""

    def __init__(self, req: RenderedRequest, eos_token_ids: tuple[int, ...], index: int = 0,
                 leader: Sequence | None = None) -> None:
        self.req = req
        self.index = index
        # The GPU side knows sequences by id: a request's own id, or id#index for several.
        self.id = req.request_id if req.num_choices == 1 else f"{req.request_id}#{index}"
        # Choices after the first of a prompt wait for the first one's prompt to be in the
        # cache, so they take its blocks through the prefix cache instead of prefilling again.
        self.leader = leader
        prompt = req.prompt_of(index)
        self.prompt_len = len(prompt)
        self.token_ids: list[int] = list(prompt)
        # prompt_logprobs: the first choice of each prompt computes them (not from the cache)
        self.prompt_logprobs = (req.sampling.prompt_logprobs if leader is None else None)
        self.prompt_logprobs_so_far: list[TokenLogprobs] = []   # gathered until the first delta
        # Tokens in the KV cache once the steps planned so far have run (a planned chunk
        # counts at once, so that with async scheduling the next plan continues after it).
        self.num_computed = 0
        # Tokens sampled by planned steps whose results have not come back: the next
        # chunk feeds them as PLACEHOLDERs (at most one with one step planned ahead).
        self.num_pending = 0
        self.num_done = 0       # tokens in the KV cache by the steps that have come back
        self.epoch = 0          # bumped by preemption: an older step's chunk is stale
        self.retired = False
        self.table: list[int] = []
        self.table_t: tuple[int, ...] = ()   # tuple(table), for the chunks: kept with table
        self.passed = 0     # hybrid KV: leading blocks whose sliding halves it let go (blocks.py)
        self.num_cached_tokens = 0
        self.first_scheduled = False
        self.scheduled_at = 0.0   # time.monotonic() when first scheduled
        # The prefix-hash chain starts from the request's cache_salt, when it has one.
        self.hash_root = None if req.cache_salt is None else hash(("cache_salt", req.cache_salt))
        self.hash_cursor: tuple[int, int | None] = (0, self.hash_root)
        sp = req.sampling
        self.max_tokens = req.max_tokens_of(index)
        # A grammar ends on EOS (its matcher allows nothing else once complete), so a
        # constrained sequence stops on EOS even with ignore_eos.
        self.stop_ids = frozenset(sp.options.stop_token_ids) | (
            frozenset() if sp.ignore_eos and sp.constraint is None else frozenset(eos_token_ids))
        self.grammar: Future | None = None     # the compiled grammar, while it compiles
        # len(token_ids) at which it ends by length: max_tokens or max_model_len (Scheduler.add)
        self.end_len = self.prompt_len + self.max_tokens
        # a sampled token's Delta, less the token: the instance dict (once first scheduled)
        self.delta_proto: dict | None = None
        # speculative decoding: verify steps, drafts proposed, drafts accepted
        self.spec_drafts = self.spec_draft_tokens = self.spec_accepted = 0

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) + self.num_pending - self.num_computed


# Delta's fields with their defaults, in order (none has a validator, a converter or a
# factory: a Delta is its instance dict, as Delta.evolver relies on too).
_DELTA_DEFAULTS = {a.name: None if a.default is attrs.NOTHING else a.default
                   for a in attrs.fields(Delta)}
if any(isinstance(a.default, attrs.Factory) or a.validator or a.converter
       for a in attrs.fields(Delta)) or hasattr(Delta, "__attrs_post_init__"):
    raise TypeError("Delta needs its __init__ now: build schedule's deltas with it")
_new = object.__new__

# Likewise SeqChunk, one per sequence per step: slotted and frozen, its __init__ sets each
# field through a guarded object.__setattr__; _chunk sets the slots through their descriptors.
_set_seq_id, _set_token_ids, _set_start_pos, _set_block_table, _set_sample, _set_num_drafts = (
    SeqChunk.__dict__[a.name].__set__ for a in attrs.fields(SeqChunk))
if any(a.validator or a.converter for a in attrs.fields(SeqChunk)) or hasattr(
        SeqChunk, "__attrs_post_init__"):
    raise TypeError("SeqChunk needs its __init__ now: build _chunk's chunks with it")


def _delta_proto(seq: Sequence) -> dict:
    """The instance dict of a Delta for a token the sequence sampled, less the token: set
    once it is scheduled (num_cached_tokens and scheduled_at no longer change)."""
    seq.delta_proto = proto = dict(_DELTA_DEFAULTS, request_id=seq.req.request_id,
                                   num_cached_tokens=seq.num_cached_tokens,
                                   scheduled_at=seq.scheduled_at, index=seq.index)
    return proto


class SpecCounters:
    """Speculative decoding's totals since start (vLLM's spec_decode counters)."""

    def __init__(self, k: int) -> None:
        self.num_drafts = 0             # verify passes: sequences that carried drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k   # [i]: drafts accepted at position i

    def count(self, drafts: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafts
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1


def sampling_options(seq: Sequence) -> SamplingOptions:
    """The request's options, with EOS among the stop ids unless ignore_eos (min_tokens
    masks them all); choice i of a seeded request draws from seed + i."""
    opts = seq.req.sampling.options
    choice = seq.index % seq.req.n     # within its prompt
    seed = opts.seed if opts.seed is None or not choice else opts.seed + choice
    return attrs.evolve(opts, stop_token_ids=tuple(sorted(seq.stop_ids)), seed=seed)


class Scheduler:
    def __init__(self, blocks: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: tuple[int, ...],
                 grammars: GrammarCompiler | None = None,
                 think_ids: tuple[int, int] | None = None, drafter: Drafter | None = None,
                 num_speculative_tokens: int = 0,
                 spec_disable_by_batch_size: int | None = None) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.grammars = grammars
        self.think_ids = think_ids              # reasoning's <think>, </think>: constrain after
        self.compiling: list[Sequence] = []     # constrained, waiting for their grammar
        self.running: list[Sequence] = []
        self.by_id: dict[str, Sequence] = {}              # sequence id -> sequence
        self.choices: dict[str, list[Sequence]] = {}      # request id -> its live sequences
        self.step = 0
        self.num_preemptions = 0
        self.preempted: list[str] = []          # sequence ids preempted by the current step
        # /metrics (vLLM's iteration_tokens_total, request_num_preemptions): tokens computed
        # per step, and preemptions per request once it leaves (its choices' together)
        self.iteration_tokens = Histogram(ITERATION_BUCKETS)
        self.request_preemptions = Histogram(PREEMPTION_BUCKETS)
        self._preemptions_of: dict[str, int] = {}     # request id -> preemptions so far
        self._new_requests: list[RenderedRequest] = []
        self._pending: list[Delta] = []         # finishes decided outside a step (aborts)
        self._released: list[str] = []
        self._planned: dict[int, list[tuple[Sequence, int]]] = {}   # step -> (seq, epoch) per chunk
        # speculative decoding (stages/schedule/drafter.py): drafts for decodes, verified by the runner.
        # Drafts need the sequence's last token, so they are only made for a sequence with
        # no step in flight (the engine runs speculation without async scheduling).
        self.drafter = drafter if num_speculative_tokens > 0 else None
        self.num_speculative_tokens = num_speculative_tokens
        self.spec_disable_by_batch_size = spec_disable_by_batch_size
        self.spec = SpecCounters(num_speculative_tokens)

    # -- inbox ---------------------------------------------------------------------------
    def add(self, req: RenderedRequest) -> None:
        if req.request_id in self.choices:  # the engine keeps ids unique while in flight
            raise ValueError(f"request id {req.request_id!r} is already scheduled")
        seqs = []
        for i in range(req.num_choices):   # prompt i // n, its first choice leading
            seqs.append(Sequence(req, self.eos_token_ids, i,
                                 None if i % req.n == 0 else seqs[i - i % req.n]))
        self.choices[req.request_id] = seqs
        self._new_requests.append(req)
        constraint = req.sampling.constraint
        grammar = None
        if constraint is not None and self.grammars is not None:
            grammar = self.grammars.submit(constraint)   # every choice shares the grammar
        for seq in seqs:
            seq.end_len = min(seq.end_len, self.max_model_len)
            self.by_id[seq.id] = seq
            seq.grammar = grammar
            (self.waiting if grammar is None else self.compiling).append(seq)
        if constraint is not None and self.grammars is None:
            self.finish(req.request_id, FinishReason.ERROR,
                        "this server cannot constrain output (the model has no tokenizer)")

    def _admit_compiled(self) -> None:
        """Constrained sequences whose grammar is ready join the waiting queue (in order);
        a grammar that failed to compile fails its request."""
        ready, still = [], []
        for seq in self.compiling:
            (ready if seq.grammar.done() else still).append(seq)
        self.compiling = still
        self.waiting.extend(ready)
        for seq in ready:
            exc = seq.grammar.exception()
            if exc is not None and seq.req.request_id in self.choices:
                self.finish(seq.req.request_id, FinishReason.ERROR,
                            f"could not compile the grammar: {exc}")

    def finish(self, request_id: str, reason: FinishReason, error: str | None = None,
               index: int | None = None) -> None:
        """Abort (every choice) or a stop string (one choice, `index`): free now, report
        downstream with the next step."""
        for seq in list(self.choices.get(request_id, ())):
            if index is None or seq.index == index:
                if seq in self.running:
                    self.running.remove(seq)
                elif seq in self.compiling:
                    self.compiling.remove(seq)
                else:
                    self.waiting.remove(seq)
                self._retire(seq)
                self._pending.append(Delta(request_id, finish_reason=reason,
                                           num_cached_tokens=seq.num_cached_tokens,
                                           error=error, scheduled_at=seq.scheduled_at,
                                           index=seq.index))

    def _retire(self, seq: Sequence) -> None:
        """A finished sequence: its blocks freed, the GPU told, the bookkeeping dropped."""
        seq.retired = True
        del self.by_id[seq.id]
        live = self.choices[seq.req.request_id]
        live.remove(seq)
        if not live:
            del self.choices[seq.req.request_id]
            self.request_preemptions.observe(self._preemptions_of.pop(seq.req.request_id, 0))
        self._free(seq)
        self._released.append(seq.id)
        if self.drafter is not None:
            self.drafter.forget(seq.id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._pending or self._new_requests
                    or self._released or self.compiling)

    # -- planning ------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        self.step += 1
        if self.preempted:
            self.preempted = []
        if self.compiling:
            self._admit_compiled()
        budget = self.max_num_batched_tokens
        bs = self.blocks.block_size
        chunks: list[SeqChunk] = []
        planned: list[tuple[Sequence, int]] = []    # (seq, epoch) of each chunk
        new_seqs: list[SeqStart] = []

        # Running sequences first, oldest first; preempt from the newest end when short.
        # (Every sequence, every step: Sequence's properties are inlined, and _grow is
        # called only when the chunk needs another block.)
        running = self.running
        drafter = self.drafter
        if drafter is not None and (self.spec_disable_by_batch_size is not None and
                                    len(running) >= self.spec_disable_by_batch_size):
            drafter = None      # a batch this large is compute-bound: verifying costs real work
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            total = len(seq.token_ids) + seq.num_pending
            if seq.num_pending and total >= seq.end_len:
                i += 1      # finishes with the token on its way (max_tokens, max_model_len)
                continue
            n = total - seq.num_computed        # seq.num_uncomputed
            if n > budget:
                n = budget
            if n <= 0:
                i += 1
                continue
            if n == 1 and drafter is not None and not seq.num_pending and seq.grammar is None:
                # at most K, what max_tokens / max_model_len leave after the bonus token,
                # and the step's token budget
                k = min(self.num_speculative_tokens, seq.end_len - total - 1, budget - 1)
                drafts = drafter.propose(seq.id, seq.token_ids, k) if k > 0 else ()
                if drafts and (seq.num_computed + 1 + len(drafts) <= len(seq.table) * bs
                               or self._grow(seq, 1 + len(drafts))):
                    chunks.append(self._draft_chunk(seq, drafts))
                    planned.append((seq, seq.epoch))
                    budget -= 1 + len(drafts)
                    i += 1
                    continue
            if seq.num_computed + n > len(seq.table) * bs and not self._grow(seq, n):
                victim = running[-1]
                self._unplan(chunks, planned, victim)
                self._preempt(victim)
                if victim is seq:
                    break
                continue
            chunks.append(self._chunk(seq, n))
            planned.append((seq, seq.epoch))
            budget -= n
            i += 1

        # Then waiting sequences, in arrival order, while the budgets allow.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending:
                break   # preempted with a step in flight: restart once its token is known
            leader = seq.leader
            if (leader is not None and leader in self.running
                    and leader.num_done < leader.prompt_len):
                break   # its prompt's blocks are being computed: take them next step
            if not seq.table and not self._take_prefix(seq, budget):
                break
            n = min(seq.num_uncomputed, budget)
            if not self._grow(seq, n):
                if not self.running:
                    raise RuntimeError("KV cache too small for a single sequence's chunk")
                break
            self.waiting.popleft()
            self.running.append(seq)
            if not seq.first_scheduled:
                seq.first_scheduled = True
                seq.scheduled_at = time.monotonic()
                new_seqs.append(self._start(seq))
            chunks.append(self._chunk(seq, n))
            planned.append((seq, seq.epoch))
            budget -= n

        released, self._released = tuple(self._released), []
        if chunks:
            self._planned[self.step] = planned
        sliding = self.blocks.sliding
        return StepPlan(self.step, tuple(chunks), tuple(new_seqs), released,
                        sliding.drain_updates() if sliding is not None else ())

    @staticmethod
    def _unplan(chunks: list[SeqChunk], planned: list[tuple[Sequence, int]],
                seq: Sequence) -> None:
        """Take the sequence's chunk planned in this step, if any, back out (it is being
        preempted)."""
        for k, (s, _) in enumerate(planned):
            if s is seq:
                del planned[k]
                if chunks.pop(k).sample:
                    seq.num_pending -= 1
                return

    def _start(self, seq: Sequence) -> SeqStart:
        prompt = tuple(seq.token_ids[:seq.prompt_len])
        if seq.grammar is None:
            return SeqStart(seq.id, prompt, sampling_options(seq),
                            prompt_logprobs=seq.prompt_logprobs)
        think, thinking = self.think_ids, False
        if think is not None:   # does the prompt leave a <think> open (deepseek_r1 style)?
            last = {t: i for i, t in enumerate(prompt) if t in think}
            thinking = last.get(think[0], -1) > last.get(think[1], -1)
        return SeqStart(seq.id, prompt, sampling_options(seq), seq.grammar.result(), think,
                        thinking, prompt_logprobs=seq.prompt_logprobs)

    def _take_prefix(self, seq: Sequence, budget: int) -> bool:
        """Attach cached prefix blocks to a sequence about to start (or restart), if the
        blocks for its first chunk fit as well."""
        bm = self.blocks
        if seq.prompt_logprobs is not None and not seq.num_output:
            # as vLLM: every prompt position is computed (a restart after preemption too,
            # until they are all reported: others may have cached more of the prompt)
            hits, last_hash = [], seq.hash_root
        else:
            hits, last_hash = bm.match_prefix(seq.token_ids, seq.hash_root)
        cached = len(hits) * bm.block_size
        n = min(len(seq.token_ids) - cached, budget)
        if not bm.can_take(hits, bm.blocks_for(cached + n) - len(hits)):
            return False
        seq.passed = bm.take_cached(hits)
        seq.table = list(hits)
        seq.table_t = tuple(hits)
        seq.num_computed = seq.num_done = cached
        seq.hash_cursor = (len(hits), last_hash)
        if not seq.first_scheduled:
            seq.num_cached_tokens = cached
        return True

    def _chunk(self, seq: Sequence, n: int) -> SeqChunk:
        """Plan n tokens of the sequence: they count as computed from now on; a chunk that
        ends at the sequence's end samples, and its token is pending until update."""
        start = seq.num_computed
        known = len(seq.token_ids)
        end = start + n
        if end <= known:
            tokens = tuple(seq.token_ids[start:end])
        elif start >= known:  # all on its way from the running step (an async decode)
            tokens = _PLACEHOLDER if n == 1 else (PLACEHOLDER,) * n
        else:                # the last token is still on its way from the running step
            tokens = tuple(seq.token_ids[start:end]) + (PLACEHOLDER,) * (end - known)
        last = end == known + seq.num_pending
        seq.num_computed = end
        if last:
            seq.num_pending += 1
        chunk = _new(SeqChunk)    # SeqChunk(seq.id, tokens, start, seq.table_t, last)
        _set_seq_id(chunk, seq.id)
        _set_token_ids(chunk, tokens)
        _set_start_pos(chunk, start)
        _set_block_table(chunk, seq.table_t)
        _set_sample(chunk, last)
        _set_num_drafts(chunk, 0)
        return chunk

    def _draft_chunk(self, seq: Sequence, drafts: tuple[int, ...]) -> SeqChunk:
        """Plan a decode with drafts: the last token and the drafts, all sampled; the drafts
        count as computed until the result says which were accepted (update rolls back)."""
        start = seq.num_computed
        tokens = (seq.token_ids[-1], *drafts)
        seq.num_computed = start + len(tokens)
        seq.num_pending += 1
        return SeqChunk(seq.id, tokens, start, seq.table_t, True, len(drafts))

    def _rollback(self, seq: Sequence, done: int) -> None:
        """A verified chunk kept the KV of `done` tokens: the rejected drafts' positions
        are computed again (overwritten), and the blocks that hold nothing but rejected
        positions past the next token's are freed (they never got a hash)."""
        seq.num_computed = done
        keep = self.blocks.blocks_for(done + 1)
        if len(seq.table) > keep:
            tail = seq.table[keep:]
            del seq.table[keep:]
            seq.table_t = tuple(seq.table)
            self.blocks.release(tail)

    def _grow(self, seq: Sequence, n: int) -> bool:
        need = self.blocks.blocks_for(seq.num_computed + n) - len(seq.table)
        if need <= 0:
            return True
        if not self.blocks.can_allocate(need):
            return False
        seq.table.extend(self.blocks.allocate(need))
        seq.table_t = tuple(seq.table)
        return True

    def _free(self, seq: Sequence) -> None:
        self.blocks.release(seq.table, seq.passed)
        seq.passed = 0
        seq.table = []
        seq.table_t = ()
        seq.num_computed = seq.num_done = 0
        seq.hash_cursor = (0, seq.hash_root)
        seq.epoch += 1       # a step in flight for it no longer speaks for these blocks

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        self.preempted.append(seq.id)
        rid = seq.req.request_id
        self._preemptions_of[rid] = self._preemptions_of.get(rid, 0) + 1

    # -- results -------------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult) -> Step:
        """Apply a step's result; decide finishes; build the downstream message."""
        planned = self._planned.pop(plan.step, ())
        if result.error is not None:
            for seq, _ in planned:
                if not seq.retired:
                    self.finish(seq.req.request_id, FinishReason.ERROR, result.error)
            return self.drain()
        if plan.chunks:
            self.iteration_tokens.observe(sum(len(c.token_ids) for c in plan.chunks))
        for pl in result.prompt_logprobs:
            seq = self.by_id.get(pl.seq_id)
            if seq is not None:
                seq.prompt_logprobs_so_far.extend(pl.entries)
        deltas = list(self._pending)
        self._pending = []
        if result.num_tokens:      # verified drafts: several tokens per sequence
            return self._update_verified(plan, result, planned, deltas)
        sampled = dict(zip(result.seq_ids, result.token_ids))
        logprobs = dict(zip(result.seq_ids, result.logprobs)) if result.logprobs else None
        bs = self.blocks.block_size
        # a block to hash only once one fills (commit_full_blocks is a no-op until then)
        commit = self.blocks.commit_full_blocks if self.blocks.prefix_caching else None
        sliding = self.blocks.sliding
        for chunk, (seq, epoch) in zip(plan.chunks, planned):
            if seq.retired:
                continue    # finished while this step ran: its row is thrown away
            tok = sampled.get(seq.id) if chunk.sample else None
            if tok is not None:
                seq.num_pending -= 1
                seq.token_ids.append(tok)
            if epoch == seq.epoch:   # not preempted since: these blocks now hold the chunk's KV
                seq.num_done = done = chunk.start_pos + len(chunk.token_ids)
                if commit is not None and done // bs > seq.hash_cursor[0]:
                    seq.hash_cursor = commit(seq.table, seq.token_ids, done, *seq.hash_cursor)
                if sliding is not None:     # next query at `done`: free the halves behind its window
                    seq.passed = self.blocks.pass_window(seq.table, seq.passed, done)
            if tok is None:
                continue
            prompt_logprobs = ()
            if (seq.prompt_logprobs is not None
                    and len(seq.token_ids) - seq.prompt_len == 1):   # the first token
                # none for the first prompt token
                prompt_logprobs = (None, *seq.prompt_logprobs_so_far)
                seq.prompt_logprobs_so_far = []
            if seq.max_tokens == 0:
                deltas.append(self._end_echo_only(seq, epoch, prompt_logprobs))
                continue
            reason = stop = None
            if tok in seq.stop_ids:  # the sampler masks stop ids until min_tokens
                reason = FinishReason.STOP
                stop = tok if tok in seq.req.sampling.options.stop_token_ids else None
            elif len(seq.token_ids) >= seq.end_len:    # max_tokens or max_model_len
                reason = FinishReason.LENGTH
            # Delta(request_id, (tok,), reason, stop, num_cached_tokens, token_logprobs=...,
            # scheduled_at=..., index=..., prompt_token_logprobs=...), built as one dict
            # copy from the sequence's prototype instead of an assignment per field
            delta = _new(Delta)
            fields = delta.__dict__
            fields.update(seq.delta_proto or _delta_proto(seq))
            fields["token_ids"] = (tok,)
            if reason is not None:
                fields["finish_reason"] = reason
                fields["stop_reason"] = stop
            if logprobs is not None:
                lp = logprobs.get(seq.id)
                if lp is not None:
                    fields["token_logprobs"] = (lp,)
            if prompt_logprobs:
                fields["prompt_token_logprobs"] = prompt_logprobs
            deltas.append(delta)
            if reason is not None:
                if epoch == seq.epoch:
                    self.running.remove(seq)
                else:               # preempted while its last step ran
                    self.waiting.remove(seq)
                self._retire(seq)
        return self._step(plan.step, deltas)

    def _update_verified(self, plan: StepPlan, result: StepResult,
                         planned: list[tuple[Sequence, int]], deltas: list[Delta]) -> Step:
        """update for a step that verified drafts (result.num_tokens): each sequence may
        get several tokens, which a stop token, EOS or the length limit cuts; the rejected
        drafts' KV is rolled back, and only the kept tokens' blocks are hashed. `deltas`:
        the pending ones, to which the step's are added."""
        got: dict[str, tuple[tuple[int, ...], tuple]] = {}
        at = 0
        for sid, n in zip(result.seq_ids, result.num_tokens):
            got[sid] = (result.token_ids[at:at + n], result.logprobs[at:at + n] if result.logprobs else ())
            at += n
        bm = self.blocks
        spec = self.spec
        for chunk, (seq, epoch) in zip(plan.chunks, planned):
            if seq.retired:
                continue
            toks, lps = got.get(seq.id, ((), ())) if chunk.sample else ((), ())
            if chunk.num_drafts:
                spec.count(chunk.num_drafts, len(toks) - 1)
                seq.spec_drafts += 1
                seq.spec_draft_tokens += chunk.num_drafts
                seq.spec_accepted += len(toks) - 1
            kept: list[int] = []
            reason = stop = None
            for tok in toks:
                kept.append(tok)
                seq.token_ids.append(tok)
                if tok in seq.stop_ids:
                    reason = FinishReason.STOP
                    stop = tok if tok in seq.req.sampling.options.stop_token_ids else None
                    break
                if len(seq.token_ids) >= seq.end_len:
                    reason = FinishReason.LENGTH
                    break
            if toks:
                seq.num_pending -= 1
            if epoch == seq.epoch:
                if chunk.num_drafts:
                    done = chunk.start_pos + len(kept)
                    self._rollback(seq, done)
                else:
                    done = chunk.start_pos + len(chunk.token_ids)
                seq.num_done = done
                if bm.prefix_caching and done // bm.block_size > seq.hash_cursor[0]:
                    seq.hash_cursor = bm.commit_full_blocks(seq.table, seq.token_ids, done,
                                                            *seq.hash_cursor)
                if bm.sliding is not None:
                    seq.passed = bm.pass_window(seq.table, seq.passed, done)
            if not kept:
                continue
            prompt_logprobs = ()
            if seq.prompt_logprobs is not None and seq.num_output == len(kept):   # the first
                prompt_logprobs = (None, *seq.prompt_logprobs_so_far)
                seq.prompt_logprobs_so_far = []
            if seq.max_tokens == 0:
                deltas.append(self._end_echo_only(seq, epoch, prompt_logprobs))
                continue
            token_logprobs = ()
            if lps and all(lp is not None for lp in lps[:len(kept)]):
                token_logprobs = tuple(lps[:len(kept)])
            deltas.append(Delta(seq.req.request_id, tuple(kept), reason, stop,
                                seq.num_cached_tokens, token_logprobs=token_logprobs,
                                scheduled_at=seq.scheduled_at, index=seq.index,
                                prompt_token_logprobs=prompt_logprobs,
                                draft_tokens=chunk.num_drafts,
                                accepted_tokens=len(toks) - 1 if chunk.num_drafts else 0))
            if reason is not None:
                (self.running if epoch == seq.epoch else self.waiting).remove(seq)
                self._retire(seq)
        return self._step(plan.step, deltas)

    def drain(self) -> Step:
        """A message for a step with nothing to run: new requests and pending finishes."""
        deltas, self._pending = self._pending, []
        return self._step(self.step, deltas)

    def _step(self, step: int, deltas: list[Delta]) -> Step:
        """The step's message: the requests admitted since the last, its deltas, the load."""
        new, self._new_requests = tuple(self._new_requests), []
        return Step(step, new, tuple(deltas), len(self.running), len(self.waiting),
                    self.blocks.num_used, time.monotonic())

    def _end_echo_only(self, seq: Sequence, epoch: int, prompt_logprobs: tuple) -> Delta:
        """Echo alone (completions max_tokens 0): the prompt was computed for its logprobs;
        the token sampled after it is not part of the reply. The sequence is retired; its
        last delta (no tokens, LENGTH) is returned."""
        seq.token_ids.pop()
        delta = Delta(seq.req.request_id, (), FinishReason.LENGTH, None,
                      seq.num_cached_tokens, scheduled_at=seq.scheduled_at,
                      index=seq.index, prompt_token_logprobs=prompt_logprobs)
        (self.running if epoch == seq.epoch else self.waiting).remove(seq)
        self._retire(seq)
        return delta


# -- the async shell -----------------------------------------------------------------------
async def run(inbox: trio.MemoryReceiveChannel, to_gpu: trio.MemorySendChannel,
              from_gpu: trio.MemoryReceiveChannel, downstream: trio.MemorySendChannel,
              scheduler: Scheduler, log=None, *, async_scheduling: bool = False) -> None:
    """Engine loop: take everything in the inbox, plan, run one step, forward the result.

    With async_scheduling the next step is planned and sent while the current one runs
    (as vLLM's async scheduling): a sequence sampled by the running step is fed its token
    as a PLACEHOLDER that the runner fills in, so the GPU never waits for the host's
    update, detokenize..emit or the next plan. Results come back in plan order."""
    depth = 2 if async_scheduling else 1
    inflight: deque[tuple[StepPlan, tuple[str, ...]]] = deque()   # plans sent, their preemptions

    def take(msg) -> None:
        if isinstance(msg, RenderedRequest):
            scheduler.add(msg)
        elif isinstance(msg, Abort):
            if msg.error is None:
                scheduler.finish(msg.request_id, FinishReason.ABORT)
            else:
                scheduler.finish(msg.request_id, FinishReason.ERROR, msg.error)
        elif isinstance(msg, FinishRequest):
            scheduler.finish(msg.request_id, FinishReason.STOP, index=msg.index)
        else:
            raise TypeError(f"schedule got {type(msg).__name__}")

    async def forward(plan: StepPlan | None, preempted: tuple[str, ...], out: Step) -> None:
        if log is not None and plan is not None and (out.new_requests or out.deltas
                                                     or plan.chunks or preempted):
            # the whole message: enough to replay everything downstream
            log("scheduled", plan=plan, preempted=preempted, message=out)
        if out.new_requests or out.deltas:
            await downstream.send(out)

    # A step's result, applied but not yet passed on: the next plan goes to the GPU first,
    # so the runner never waits behind detokenize..emit taking their turn in the loop.
    applied: tuple[StepPlan, tuple[str, ...], Step] | None = None
    async with inbox, to_gpu, downstream:
        while True:
            if not scheduler.has_work() and not inflight and applied is None:
                try:
                    take(await inbox.receive())
                except trio.EndOfChannel:
                    return
            while True:
                try:
                    take(inbox.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            plan = None
            if len(inflight) < depth and scheduler.has_work():
                plan = scheduler.schedule()
                # kv_updates alone too: a chunk taken back by a preemption keeps its block's slot
                if plan.chunks or plan.new_seqs or plan.released or plan.kv_updates:
                    await to_gpu.send(plan)
                    inflight.append((plan, tuple(scheduler.preempted)))
                    if len(inflight) < depth and applied is None:
                        continue        # plan the next step while this one runs
            if applied is not None:
                await forward(*applied)
                applied = None
            if inflight:
                done, preempted = inflight.popleft()
                applied = (done, preempted, scheduler.update(done, await from_gpu.receive()))
                continue
            out = scheduler.drain()
            await forward(plan, tuple(scheduler.preempted) if plan is not None else (), out)
            if not (out.new_requests or out.deltas) and plan is not None and not plan.chunks:
                # waiting on blocks freed by nothing, or on a grammar compiling in its
                # worker thread: let others run
                await trio.sleep(0.001 if scheduler.compiling else 0)
