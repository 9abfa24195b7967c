"""Speculative decoding's cost gate (stages/schedule/spec.py CostGate) on synthetic step
times: no clock is read, each step's time is a function of its rows. A step's cost that
jumps at a row limit (the CPU's packed kernels past 48 rows) keeps the drafts under it;
a compute-bound line turns drafts off; a memory-bound one drafts K; drafts that measure
slower than off are vetoed whatever the costs expect; a passing stall does not turn
drafts off; the rows go to the sequences whose drafts hold."""
from types import SimpleNamespace

from stages.schedule.drafter import ModelDrafter
from stages.schedule.spec import CostGate, SpecCounters, Speculation, draft_len


def values(qs, k):
    """The expected tokens of each draft (Speculation._values), highest first."""
    out = []
    for q in qs:
        p = 1.0
        for _ in range(k):
            p *= q
            out.append(p)
    return sorted(out, reverse=True)


def drive(gate, steps, n, qs, k, cost, held=None):
    """Steps of n sequences: the gate decides and picks the draft rows, the step costs
    cost(rows) seconds and yields n tokens plus the expected tokens of its drafts (or
    `held`'s: the tokens its drafts really yield). Returns each step's draft rows."""
    vals = values(qs, k)
    out = []
    for _ in range(steps):
        m = gate.rows(n, vals)
        m = m if gate.decide(n) else 0
        gained = sum(vals[:m]) if held is None else held(m)
        gate.observe(n, m > 0, n + round(gained), cost(n + m), n + m)
        out.append(m)
    return out


def kernel_step(rows):
    """Cheap rows up to 48 (one packed pass over the weights), then dequantize + GEMM:
    2 ms more a row (the 32-stream CPU step's shape)."""
    return 0.090 + 0.0002 * rows if rows <= 48 else 0.120 + 0.002 * (rows - 48)


def test_drafts_stay_under_the_kernels_row_limit():
    gate = CostGate()
    rows = drive(gate, 200, 32, [0.6] * 32, 3, kernel_step)
    late = rows[40:]
    assert sum(m > 0 for m in late) >= 0.9 * len(late)     # the cheap rows are used
    over = [m for m in late if 32 + m > 48]
    assert len(over) <= len(late) / CostGate.EXPLORE + 2    # past the limit: probes only
    # and the gain is real: tokens per second over off's
    on = sum(32 + sum(values([0.6] * 32, 3)[:m]) for m in late) / sum(kernel_step(32 + m) for m in late)
    assert on > 1.1 * 32 / kernel_step(32)


def test_a_compute_bound_step_does_not_draft():
    gate = CostGate()
    rows = drive(gate, 200, 32, [0.6] * 32, 3, lambda r: 0.003 * r)   # every row costs alike
    late = rows[40:]
    assert sum(m > 0 for m in late) <= len(late) / CostGate.EXPLORE + 2


def test_one_memory_bound_stream_drafts_k():
    gate = CostGate()
    rows = drive(gate, 120, 1, [0.8], 3, lambda r: 0.030 + 0.0005 * r)
    late = rows[20:]
    assert sum(m == 3 for m in late) >= 0.9 * len(late)


def test_drafts_that_measure_slower_are_vetoed():
    # the costs expect a gain (acceptance 0.9, cheap rows), but no draft ever holds: the
    # A/B's rates with drafts fall under off's, and the bucket stops drafting; the two
    # disagree, so it tries again one step in a quarter of EXPLORE
    gate = CostGate()
    rows = drive(gate, 200, 8, [0.9] * 8, 3, lambda r: 0.020 + 0.001 * r, held=lambda m: 0)
    late = rows[40:]
    assert gate.preferred(8) is False
    assert sum(m > 0 for m in late) <= len(late) / (CostGate.EXPLORE // 4) + 2
    # measured acceptance that agrees (drafts seldom hold): one step in EXPLORE
    gate = CostGate()
    rows = drive(gate, 200, 8, [0.2] * 8, 3, lambda r: 0.020 + 0.001 * r, held=lambda m: 0)
    assert sum(m > 0 for m in rows[40:]) <= len(rows[40:]) / CostGate.EXPLORE + 2


def test_drafts_far_slower_than_off_are_probed_seldom():
    """Drafting steps at under a third of off's rate (a draft model as costly as the
    target): the vetoed drafts are probed one step in VETOED x EXPLORE, not in EXPLORE, as
    each probe costs the gap; and they are still probed."""
    gate = CostGate()
    rows = drive(gate, 640, 8, [0.2] * 8, 3, lambda r: 0.028 if r <= 8 else 0.090,
                 held=lambda m: 0)
    late = rows[40:]
    assert gate.preferred(8) is False
    probes = sum(m > 0 for m in late)
    assert 0 < probes <= len(late) / (4 * CostGate.EXPLORE) + 2, probes   # 25 at 1 in EXPLORE


def test_close_vetoed_drafts_are_probed_at_a_bounded_cost():
    """32 sequences, compute-bound: the costs expect a 12% gain (acceptance 0.3 each, cheap
    rows), but no draft ever holds, so drafting steps measure 13% under off. With a draft
    model (`probe_cost`, which Speculation sets for one) each probe costs that gap and its
    forwards, so they are probed at most PROBE_COST of the time (one step in 48: 19 probes
    in 900 steps); n-gram lookup keeps the close-call rate (one step in 7: 128), its probes
    drafting for the sequences that copy best."""
    def run(gate):
        rows = drive(gate, 1000, 32, [0.3] * 32, 3, lambda r: 0.040 + 0.0002 * (r - 32), held=lambda m: 0)
        b = gate.buckets[(32).bit_length()]
        assert gate.preferred(32) is False and gate.expected > 1 + CostGate.MARGIN
        return sum(m > 0 for m in rows[100:]), b[1] / b[0] - 1

    probes, gap = run(CostGate(probe_cost=CostGate.PROBE_COST))
    assert 0.1 < gap < 0.2 and 0 < probes <= 900 * CostGate.PROBE_COST / gap + 2, probes
    ngram, _ = run(CostGate())
    assert ngram >= 100, ngram
    spec = Speculation(ModelDrafter(catches_up=True), 3, None, SpecCounters(3), CostGate())
    assert spec.gate.probe_cost == CostGate.PROBE_COST


def test_a_step_with_prompt_chunks_spends_no_warm_up_or_probe():
    """A step that carries prompt chunks (requests arriving) is not measured, so it drafts
    only where the A/B prefers drafts: a bucket such steps alone visit does not sit in its
    warm-up drafting every other step unmeasured (the stand-in's draft model drafted in 39
    such steps of 72), and vetoed drafts are never probed there."""
    def measure(gate, n, on_s, off_s):
        for _ in range(CostGate.WARM):
            gate.observe(n, True, n + 8, on_s, n + 8)
            gate.observe(n, False, n, off_s, n)

    gate = CostGate()
    assert not any(gate.decide(24, pure=False) for _ in range(100))
    assert gate.buckets[(24).bit_length()][4] == 0          # no decision counted
    assert gate.decide(24)                                   # a decode step starts the warm-up
    measure(gate, 24, 0.010, 0.012)                          # drafts pay: 3200 against 2000 tok/s
    assert gate.preferred(24) and gate.decide(24, pure=False)
    gate = CostGate()
    measure(gate, 24, 0.030, 0.010)                          # drafts lose
    assert not any(gate.decide(24, pure=False) for _ in range(500))
    assert any(gate.decide(24) for _ in range(500))          # decode steps still probe them


def test_a_passing_stall_does_not_turn_drafts_off():
    gate = CostGate()
    drive(gate, 60, 1, [0.8], 3, lambda r: 0.030 + 0.0005 * r)
    stalls = iter([0.5, 0.5])       # two steps of 0.5 s (another process), then as before
    rows = drive(gate, 60, 1, [0.8], 3, lambda r: next(stalls, 0.030 + 0.0005 * r))
    assert sum(m == 3 for m in rows[2:]) >= 0.9 * len(rows[2:])


def test_the_rows_go_to_the_sequences_whose_drafts_hold():
    class Drafter:
        def propose(self, seq_id, token_ids, k):
            return (5,) * k

        def forget(self, seq_id):
            pass

    spec = Speculation(Drafter(), 3, None, SpecCounters(3), CostGate())
    opts = SimpleNamespace(thinking_token_budget=None)
    seqs = [SimpleNamespace(id=f"s{i}", token_ids=[1, 2, 3], num_pending=0, end_len=100,
                            req=SimpleNamespace(sampling=SimpleNamespace(options=opts)),
                            spec_drafts=0, spec_draft_tokens=0, spec_accepted=0)
            for i in range(8)]
    for i, seq in enumerate(seqs):       # s0-s3 copy (drafts hold), s4-s7 do not
        for _ in range(10):
            spec.verified(seq, 3, 3 if i < 4 else 0)
    gate = spec.gate
    gate.rows = lambda n, vals: 6      # the costs pay for 6 draft rows
    gate.decide = lambda n, pure=True: True
    assert spec.on_for(seqs)
    got = [len(spec.drafts(seq, 64)) for seq in seqs]
    assert sum(got) == 6
    # the 6 best: each copying sequence's first and second drafts (q, q**2 > q**3)
    assert all(g == 0 for g in got[4:]) and max(got) == 2


def _catch_up_run(catches_up: bool, pays: bool, steps: int = 400, forward: float = 0.0):
    """Four decoding sequences with 1000-token prompts and a draft model that has followed
    none of them: a drafting step costs an off step's 20 ms, 0.2 ms a draft row, 1 ms a
    token the draft has not seen (the catch-up: a sequence's whole prompt at its first) and
    `forward` seconds for each of the draft model's K forwards. Drafts hold (pays) or never
    do. Returns the catch-ups (lags of the sequences that drafted past LAG) and the drafting
    steps."""
    from stages.schedule.drafter import ModelDrafter

    spec = Speculation(ModelDrafter(catches_up=catches_up), 3, None, SpecCounters(3), CostGate())
    opts = SimpleNamespace(thinking_token_budget=None)
    seqs = [SimpleNamespace(id=f"s{i}", token_ids=[1] * 1000, num_pending=0, end_len=10 ** 6,
                            req=SimpleNamespace(sampling=SimpleNamespace(options=opts)),
                            spec_drafts=0, spec_draft_tokens=0, spec_accepted=0)
            for i in range(4)]
    followed = {s.id: 0 for s in seqs}      # what the draft model has seen of each
    catch_ups, drafting = [], 0
    for _ in range(steps):
        on = spec.on_for(seqs)
        seconds, tokens, drafted = 0.020, 4, []
        for seq in seqs:
            d = spec.drafts(seq, 64) if on else ()
            drafted.append((seq, len(d)))
            if not d:
                continue
            lag = len(seq.token_ids) - followed[seq.id]
            if lag > Speculation.LAG:
                catch_ups.append(lag)
            seconds += 0.001 * lag + 0.0002 * len(d) + (forward * 3 if seconds == 0.020 else 0.0)
            followed[seq.id] = len(seq.token_ids)
            held = len(d) if pays else 0
            spec.verified(seq, len(d), held)
            tokens += held
            seq.token_ids += [1] * held
        drafting += seconds > 0.020
        chunks = tuple(SimpleNamespace(seq_id=seq.id, num_drafts=n, sample=True,
                                       token_ids=(1,) * (1 + n)) for seq, n in drafted)
        spec.observe(SimpleNamespace(chunks=chunks), SimpleNamespace(
            num_drafts=(), num_tokens=(), token_ids=(1,) * tokens, duration_s=seconds))
        for seq in seqs:
            seq.token_ids.append(1)
    return catch_ups, drafting


def test_a_probe_does_not_pay_a_draft_models_catch_up():
    """With a draft model (gpu/worker/spec_decode/draft.py catches a sequence's draft KV up at its first
    drafting step: its whole prompt), the gate's warm-up and probes draft only for a
    sequence the draft has followed within LAG tokens, and start one other only where none
    is, in the warm-up or once drafting went unmeasured for STALE decisions (one prompt
    caught up, the warm-up's; after it, drafting measured slower, only the followed
    sequence's tokens since it drafted): where each probe drafted for any sequence, every
    sequence pays its prompt's catch-up. Drafts that pay are not held back: every sequence catches up once."""
    ups, drafting = _catch_up_run(True, pays=False)
    assert ups[0] >= 1000 and all(u < 1000 for u in ups[1:]), ups    # one prompt caught up
    assert len(ups) <= 1 + 400 // CostGate.STALE, ups     # and that sequence when stale
    assert drafting > CostGate.WARM        # the followed sequence is still probed after the warm-up
    blind, _ = _catch_up_run(False, pays=False)
    assert sum(u >= 1000 for u in blind) == 4, blind
    ups, drafting = _catch_up_run(True, pays=True)
    assert len(ups) == 4 and drafting >= 300, (ups, drafting)


def test_a_draft_as_costly_as_the_target_starts_no_sequence_after_its_warm_up():
    """A draft model whose forwards cost what the target's step does (SmolLM2 drafting for
    itself: three forwards of 20 ms a drafting step): even had every draft held, its drafting
    steps measured far slower than off (`ceiling`), so no probe starts a sequence the draft
    has not followed, however long drafting goes unmeasured: the warm-up's catch-up is the
    only one. Where the ceiling is above off (drafts that would pay if they held: the run
    above), a stale bucket still starts one."""
    ups, drafting = _catch_up_run(True, pays=True, steps=800, forward=0.020)
    assert len(ups) == 1 and ups[0] >= 1000, ups
    assert drafting > CostGate.WARM          # the followed sequence is still probed
    ups, _ = _catch_up_run(True, pays=False, steps=800)
    assert len(ups) >= 2, ups                # the cheap draft: started again once stale


def test_a_draft_that_cannot_pay_never_drafts():
    """A draft model's cost a token over the target's (r) bounds a drafting step at
    (K + 1) / (1 + K r) of off's rate had every draft held: from r = 1 (a draft as large
    as the target) that is under the gate's MARGIN, so no step drafts, the warm-up
    included; a draft a fifth of the target's size (2.5x at most) is measured as usual;
    without the gate ("adaptive": false) every step drafts whatever the draft costs."""
    from stages.schedule.drafter import ModelDrafter

    seqs = [SimpleNamespace(id="s0", token_ids=[1] * 10)]
    big = Speculation(ModelDrafter(catches_up=True), 3, None, SpecCounters(3), CostGate(), draft_cost=1.0)
    assert big.futile and big.bound == 1.0
    assert not any(big.on_for(seqs) or big.would_draft(seqs) for _ in range(300))
    assert big.mode().startswith("never: the draft model costs 1.00x")
    small = Speculation(ModelDrafter(catches_up=True), 3, None, SpecCounters(3), CostGate(), draft_cost=0.2)
    assert not small.futile and small.bound == 2.5 and small.on_for(seqs)    # the warm-up drafts
    forced = Speculation(ModelDrafter(catches_up=True), 3, None, SpecCounters(3), None, draft_cost=1.0)
    assert not forced.futile and forced.on_for(seqs) and forced.mode() == "every step"


def test_draft_len():
    assert draft_len(0.9, 0.0, 3) == 3
    assert draft_len(0.5, 0.3, 3) == 1      # 0.5 >= 0.3 > 0.25
    assert draft_len(0.2, 0.3, 3) == 0


def test_a_floating_step_is_measured_by_the_drafts_the_runner_filled():
    """Async scheduling plans floating chunks with the gate's K drafts, and the runner's
    lookup may find none: such a step is a plain decode's cost, and the gate must count it
    as one (rows from StepResult.num_drafts), not as a drafting step that yielded nothing."""
    from gpu.interface import SeqChunk, StepPlan, StepResult

    seen = []
    gate = SimpleNamespace(observe=lambda *a: seen.append(a))
    spec = Speculation(None, 3, None, SpecCounters(3), gate)
    chunks = (SeqChunk("a", (-2,) * 4, 10, (0,), True, 3, floating=True),
              SeqChunk("b", (-2,) * 3, 20, (1,), True, 2, floating=True))
    plan = StepPlan(1, chunks)
    spec.observe(plan, StepResult(1, ("a", "b"), (5, 6), 0.01, num_drafts=(0, 0)))
    spec.observe(plan, StepResult(1, ("a", "b"), (5, 6, 7, 8), 0.01, num_tokens=(3, 1),
                                  num_drafts=(3, 1)))
    spec.observe(plan, StepResult(1, ("a", "b"), (5, 6, 7), 0.01, num_tokens=(2, 1)))
    (n0, drafted0, tok0, _, rows0), (_, drafted1, tok1, _, rows1), (_, _, _, _, rows2) = seen
    assert (n0, drafted0, tok0, rows0) == (2, False, 2, 2)      # found nothing: a plain decode
    assert (drafted1, tok1, rows1) == (True, 4, 6)              # 2 rows + the 4 drafts filled
    assert rows2 == 7                                           # no num_drafts: as planned


def test_slow_steps_without_drafts_do_not_hold_drafts_on():
    # 32 streams where drafting loses (36 tokens in 51.4 ms: 700 tok/s, against 32 in 41 ms:
    # 780). Three slow steps without drafts (another process's load, 1.4x: not a stall) make
    # drafting look faster. With the A/B's rates that close, off is probed one step in
    # PROBE_MIN, and older steps weigh less, so drafting is turned off again within a few
    # probes; rates held for EXPLORE steps a probe kept it on for most of the next 60 steps
    gate = CostGate()

    def steps(count, off_s=0.041):
        out = []
        for _ in range(count):
            on = gate.decide(32)
            out.append(on)
            gate.observe(32, on, 36 if on else 32, 0.0514 if on else off_s, 36 if on else 32)
        return out

    steps(60)
    assert gate.preferred(32) is False          # off wins
    while gate.would_decide(32):
        steps(1)
    steps(3, off_s=0.041 * 1.4)
    assert gate.preferred(32) is True           # the slow steps turned the A/B
    after = steps(60)
    assert sum(after) <= 15, after
    assert gate.preferred(32) is False
    assert sum(after[30:]) <= 30 / CostGate.PROBE_MIN + 1
