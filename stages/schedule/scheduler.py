"""The scheduler's pure core: waiting/running queues, the KV block manager, prefix hashes.

Each step it builds a StepPlan under a token budget (--max-num-batched-tokens) and a
sequence budget (--max-num-seqs): running sequences first (one decode token each, or the
next chunk of a chunked prefill), then waiting ones. When blocks run out it preempts the
most recently admitted running sequence by recompute: its blocks are freed and it goes
back to the front of the waiting queue, keeping the tokens it already generated.

`Scheduler` plans a step only once the one before has come back; `AsyncScheduler`
(async_.py) plans one ahead. The stop rule is stop.py's, speculative decoding's choices
spec.py's, the blocks (and the hybrid cache's sliding halves) blocks.py's.
"""
from __future__ import annotations

import time
from collections import deque

from concurrent.futures import Future

from gpu.interface import (ConstraintCompiler, SeqChunk, SeqStart, StepPlan,
                           StepResult)
from stages.delta import Delta, FinishReason
from stages.histogram import ITERATION_BUCKETS, PREEMPTION_BUCKETS, Histogram
from stages.kv_transfer import KVTransferConfig
from stages.messages import RenderedRequest, Step
from stages.schedule.beam import BeamGroup
from stages.schedule.blocks import BlockManager, image_block_keys
from stages.schedule.drafter import Drafter
from stages.schedule.beam_side import BeamSearch
from stages.schedule.kv import KVConnectorSide
from stages.schedule.rows import apply_rows
from stages.schedule.priority import POLICIES, enqueue, order_key, victim_for, worst_running
from stages.schedule.sequence import Sequence, sampling_options
from stages.schedule.spec import CostGate, SpecCounters, Speculation, step_outputs
from stages.schedule.spec_side import SpecPlanning
from stages.schedule.state_slots import StateSlots
from stages.schedule.stop import tokens_left

class Scheduler:
    # steps it may have planned whose results have not come back (the schedule stage's depth)
    max_in_flight = 1
    # AsyncScheduler with runner-filled floating chunks, which defines _float_chunk
    # (async_.py): the plain Scheduler never plans with a step in flight
    floating = False

    def __init__(self, blocks: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: tuple[int, ...],
                 grammars: ConstraintCompiler | None = None,
                 think_ids: tuple[int, int] | None = None, drafter: Drafter | None = None,
                 num_speculative_tokens: int = 0,
                 spec_disable_by_batch_size: int | None = None, spec_draft_cost: float | None = None,
                 policy: str = "fcfs", max_loras: int = 1, spec_adaptive: bool = False,
                 kv_transfer: KVTransferConfig | None = None, kv_port: int | None = None,
                 kv_tp_size: int = 1, state_slots: StateSlots | None = None) -> None:
        """kv_port, kv_tp_size: the KV connector's side channel port (default: the flag's) and
        the engine's TP size; state_slots: a hybrid model's state slots (state_slots.py)."""
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy {policy!r} is not one of {', '.join(POLICIES)}")
        self.blocks, self.state_slots = blocks, state_slots    # and a hybrid model's state slots
        self.max_loras = max_loras      # distinct LoRA adapters among the running sequences
        # fcfs: arrival order; priority: a request's priority (lower first), then arrival
        # (priority.py); the waiting queue is kept in that order, and preemption takes the
        # running sequence that comes last in it
        self.priority = policy == "priority"
        self._arrivals = 0
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
        # /metrics (vLLM's iteration_tokens_total, request_num_preemptions): per step, as
        # vLLM counts it, the prompt of each sequence whose first token the step brought
        # plus the tokens it generated (not the tokens fed: 10 requests of 9 prompt tokens
        # and 10 generated are 190, not 180); preemptions per request once it leaves
        # (its choices' together)
        self.iteration_tokens = Histogram(ITERATION_BUCKETS)
        self.request_preemptions = Histogram(PREEMPTION_BUCKETS)
        self._preemptions_of: dict[str, int] = {}     # request id -> preemptions so far
        self._new_requests: list[RenderedRequest] = []
        self._pending: list[Delta] = []         # finishes decided outside a step (aborts)
        self._released: list[str] = []
        self._planned: dict[int, list[tuple[Sequence, int]]] = {}   # step -> (seq, epoch) per chunk
        self.beam_search = BeamSearch(self)     # beam search (beam_side.py), called at named hooks
        self.spec_planning = SpecPlanning(self)   # drafts planned into a step (spec_side.py)
        # speculative decoding (spec.py): drafts for decodes, verified by the runner
        self.drafter = drafter if num_speculative_tokens > 0 else None
        self.spec = SpecCounters(num_speculative_tokens)
        self.speculation = (None if self.drafter is None else Speculation(
            self.drafter, num_speculative_tokens, spec_disable_by_batch_size, self.spec,
            CostGate() if spec_adaptive else None, spec_draft_cost))
        # the KV connector's holds and reads (issue 36; kv.py), called at named hooks
        self.kv = KVConnectorSide(kv_transfer, blocks, kv_port, kv_tp_size)

    # -- inbox ---------------------------------------------------------------------------
    def add(self, req: RenderedRequest) -> None:
        if req.request_id in self.choices:  # the engine keeps ids unique while in flight
            raise ValueError(f"request id {req.request_id!r} is already scheduled")
        seqs: list[Sequence] = []
        if req.sampling.beam_width:
            seqs = self.beam_search.start(req)
        else:
            for i in range(req.num_choices):   # prompt i // n, its first choice leading
                seqs.append(Sequence(req, self.eos_token_ids, self.max_model_len, i,
                                     None if i % req.n == 0 else seqs[i - i % req.n]))
        self.choices[req.request_id] = seqs
        self._arrivals += 1
        for seq in seqs:
            seq.order = order_key(req, self._arrivals, seq.index)
        self._new_requests.append(req)
        constraint = req.sampling.constraint
        grammar = None
        if constraint is not None and self.grammars is not None:
            grammar = self.grammars.submit(constraint)   # every choice shares the grammar
        keys = image_block_keys(req.images, self.blocks.block_size) if req.images else None
        for seq in seqs:
            self.by_id[seq.id] = seq
            seq.grammar = grammar
            seq.block_keys = keys
            if grammar is not None:
                self.compiling.append(seq)
            elif self.priority:
                enqueue(self.waiting, seq)
            else:
                self.waiting.append(seq)
        if constraint is not None and self.grammars is None:
            self.finish(req.request_id, FinishReason.ERROR,
                        "this server cannot constrain output (the model has no tokenizer)")
        elif req.sampling.beam_width and self.blocks.sliding is not None:
            self.finish(req.request_id, FinishReason.ERROR,
                        "use_beam_search: not served with a sliding-window hybrid KV cache "
                        "(its beams could not share their blocks)")
        elif req.sampling.beam_width and self.state_slots is not None:   # (its states would fork)
            self.finish(req.request_id, FinishReason.ERROR, "use_beam_search: not served for a hybrid model")
        elif req.sampling.options.thinking_token_budget is not None and self.think_ids is None:
            self.finish(req.request_id, FinishReason.ERROR,
                        "thinking_token_budget: this tokenizer's <think> and </think> are not "
                        "single tokens")

    def grammars_compiling(self) -> set[Future]:
        """The grammars that constrained sequences wait for, still compiling: the schedule
        stage wakes when one is done."""
        return {seq.grammar for seq in self.compiling if not seq.grammar.done()}

    def _admit_compiled(self) -> None:
        """Constrained sequences whose grammar is ready join the waiting queue (in order);
        a grammar that failed to compile fails its request."""
        ready, still = [], []
        for seq in self.compiling:
            (ready if seq.grammar.done() else still).append(seq)
        self.compiling = still
        for seq in ready:
            if self.priority:
                enqueue(self.waiting, seq)
            else:
                self.waiting.append(seq)
        for seq in ready:
            exc = seq.grammar.exception()
            if exc is not None and seq.req.request_id in self.choices:
                self.finish(seq.req.request_id, FinishReason.ERROR,
                            f"could not compile the grammar: {exc}")

    def finish(self, request_id: str, reason: FinishReason, error: str | None = None,
               index: int | None = None) -> None:
        """Abort (every choice) or a stop string (one choice, `index`): free now, report
        downstream with the next step."""
        groups = self.beam_search.groups.get(request_id)
        if groups is not None:      # beam search: every live beam, and a delta per choice
            if index is not None:
                return              # (no stop strings: render refuses them with beams)
            first = groups[0].first
            for seq in list(self.choices.get(request_id, ())):
                self.beam_search.drop(seq)
            for g in groups:
                if not g.emitted:
                    g.emitted = True
                    self._pending.extend(
                        Delta(request_id, finish_reason=reason, error=error,
                              num_cached_tokens=first.num_cached_tokens,
                              scheduled_at=first.scheduled_at, index=g.choice0 + k)
                        for k in range(g.width))
            self.beam_search.groups.pop(request_id, None)
            return
        for seq in list(self.choices.get(request_id, ())):
            if index is None or seq.index == index:
                if seq in self.running:
                    self.running.remove(seq)
                elif seq in self.compiling:
                    self.compiling.remove(seq)
                elif self.kv.abandon(seq):       # its read may still write into its blocks
                    seq.table, seq.table_t = [], ()
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
        if self.speculation is not None:
            self.speculation.forget(seq.id)

    def reset_prefix_cache(self, reset_running: bool = False) -> bool:
        """Forget every cached prefix block (and state snapshot), as vLLM's reset_prefix_cache:
        refused (False) while sequences hold blocks, unless `reset_running` preempts them first."""
        if reset_running:
            for seq in list(self.running):
                self._preempt(seq)
            for seq in self.waiting:
                if seq.table:       # took its prefix but could not grow: let go of it
                    self._free(seq)
        if (done := self.blocks.reset_prefix_cache()) and self.state_slots is not None:
            self.state_slots.reset()
        return done

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._pending or self._new_requests
                    or self._released or self.compiling or self.kv.busy)

    def may_plan_ahead(self) -> bool:
        """Whether the next step may be planned while one runs (AsyncScheduler's question;
        one step at a time here)."""
        return False

    # -- planning ------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        if len(self._planned) >= self.max_in_flight:
            raise RuntimeError(f"{type(self).__name__} plans at most {self.max_in_flight} "
                               "step(s) ahead of the results")
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

        # Running sequences first, oldest first; preempt from the newest end when short
        # (Sequence's properties inlined: every sequence, every step).
        running = self.running
        spec = self.speculation
        if spec is not None and not spec.on_for(running, lambda: self.spec_planning.decodes_only(running)):
            spec = None
        i = 0
        floating = self.floating
        while i < len(running) and budget > 0:
            seq = running[i]
            total = len(seq.token_ids) + seq.num_pending
            if floating:     # a verify pass in flight: as if its drafts all hold (async_.py)
                total += seq.in_flight_drafts
            if seq.num_pending and (seq.beam is not None or tokens_left(seq, total) <= 0):
                i += 1      # ends with the token on its way (max_tokens, max_model_len),
                continue    # or a beam: its next token is chosen once its row is back
            n = total - seq.num_computed        # seq.num_uncomputed
            if n > budget:
                n = budget
            if n <= 0:
                i += 1
                continue
            if n == 1 and spec is not None and seq.beam is None:
                chunk = self.spec_planning.drafted_chunk(seq, spec, budget)
                if chunk is not None:
                    chunks.append(chunk)
                    planned.append((seq, seq.epoch))
                    budget -= len(chunk.token_ids)
                    i += 1
                    continue
            if seq.num_computed + n > len(seq.table) * bs and not self._grow(seq, n):
                victim = worst_running(running) if self.priority else running[-1]
                at = running.index(victim) if self.priority else len(running) - 1
                taken = self._unplan(chunks, planned, victim)
                if taken is not None:
                    budget += len(taken.token_ids)
                if at < i:
                    i -= 1      # it came before this one: the list shifts left
                self._preempt(victim)
                if victim is seq:
                    break
                continue
            chunks.append(self._chunk(seq, n if self.state_slots is None else self.state_slots.cut(seq, n)))
            planned.append((seq, seq.epoch))
            budget -= n
            i += 1

        # A beam search wider than --max-num-seqs: an idle beam makes room for a waiting one.
        if self.beam_search and self.waiting and len(self.running) >= self.max_num_seqs:
            budget += self.beam_search.preempt_idle(chunks, planned) or 0
        # Then waiting sequences, in arrival order, while the budgets allow.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending:
                break   # preempted with a step in flight: restart once its token is known
            leader = seq.leader
            if (leader is not None and leader in self.running
                    and leader.num_done < leader.prompt_len):
                break   # its prompt's blocks are being computed: take them next step
            if seq.req.lora is not None and self._lora_full(seq.req.lora.id):
                break   # --max-loras adapters run already: it waits for one of them to end
            if seq.remote_prefill is not None:      # its KV comes from the prefill instance
                if not self.kv.start_remote_prefill(self, seq):
                    break
                if seq.id in self.kv.receiving:
                    seq.first_scheduled = True
                    seq.scheduled_at = time.monotonic()
                    new_seqs.append(self._start(seq))
                continue
            if not seq.table and not self._take_prefix(seq, budget):
                if self.priority and (freed := self._preempt_for(seq, chunks, planned)) is not None:
                    budget += freed
                    continue
                if self.beam_search and (freed := self.beam_search.preempt_idle(chunks, planned)) is not None:
                    budget += freed
                    continue
                break
            n = min(seq.num_uncomputed, budget)
            if not self._grow(seq, n):
                if self.beam_search and (freed := self.beam_search.preempt_idle(chunks, planned)) is not None:
                    budget += freed
                    continue
                if not self.running:
                    raise RuntimeError("KV cache too small for a single sequence's chunk")
                if self.priority and (freed := self._preempt_for(seq, chunks, planned)) is not None:
                    budget += freed
                    continue
                break
            self.waiting.popleft()
            self.running.append(seq)
            if not seq.first_scheduled:
                seq.first_scheduled = True
                seq.scheduled_at = time.monotonic()
                new_seqs.append(self._start(seq))
            chunks.append(self._chunk(seq, n if self.state_slots is None else self.state_slots.cut(seq, n)))
            planned.append((seq, seq.epoch))
            budget -= n

        released, self._released = tuple(self._released), []
        if chunks:
            self._planned[self.step] = planned
            chunks = chunks if self.state_slots is None else self.state_slots.stamp(chunks, planned)
        sliding = self.blocks.sliding
        return StepPlan(self.step, tuple(chunks), tuple(new_seqs), released,
                        sliding.drain_updates() if sliding is not None else (),
                        self.kv.take_reads(), self.kv.busy)

    def _preempt_for(self, seq: Sequence, chunks: list[SeqChunk],
                     planned: list[tuple[Sequence, int]]) -> int | None:
        """Priority scheduling: a waiting sequence short of blocks preempts the running
        sequence that comes last in priority order, if that one comes after it. None when
        none does; else the budget its chunk planned in this step gives back."""
        victim = victim_for(seq, self.running)
        if victim is None:
            return None
        taken = self._unplan(chunks, planned, victim)
        self._preempt(victim)
        return 0 if taken is None else len(taken.token_ids)

    def _unplan(self, chunks: list[SeqChunk], planned: list[tuple[Sequence, int]],
                seq: Sequence) -> SeqChunk | None:
        """Take the sequence's chunk planned in this step, if any, back out (it is being
        preempted); the chunk taken out."""
        for k, (s, _) in enumerate(planned):
            if s is seq:
                del planned[k]
                chunk = chunks.pop(k)
                seq.in_flight_tokens -= len(chunk.token_ids)
                seq.in_flight_drafts -= chunk.num_drafts
                return chunk
        return None

    def _lora_full(self, lora_id: int) -> bool:
        """The running sequences use max_loras distinct adapters, lora_id not among them
        (every step plans only running sequences: no step mixes more than max_loras)."""
        ids = {s.req.lora.id for s in self.running if s.req.lora is not None}
        return lora_id not in ids and len(ids) >= self.max_loras

    def _start(self, seq: Sequence) -> SeqStart:
        prompt = tuple(seq.token_ids[:seq.prompt_len])
        if seq.grammar is None and seq.req.sampling.options.thinking_token_budget is None:
            return SeqStart(seq.id, prompt, sampling_options(seq),
                            prompt_logprobs=seq.prompt_logprobs, images=seq.req.images,
                            lora=seq.req.lora)
        think, thinking = self.think_ids, False
        if think is not None:   # does the prompt leave a <think> open (deepseek_r1 style)?
            last = {t: i for i, t in enumerate(prompt) if t in think}
            thinking = last.get(think[0], -1) > last.get(think[1], -1)
        return SeqStart(seq.id, prompt, sampling_options(seq),
                        None if seq.grammar is None else seq.grammar.result(), think,
                        thinking, prompt_logprobs=seq.prompt_logprobs, images=seq.req.images,
                        lora=seq.req.lora)

    def _take_prefix(self, seq: Sequence, budget: int) -> bool:
        """Attach cached prefix blocks to a sequence about to start (or restart), if the
        blocks for its first chunk fit as well."""
        bm = self.blocks
        # prompt logprobs, as vLLM: every prompt position is computed (a restart after
        # preemption too, until they are all reported: others may have cached more of it)
        hits, last_hash = [], seq.hash_root
        if seq.prompt_logprobs is None or seq.num_output:
            hits, last_hash = bm.match_prefix(seq.token_ids, seq.hash_root, seq.block_keys)
        if self.state_slots is not None:    # a hybrid model resumes from a state snapshot
            hits, last_hash = self.state_slots.trim(seq, hits, bm)
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
        """Plan the next n tokens of the sequence, all known: they count as computed from
        now on; a chunk that ends at the sequence's end samples."""
        start = seq.num_computed
        end = start + n
        seq.num_computed = end
        seq.in_flight_tokens += n
        return SeqChunk(seq.id, tuple(seq.token_ids[start:end]), start, seq.table_t,
                        end == len(seq.token_ids))

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
        if self.state_slots is not None:
            self.state_slots.release(seq)
        seq.passed = 0
        seq.table = []
        seq.table_t = ()
        seq.num_computed = seq.num_done = 0
        seq.in_flight_tokens = seq.in_flight_drafts = 0
        seq.hash_cursor = (0, seq.hash_root)
        seq.epoch += 1       # a step in flight for it no longer speaks for these blocks

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        if self.priority:
            enqueue(self.waiting, seq)
        else:
            self.waiting.appendleft(seq)
        self.num_preemptions += 1
        self.preempted.append(seq.id)
        rid = seq.req.request_id
        self._preemptions_of[rid] = self._preemptions_of.get(rid, 0) + 1

    # -- results -------------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult) -> Step:
        """Apply a step's result; decide finishes (stop.py); build the downstream message.
        A sequence gets one token, or with verified drafts (result.num_tokens) several,
        which the stop rule may cut; the rejected drafts' KV is rolled back, and only the
        kept tokens' blocks are hashed."""
        planned = self._planned.pop(plan.step, ())
        if result.kv_loaded or result.kv_failed:
            self.kv.results(self, result)
        if result.error is not None:
            for seq, _ in planned:
                if not seq.retired:
                    self.finish(seq.req.request_id, FinishReason.ERROR, result.error)
            return self.drain()
        if plan.chunks and self.speculation is not None:
            self.speculation.observe(plan, result)
        for pl in result.prompt_logprobs:
            seq = self.by_id.get(pl.seq_id)
            if seq is not None:
                seq.prompt_logprobs_so_far.extend(pl.entries)
        deltas = self._pending
        self._pending = []
        tokens, logprobs = step_outputs(result)
        # floating chunks: the drafts the runner's lookup found (no more than planned)
        verified = dict(zip(result.seq_ids, result.num_drafts)) if result.num_drafts else None
        beams: list[BeamGroup] = []     # the beam groups this step brought rows to
        iteration = apply_rows(self, plan, planned, tokens, logprobs, verified, deltas, beams)
        for group in beams:
            if group.ready():
                self.beam_search.advance(group, deltas)
        if iteration:
            self.iteration_tokens.observe(iteration)
        return self._step(plan.step, deltas)

    def _draft_chunk(self, seq: Sequence, drafts: tuple[int, ...]) -> SeqChunk:
        """Plan a decode with drafts: the last token and the drafts, all sampled; the drafts
        count as computed until the result says which were accepted (update rolls back)."""
        start = seq.num_computed
        tokens = (seq.token_ids[-1], *drafts)
        seq.num_computed = start + len(tokens)
        seq.in_flight_tokens += len(tokens)
        seq.in_flight_drafts += len(drafts)
        return SeqChunk(seq.id, tokens, start, seq.table_t, True, len(drafts))

    def _token_came_back(self, seq: Sequence) -> None:
        """The token a planned chunk sampled is in this result (AsyncScheduler counts the
        ones on their way)."""

    def _computed(self, seq: Sequence, done: int) -> None:
        """The KV cache holds the sequence's first `done` tokens: hash the blocks that
        filled (a no-op until one does), and with a hybrid cache let go of the sliding
        halves behind the next query's window (blocks.py)."""
        bm = self.blocks
        seq.num_done = done
        if bm.prefix_caching and done // bm.block_size > seq.hash_cursor[0]:
            seq.hash_cursor = bm.commit_full_blocks(seq.table, seq.token_ids, done,
                                                    *seq.hash_cursor, seq.block_keys)
        if bm.sliding is not None:
            seq.passed = bm.pass_window(seq.table, seq.passed, done)

    def drain(self) -> Step:
        """A message for a step with nothing to run: new requests and pending finishes."""
        deltas, self._pending = self._pending, []
        return self._step(self.step, deltas)

    def _step(self, step: int, deltas: list[Delta]) -> Step:
        """The step's message: the requests admitted since the last, its deltas, the load."""
        new, self._new_requests = tuple(self._new_requests), []
        return Step(step, new, tuple(deltas), len(self.running), len(self.waiting),
                    self.blocks.num_used, time.monotonic())
