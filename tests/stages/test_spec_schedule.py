"""Speculative decoding in the scheduler and the n-gram drafter: randomised invariants with
drafts accepted and rejected at random, under a tiny cache (preemption), with prefix
caching; rollback frees exactly the blocks that held only rejected drafts; stop tokens and
length cut an accepted run; the drafter's lookup and the config's checks."""
import random

import pytest

from gpu.interface import StepResult
from tests.support.rendered import rendered
from stages.schedule.blocks import BlockManager
from stages.delta import FinishReason
from stages.schedule.drafter import NgramDrafter, NgramIndex, SpeculativeConfig
from stages.schedule import Scheduler
from tests.support.scheduler_checks import check


def spec_scheduler(nb, bs, k=3, **kw):
    cfg = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=3)
    return Scheduler(BlockManager(nb, bs), max_model_len=kw.pop("max_model_len", 64),
                     eos_token_ids=(0,), drafter=NgramDrafter(cfg), num_speculative_tokens=k,
                     **{"max_num_seqs": 4, "max_num_batched_tokens": 16, **kw})


def verify(rng, plan, accept_p=0.6):
    """A runner model: each row samples its draft with probability accept_p (else 7, 8 or 9,
    or EOS now and then); tokens come out while the drafts hold, as the runner's _accept."""
    sids, toks, counts = [], [], []
    for c in plan.chunks:
        if not c.sample:
            continue
        drafts = c.token_ids[len(c.token_ids) - c.num_drafts:]
        out = []
        for j in range(c.num_drafts + 1):
            if j < c.num_drafts and rng.random() < accept_p:
                t = drafts[j]
            else:
                t = 0 if rng.random() < 0.05 else rng.choice([7, 8, 9])
            out.append(t)
            if j == c.num_drafts or t != drafts[j]:
                break
        sids.append(c.seq_id)
        toks.extend(out)
        counts.append(len(out))
    return StepResult(plan.step, tuple(sids), tuple(toks), 0.0, num_tokens=tuple(counts))


def kvcheck(s, plan, kv):
    """Each chunk reads slots that hold exactly its own tokens (the accepted ones: a
    rejected draft's slot is written again before it is read)."""
    bs = s.blocks.block_size
    for c in plan.chunks:
        seq = s.by_id[c.seq_id]
        full = seq.token_ids + list(c.token_ids[len(c.token_ids) - c.num_drafts:])
        assert tuple(full[c.start_pos:c.start_pos + len(c.token_ids)]) == c.token_ids
        assert c.num_drafts == 0 or c.start_pos == len(seq.token_ids) - 1
        for p in range(c.start_pos):
            slot = c.block_table[p // bs] * bs + p % bs
            assert kv.get(slot) == tuple(full[:p + 1]), ("stale kv", c.seq_id, p)
        for p in range(c.start_pos, c.start_pos + len(c.token_ids)):
            kv[c.block_table[p // bs] * bs + p % bs] = tuple(full[:p + 1])


class Requests:
    """The random requests of an invariants test, and the checks on what came back: the
    tokens within max_tokens, nothing after EOS, each request finished once."""

    def __init__(self, rng, s, capacity: int, most: int, max_mt: int) -> None:
        self.rng, self.s, self.capacity, self.most, self.max_mt = rng, s, capacity, most, max_mt
        self.alive, self.finished, self.produced, self.max_tokens, self.n = set(), {}, {}, {}, 0

    def arrive(self, it: int, abort_p: float) -> None:
        rng = self.rng
        if it < 400 and rng.random() < 0.3 and self.n < self.most:
            base = rng.choice([[1, 2, 3, 4, 5, 6, 7, 8], [7, 8, 9, 7, 8, 9], [5] * 8])
            prompt = (base * 3)[:rng.randint(1, 12)]
            mt = rng.randint(1, self.max_mt)
            if len(prompt) + mt <= self.capacity:
                rid = f"r{self.n}"
                self.n += 1
                self.s.add(rendered(rid, prompt, max_tokens=mt))
                self.alive.add(rid)
                self.max_tokens[rid] = mt
        if it < 400 and rng.random() < abort_p and self.alive:
            self.s.finish(rng.choice(sorted(self.alive)), FinishReason.ABORT)

    def came_back(self, deltas) -> None:
        for d in deltas:
            rid = d.request_id
            self.produced[rid] = self.produced.get(rid, 0) + len(d.token_ids)
            assert 0 not in d.token_ids[:-1], d        # nothing after EOS
            assert self.produced[rid] <= self.max_tokens[rid]
            if d.finished:
                assert rid not in self.finished, ("double finish", d)
                self.finished[rid] = d.finish_reason
                self.alive.discard(rid)
                if d.finish_reason == FinishReason.LENGTH:
                    assert self.produced[rid] == self.max_tokens[rid]


@pytest.mark.parametrize("seed", range(150))
def test_invariants_hold_with_drafts(seed):
    rng = random.Random(seed)
    nb, bs = rng.randint(5, 16), rng.choice([1, 2, 4])
    s = spec_scheduler(nb, bs, k=rng.randint(1, 4), max_num_seqs=rng.randint(1, 4),
                       max_num_batched_tokens=rng.randint(1, 12))
    kv, drafted = {}, 0
    reqs = Requests(rng, s, nb * bs, most=20, max_mt=12)
    for it in range(2400):
        reqs.arrive(it, 0.05)
        if not s.has_work():
            if it >= 400:
                break
            continue
        plan = s.schedule()
        check(s)
        kvcheck(s, plan, kv)
        drafted += sum(c.num_drafts for c in plan.chunks)
        before = {c.seq_id: len(s.by_id[c.seq_id].table) for c in plan.chunks}
        out = s.update(plan, verify(rng, plan))
        check(s)
        for c in plan.chunks:      # rollback: exactly the blocks past the next token's
            seq = s.by_id.get(c.seq_id)
            if c.num_drafts and seq is not None and seq in s.running:
                assert len(seq.table) == min(before[c.seq_id], s.blocks.blocks_for(seq.num_computed + 1))
                assert seq.num_computed == len(seq.token_ids) - 1
        reqs.came_back(out.deltas)
    assert not s.has_work()
    assert s.blocks.num_free == nb, "leak"
    assert len(reqs.finished) == reqs.n
    assert s.spec.num_draft_tokens == drafted
    assert s.spec.num_accepted_tokens <= drafted


def test_rollback_frees_exactly_the_rejected_blocks():
    """block size 2: the last token and K = 4 drafts take positions 8..12 (blocks 4, 5, 6);
    two accepted keep positions up to 10, and the next token's 11 is in block 5: block 6,
    which held only rejected drafts, is freed."""
    s = spec_scheduler(16, 2, k=4)
    s.add(rendered("a", [1, 2, 3, 1, 2, 3, 1, 2], max_tokens=20))
    plan = s.schedule()
    s.update(plan, StepResult(plan.step, ("a",), (3,), 0.0))         # prompt, then 3
    seq = s.by_id["a"]
    assert seq.token_ids == [1, 2, 3, 1, 2, 3, 1, 2, 3] and seq.num_computed == 8
    free0 = s.blocks.num_free
    plan = s.schedule()
    (c,) = plan.chunks
    assert c.num_drafts == 4 and c.token_ids == (3, 1, 2, 3, 1) and c.start_pos == 8
    assert len(seq.table) == 7 and s.blocks.num_free == free0 - 3     # positions 8..12
    s.update(plan, StepResult(plan.step, ("a",), (1, 2, 9), 0.0, num_tokens=(3,)))
    assert seq.token_ids[9:] == [1, 2, 9] and seq.num_computed == 11
    assert len(seq.table) == 6 and s.blocks.num_free == free0 - 2
    assert s.spec.num_drafts == 1 and s.spec.num_accepted_tokens == 2
    assert s.spec.accepted_per_pos == [1, 1, 0, 0]


def test_stop_token_and_length_cut_an_accepted_run():
    s = spec_scheduler(32, 4, k=3)
    s.add(rendered("a", [5, 6, 7, 5, 6], max_tokens=20, stop_token_ids=(7,)))
    s.add(rendered("b", [5, 6, 7, 5, 6], max_tokens=3))
    plan = s.schedule()
    s.update(plan, StepResult(plan.step, ("a", "b"), (5, 5), 0.0))
    plan = s.schedule()
    assert [c.num_drafts for c in plan.chunks] == [3, 1]    # b: 3 tokens left, 1 after the bonus
    out = s.update(plan, StepResult(plan.step, ("a", "b"), (6, 7, 5, 6, 7), 0.0,
                                    num_tokens=(3, 2)))
    da, db = out.deltas
    assert da.token_ids == (6, 7) and da.finish_reason == FinishReason.STOP and da.stop_reason == 7
    assert db.token_ids == (6, 7) and db.finish_reason == FinishReason.LENGTH
    assert not s.has_work() or not s.running
    assert s.blocks.num_used == 0


def test_prefix_cache_hashes_only_accepted_tokens():
    s = spec_scheduler(32, 2, k=3)
    s.add(rendered("a", [1, 2, 1, 2], max_tokens=10))
    plan = s.schedule()
    s.update(plan, StepResult(plan.step, ("a",), (1,), 0.0))
    plan = s.schedule()
    assert plan.chunks[0].token_ids == (1, 2, 1)         # "1 2 1" first ended at 2: drafts 2, 1
    s.update(plan, StepResult(plan.step, ("a",), (2, 5), 0.0, num_tokens=(2,)))
    seq = s.by_id["a"]
    assert seq.token_ids == [1, 2, 1, 2, 1, 2, 5] and seq.num_computed == 6
    hashed = [s.blocks.block_tokens[b] for b in seq.table if s.blocks.block_hash[b] is not None]
    assert hashed == [(1, 2), (1, 2), (1, 2)]                  # positions 0..5, none past


def test_ngram_lookup():
    idx = NgramIndex(1, 3)
    toks = [1, 2, 3, 4, 1, 2, 3]
    assert idx.propose(toks, 2) == (4, 1)            # "1 2 3" first ended at 2
    toks += [9]
    assert idx.propose(toks, 3) == ()                # 9 never occurred before
    toks += [1, 2]
    assert idx.propose(toks, 5) == (3, 4, 1, 2, 3)   # "9 1 2" no, "1 2" at 0..1
    assert NgramIndex(2, 2).propose([5, 5, 5], 2) == (5,)   # up to what is there
    d = NgramDrafter(SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1,
                                       prompt_lookup_max=2))
    assert d.propose("s", [3, 4, 3], 2) == (4, 3)
    d.forget("s")
    assert "s" not in d.indexes


@pytest.mark.parametrize("bad, message", [
    ('{"method": "medusa", "num_speculative_tokens": 3}', "method 'medusa' is not supported"),
    ('{"method": "eagle", "num_speculative_tokens": 3}', 'method "eagle" needs "model"'),
    ('{"method": "ngram"}', "needs \"num_speculative_tokens\""),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
     '"prompt_lookup_max": 2}', "larger than prompt_lookup_max"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "lookup": 1}', "unknown key 'lookup'"),
    ('{"method": "ngram", "num_speculative_tokens": "3"}', "must be an integer"),
    ("[3]", "must be a JSON object"),
    ("{method", "is not JSON"),
])
def test_bad_speculative_config_is_refused(bad, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        SpeculativeConfig.parse(bad)


def test_speculative_config_defaults_as_vllm():
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                 "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)


class FloatingRunner:
    """A runner model for AsyncScheduler with floating chunks, two steps in flight: it
    keeps each sequence's true tokens, starts a floating chunk where its KV really ends and
    fills it (the last token, then its own prompt lookup), fills PLACEHOLDERs, checks that
    every slot a chunk reads holds exactly that position's prefix, and accepts drafts at
    random as `verify` does."""

    def __init__(self, rng, bs: int, cfg) -> None:
        self.rng, self.bs = rng, bs
        self.ngram = NgramDrafter(cfg)
        self.hist: dict[str, list[int]] = {}
        self.next_pos: dict[str, int] = {}
        self.kv: dict[int, tuple] = {}
        self.floating = 0

    def execute(self, plan) -> StepResult:
        from gpu.interface import PLACEHOLDER
        for sid in plan.released:
            self.hist.pop(sid, None)
            self.next_pos.pop(sid, None)
            self.ngram.forget(sid)
        for ns in plan.new_seqs:
            self.hist[ns.seq_id] = list(ns.prompt_token_ids)
        sids, toks, counts, drafted = [], [], [], []
        bs = self.bs
        for c in plan.chunks:
            hist = self.hist[c.seq_id]
            if c.floating:
                self.floating += 1
                assert c.sample and len(c.token_ids) == 1 + c.num_drafts
                start = self.next_pos[c.seq_id]
                assert start == len(hist) - 1 and start <= c.start_pos
                drafts = list(self.ngram.propose(c.seq_id, hist, c.num_drafts))
                tokens = [hist[-1], *drafts]
            else:
                start = c.start_pos
                tokens = [hist[-1] if t == PLACEHOLDER else t for t in c.token_ids]
                drafts = tokens[len(tokens) - c.num_drafts:] if c.num_drafts else []
            full = hist + drafts
            assert full[start:start + len(tokens)] == tokens, (c, hist)
            for p in range(start):        # what it reads
                assert self.kv.get(c.block_table[p // bs] * bs + p % bs) == tuple(full[:p + 1]), \
                    ("stale kv", c.seq_id, p)
            for p in range(start, start + len(tokens)):
                self.kv[c.block_table[p // bs] * bs + p % bs] = tuple(full[:p + 1])
            if not c.sample:
                continue
            out = []
            for j in range(len(drafts) + 1):
                if j < len(drafts) and self.rng.random() < 0.6:
                    t = drafts[j]
                else:
                    t = 0 if self.rng.random() < 0.05 else self.rng.choice([7, 8, 9])
                out.append(t)
                if j == len(drafts) or t != drafts[j]:
                    break
            hist.extend(out)
            self.next_pos[c.seq_id] = start + len(out) if drafts else start + len(tokens)
            sids.append(c.seq_id)
            toks.extend(out)
            counts.append(len(out))
            drafted.append(len(drafts))
        return StepResult(plan.step, tuple(sids), tuple(toks), 0.0, num_tokens=tuple(counts),
                          num_drafts=tuple(drafted))


@pytest.mark.parametrize("seed", range(60))
def test_invariants_hold_with_floating_drafts(seed):
    """AsyncScheduler with floating chunks (n-gram drafts planned while the verify before
    them runs): random acceptance, a tiny cache (preemption), aborts, two steps in flight.
    Every chunk reads only what its positions hold, the tokens come out within max_tokens,
    nothing leaks, and every request finishes once."""
    from stages.schedule.async_ import AsyncScheduler

    rng = random.Random(seed)
    nb, bs, k = rng.randint(6, 16), rng.choice([1, 2, 4]), rng.randint(1, 4)
    cfg = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=3)
    s = AsyncScheduler(BlockManager(nb, bs), max_model_len=64, eos_token_ids=(0,),
                       drafter=NgramDrafter(cfg), num_speculative_tokens=k, floating=True,
                       max_num_seqs=rng.randint(1, 4), max_num_batched_tokens=rng.randint(2, 12))
    runner = FloatingRunner(rng, bs, cfg)
    reqs = Requests(rng, s, nb * bs, most=16, max_mt=14)
    in_flight = []
    for it in range(3000):
        reqs.arrive(it, 0.04)
        if s.has_work() and len(in_flight) < 2 and (not in_flight or s.may_plan_ahead()):
            plan = s.schedule()
            check(s)
            in_flight.append((plan, runner.execute(plan)))   # runs in plan order
            if len(in_flight) < 2 and rng.random() < 0.7:
                continue                                      # plan the next one ahead
        if not in_flight:
            if it >= 400 and not s.has_work():
                break
            continue
        plan, result = in_flight.pop(0)
        out = s.update(plan, result)
        check(s)
        reqs.came_back(out.deltas)
    assert not in_flight and not s.has_work()
    assert s.blocks.num_free == nb, "leak"
    assert len(reqs.finished) == reqs.n
    assert s.spec.num_accepted_tokens <= s.spec.num_draft_tokens
    if seed == 0:
        assert runner.floating > 0 and s.num_floated == runner.floating
