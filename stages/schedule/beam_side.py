"""Beam search's half of the scheduler (`BeamSearch`, held by `Scheduler`): a request's `BeamGroup`,
each round's ranking of the live beams' candidates, forking a beam (its parent's full
blocks shared by reference count, the partial block recomputed), an idle beam giving
way, and the search's end. The group's data and the score are beam.py's."""
from __future__ import annotations

from gpu.interface import SeqChunk
from stages.delta import Delta
from stages.messages import RenderedRequest
from stages.schedule.beam import BeamGroup, Candidate, beam_options
from stages.schedule.priority import enqueue
from stages.schedule.sequence import Sequence


class BeamSearch:
    """Beam search, an object the scheduler holds as `beam_search` and calls at named
    hooks: `start` (a request's groups), `row` (a beam's chunk came back), `advance` (a
    group's round is complete), `drop`, `preempt_idle` (a waiting sequence needs room).
    It owns the groups; the queues and blocks it works on are the scheduler's (`sched`)."""

    def __init__(self, sched) -> None:
        self.sched = sched
        self.groups: dict[str, list[BeamGroup]] = {}   # request id -> a group per prompt

    def __bool__(self) -> bool:
        """Whether any search is on."""
        return bool(self.groups)

    def start(self, req: RenderedRequest) -> list[Sequence]:
        """A beam-search request: one group per prompt, each starting as one sequence."""
        s = self.sched
        sp = req.sampling
        eos = frozenset(s.eos_token_ids)
        opts = beam_options(sp.beam_width, sp.options.logprobs)
        firsts, groups = [], []
        for p in range(len(req.prompts) or 1):
            seq = Sequence(req, s.eos_token_ids, s.max_model_len, p * req.n)
            group = BeamGroup(seq, sp.beam_width, sp.length_penalty, eos, sp.ignore_eos,
                              sp.include_stop_str_in_output, sp.options.logprobs)
            seq.id = group.next_id(req.request_id)
            seq.beam, seq.beam_options = group, opts
            firsts.append(seq)
            groups.append(group)
        self.groups[req.request_id] = groups
        return firsts

    def drop(self, seq: Sequence) -> None:
        """A beam that leaves the search (no child, or the search is over)."""
        s = self.sched
        if seq in s.running:
            s.running.remove(seq)
        elif seq in s.waiting:
            s.waiting.remove(seq)
        s._retire(seq)

    def row(self, seq: Sequence, chunk: SeqChunk, epoch: int, tokens: dict,
            logprobs: dict, beams: list[BeamGroup]) -> int:
        """A beam's chunk came back: its KV is in, and its row (the top logprobs after
        its last token) counts for the round unless a token was added to it since (a
        preempted beam's recompute that was in flight when its round ended). The
        iteration tokens it adds (vLLM's count: a prompt at its first token, one out)."""
        s = self.sched
        got = tokens.get(seq.id, ()) if chunk.sample else ()
        if got:
            s._token_came_back(seq)
        end = chunk.start_pos + len(chunk.token_ids)
        if epoch == seq.epoch:
            s._computed(seq, end)
        group = seq.beam
        if not got or end != len(seq.token_ids) or seq.id in group.rows:
            return 0
        group.rows[seq.id] = logprobs[seq.id][0]
        if group not in beams:
            beams.append(group)
        return 1 + (seq.prompt_len if group.round == 0 else 0)

    def advance(self, group: BeamGroup, deltas: list[Delta]) -> None:
        """Every live beam of the group has its row: rank the candidates, fork the beams
        chosen more than once, drop the ones not chosen; after the last round, the group's
        best beams go downstream as its choices."""
        kept = group.rank()
        if group.done() or not kept:
            self.end_search(group, kept, deltas)
            return
        plan: list[tuple[Sequence, Candidate]] = []
        continued: set[str] = set()
        for c in kept:      # best first: the first child of a beam continues it
            if c.parent.id in continued:
                plan.append((self.fork(c.parent, group), c))
            else:
                continued.add(c.parent.id)
                plan.append((c.parent, c))
        for seq, c in plan:     # after the forks, which copy the parents as they were
            seq.token_ids.append(c.token)
            seq.cum_logprob = c.cum_logprob
            seq.beam_logprobs = group.extend(seq.beam_logprobs, c.row, c.logprob)
        old, group.live = group.live, [seq for seq, _ in plan]
        for seq in old:
            if seq.id not in continued:
                self.drop(seq)

    def end_search(self, group: BeamGroup, kept: list[Candidate], deltas: list[Delta]) -> None:
        """The last round: the group's best hypotheses go downstream as its choices, each
        whole in one delta; its beams let go of their blocks."""
        rid = group.first.req.request_id
        best = group.best(kept)
        for seq in group.live:
            self.drop(seq)
        group.live = []
        first = group.first
        for k, h in enumerate(best):
            deltas.append(Delta(rid, h.tokens, h.finish, h.stop_reason, first.num_cached_tokens,
                                None, h.logprobs, first.scheduled_at, group.choice0 + k))
        group.emitted = True
        if all(g.emitted for g in self.groups.get(rid, ())):
            self.groups.pop(rid, None)

    def preempt_idle(self, chunks: list[SeqChunk],
                     planned: list[tuple[Sequence, int]]) -> int | None:
        """A waiting sequence is short of blocks (or of a place among --max-num-seqs) while
        a running beam only waits for its round to end (its row is in, nothing to compute):
        that beam lets go of its blocks
        and waits at the back of the queue, since it needs them again only for the next
        round (it computes its tokens again then). None when no beam is idle; else the
        budget its chunk planned in this step gives back (a preempted beam computing its
        tokens again, whose row for the round is in already)."""
        s = self.sched
        for seq in reversed(s.running):
            if seq.beam is not None and not seq.num_pending and seq.id in seq.beam.rows:
                taken = s._unplan(chunks, planned, seq)
                s._preempt(seq)
                s.waiting.remove(seq)
                if s.priority:   # after its request's other beams
                    seq.beam.serial += 1
                    seq.order = (*seq.order[:3], seq.beam.serial)
                    enqueue(s.waiting, seq)
                else:
                    s.waiting.append(seq)
                return 0 if taken is None else len(taken.token_ids)
        return None

    def fork(self, parent: Sequence, group: BeamGroup) -> Sequence:
        """A new beam from `parent` as it is now: it holds the parent's full KV blocks
        (one more reference each) and computes the tokens of the partly filled last block
        again, in a fresh block of its own (copy-on-write by recompute). It waits at the
        front of the queue, so that the next step starts it in the runner."""
        s = self.sched
        req = parent.req
        child = Sequence(req, s.eos_token_ids, s.max_model_len, parent.index)
        child.id = group.next_id(req.request_id)
        child.beam, child.beam_options = group, parent.beam_options
        child.token_ids = list(parent.token_ids)
        child.cum_logprob, child.beam_logprobs = parent.cum_logprob, parent.beam_logprobs
        child.order = (*parent.order, group.serial)     # after its parent (priority order)
        child.block_keys = parent.block_keys
        child.num_cached_tokens = parent.num_cached_tokens
        bm = s.blocks
        full = min(parent.num_done // bm.block_size, len(parent.table))
        shared = parent.table[:full]
        bm.share(shared)
        child.table, child.table_t = list(shared), tuple(shared)
        child.num_computed = child.num_done = full * bm.block_size
        if parent.hash_cursor[0] == full:
            child.hash_cursor = parent.hash_cursor
        elif bm.prefix_caching and full and bm.block_hash[shared[-1]] is not None:
            child.hash_cursor = (full, bm.block_hash[shared[-1]])
        else:
            child.hash_cursor = (full, child.hash_root)
        s.by_id[child.id] = child
        s.choices[req.request_id].append(child)
        if s.priority:
            enqueue(s.waiting, child)
        else:
            s.waiting.appendleft(child)
        return child
