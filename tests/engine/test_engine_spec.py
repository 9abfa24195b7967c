"""Speculative decoding (n-gram prompt lookup, and a draft model) on the whole engine, real
SmolLM2 in fp32: the streams are those of decoding one token at a time, byte for byte.
The draft model is SmolLM2 itself (so nearly every draft must hold) and SmolLM2 in
bfloat16 (another precision: fewer hold, none changes a token)."""
from __future__ import annotations

import orjson
import pytest

from pipeline.core.config import EngineConfig
from pipeline.core.engine import open_engine
from tests.support.spec_streams import (BODIES, CFGS, CODE, NO_SPEC_STREAMS, SPEC, SPECS, TEXT, draft_spec,
                                        engine_of, logprob_list, run_streams, same_logprobs, texts,
                                        usage_of)


async def test_a_draft_as_large_as_the_target_is_left_off_by_the_gate(smollm, caplog):
    """SmolLM2 drafting for itself with the cost gate on (the default): the draft costs the
    target's multiply-adds a token, so no step with drafts could beat one without (at most
    (K + 1) / (1 + K) = 1.0x had every draft held). No step drafts, none pays the draft's
    warm-up or catch-ups, the streams are speculation off's, and the start-up log says why."""
    caplog.set_level("INFO", logger="tailrace")
    bodies = BODIES[:2]
    on, (_, counts, _) = await run_streams(smollm, SPECS["draft-self"], bodies)
    off, _ = await run_streams(smollm, None, bodies)
    assert counts.num_drafts == 0, vars(counts)
    assert [texts(s) for s in on] == [texts(s) for s in off]
    said = [r for r in caplog.records if "speculative decoding" in r.getMessage()]
    assert said and said[-1].levelname == "WARNING", [r.getMessage() for r in said]
    assert "costs 1.00x the target's multiply-adds" in said[-1].getMessage()


@pytest.mark.parametrize("cfg,method", [("roomy", "ngram"), ("preempting", "ngram"),
                                        ("preempting", "ngram-async"),
                                        ("preempting", "draft-self"),
                                        ("preempting", "draft-self-async"), ("roomy", "draft-bf16")])
async def test_spec_decoding_changes_no_token_of_any_stream(smollm, cfg, method):
    """Greedy, seeded at temperature 0.8, n = 2, a stop string inside a copied run,
    penalties, min_tokens, logit_bias and bad words, a JSON schema, with logprobs: the text
    of every stream, its logprobs, usage and finish are those without speculation, with
    room to spare and under preemption with chunked prefill; for n-gram lookup and for a
    draft model. Speculation is on at every step here (adaptive off): the cost gate only
    ever turns drafting off, which is decoding without speculation. ngram-async: with
    async scheduling, steps with drafts planned ahead of the verify before them (floating
    chunks, whose starts and drafts the runner works out)."""
    if cfg not in NO_SPEC_STREAMS:
        NO_SPEC_STREAMS[cfg], _ = await run_streams(smollm, None, BODIES, **CFGS[cfg])
    off = NO_SPEC_STREAMS[cfg]
    extra = {"async_scheduling": True} if method.endswith("-async") else {}
    on, (stats, counts, floated) = await run_streams(smollm, {**SPECS[method], "adaptive": False},
                                                  BODIES, **CFGS[cfg], **extra)
    if extra:    # how many steps are planned ahead follows the timing: 10-60 seen
        assert floated >= 3, floated
    if cfg != "roomy":
        assert stats.num_preemptions > 0
    if method.startswith("draft-self"):
        # SmolLM2 drafting for itself samples what the target samples: all but a few hold
        # (fp32's noise between a one-row draft forward and the wider verify pass). Alone
        # this test sees 100%; after the suite's earlier tests 92-99% (119 of 129 once in CI):
        # near-ties under the seeded T = 0.8 streams, which the target's verify settles (the
        # streams still equal speculation off's, below); 120 of 151 (79%) once, with a
        # benchmark running beside the suite (the requests' interleaving, and so which
        # sequences preemption restarts, follows their timing). A broken draft is far below.
        assert counts.num_draft_tokens > 100, vars(counts)
        assert counts.num_accepted_tokens >= 0.75 * counts.num_draft_tokens, vars(counts)
    elif method == "draft-bf16":
        assert counts.num_draft_tokens > 100, vars(counts)
        assert counts.num_accepted_tokens >= 0.5 * counts.num_draft_tokens, vars(counts)
    for i, (a, b) in enumerate(zip(off, on)):
        assert a.endswith(b"data: [DONE]\n\n") and b.endswith(b"data: [DONE]\n\n")
        assert texts(a) == texts(b), (BODIES[i], texts(a), texts(b))
        assert len(texts(a)) == BODIES[i][1].get("n", 1)
        assert same_logprobs(logprob_list(a), logprob_list(b)), BODIES[i]
        assert usage_of(a) == usage_of(b), BODIES[i]
    assert counts.num_accepted_tokens > 10, vars(counts)


async def test_stand_in_accepts_drafts_at_its_probability():
    """--simulate-gpu h200 with --simulate-draft-acceptance 0.7 and K = 3: the first draft
    of each verify pass holds with probability 0.7, the j-th only if those before it did
    (0.7 ** j); the reply has exactly max_tokens tokens and /metrics' counters agree with
    each other. The cost gate drafts most of K here (memory-bound: a draft row costs
    little), but how many of the 3 rows a step takes follows the measured step times, whose
    host part moves with the machine's load: so at least 1.5 of 3 on average, not all (1.97
    once in CI's two workers, 2026-12-08)."""
    cfg = EngineConfig(simulate_gpu="h200", max_model_len=512, max_num_seqs=4,
                       speculative_config={"method": "ngram", "num_speculative_tokens": 3},
                       simulate_draft_acceptance=0.7)
    async with open_engine(cfg) as engine:
        reply = await engine.submit("completions", {
            "model": engine.model_names[0], "prompt": "Once upon a time", "max_tokens": 300,
            "ignore_eos": True, "logprobs": 1})
        body = orjson.loads(await reply.read())
        spec = engine.stats().spec_decode
    assert body["usage"]["completion_tokens"] == 300
    assert len(body["choices"][0]["logprobs"]["tokens"]) == 300
    assert 1.5 * spec.num_drafts <= spec.num_draft_tokens <= 3 * spec.num_drafts
    # every pass drafts a first token: ~0.7 of them hold (100+ passes: 0.55-0.85 is 3.5
    # standard deviations)
    first = spec.accepted_per_pos[0] / spec.num_drafts
    assert 0.55 < first < 0.85, first
    assert spec.accepted_per_pos[0] >= spec.accepted_per_pos[1] >= spec.accepted_per_pos[2]
    assert sum(spec.accepted_per_pos) == spec.num_accepted_tokens


async def test_per_request_metrics_and_metrics_counters(smollm):
    """With --enable-per-request-metrics a reply that verified drafts carries its own
    acceptance figures; the engine's counters (vLLM's spec_decode_*) add up; /metrics
    names them as vLLM does."""
    from web.metrics import EngineCollector
    from prometheus_client import CollectorRegistry, generate_latest

    async with engine_of(smollm, speculative_config=SPEC, enable_per_request_metrics=True) as engine:
        reply = await engine.submit("completions", {
            "model": engine.model_names[0], "prompt": "Repeat this text: " + TEXT,
            "max_tokens": 24, "temperature": 0})
        body = orjson.loads(await reply.read())
        spec = engine.stats().spec_decode
        registry = CollectorRegistry()
        registry.register(EngineCollector(engine))
        text = generate_latest(registry).decode()
    m = body["metrics"]
    assert m["spec_num_drafts"] == spec.num_drafts > 0
    assert m["spec_num_draft_tokens"] == spec.num_draft_tokens
    assert m["spec_num_accepted_tokens"] == spec.num_accepted_tokens > 0
    assert m["spec_acceptance_length"] == round(1 + spec.num_accepted_tokens / spec.num_drafts, 3)
    # a copied text: more than one token per verify pass, fewer steps than tokens
    assert m["spec_acceptance_length"] > 1.5
    for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total"):
        assert f"vllm:{name}{{" in text
    assert f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="{engine.model_names[0]}",position="0"}} {float(spec.accepted_per_pos[0])}' in text


async def test_random_text_accepts_few_drafts(smollm):
    """Text with nothing to copy: lookup proposes little, and little of it holds. Not
    vacuous: a one-token match (prompt_lookup_min 1) still drafts, so the engine verified
    some drafts and rejected most of them."""
    async with engine_of(smollm, speculative_config=SPEC) as engine:
        reply = await engine.submit("completions", {
            "model": engine.model_names[0], "prompt": "xq zv 81 plk wre 5 mm tofu 7 ,; ab",
            "max_tokens": 20, "temperature": 1.0, "seed": 1})
        await reply.read()
        spec = engine.stats().spec_decode
    assert spec.num_drafts > 0 and spec.num_draft_tokens >= spec.num_drafts, spec
    assert spec.num_accepted_tokens <= 0.5 * spec.num_draft_tokens, spec


async def test_a_draft_model_prefills_a_prompt_only_once_it_drafts(smollm):
    """A prompt prefilled in a step without drafts runs no draft forward (so a draft the
    cost gate keeps off costs nothing). A second request whose prompt the prefix cache
    serves from the first's blocks, which the draft never computed, computes their draft
    KV in its first drafting step: its drafts hold as they do from a cold start (the draft
    is the target), not as few as a draft reading KV it never wrote would give."""
    prompt = TEXT + " " + CODE * 2          # several full blocks for the prefix cache
    spec = {**draft_spec(), "adaptive": False}

    async def run(engine, max_tokens):
        reply = await engine.submit("completions", {
            "model": engine.model_names[0], "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True})
        return orjson.loads(await reply.read())

    async with engine_of(smollm, speculative_config=spec, enable_prompt_tokens_details=True) as engine:
        drafter = engine.runner.draft
        await run(engine, 1)                 # a prefill step alone: nothing drafts
        assert drafter.forwards == 0
        # the catch-up of the whole prompt in forwards of at most 16 tokens, as a prefill
        # chunked by the step budget (the default: max_num_batched_tokens) runs
        drafter.chunk, sizes, forward = 16, [], drafter._forward
        drafter._forward = lambda chunks: sizes.append(sum(len(c.token_ids) for c in chunks)) or forward(chunks)
        second = await run(engine, 24)
        counts = engine.stats().spec_decode
        assert drafter.valid.any()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32, second["usage"]
    assert max(sizes) <= 16 and sizes.count(16) >= 4, sizes     # the prompt: > 64 tokens
    assert counts.num_draft_tokens >= 15, counts
    assert counts.num_accepted_tokens >= 0.9 * counts.num_draft_tokens, counts


async def test_a_speculative_run_replays_from_its_event_log(smollm, tmp_path):
    """Multi-token deltas in the event log: replay reproduces every reply byte for byte."""
    from pipeline.tools.replay import Log, replay_log

    log = tmp_path / "events.jsonl"
    seen: dict[str, bytes] = {}
    async with engine_of(smollm, speculative_config=SPEC, event_log=str(log)) as engine:
        for i, (api, body) in enumerate(BODIES[:4]):
            reply = await engine.submit(api, {"model": engine.model_names[0], "temperature": 0,
                                              "stream": True, **body}, request_id=f"r{i}")
            seen[reply.request_id] = await reply.read()
        assert engine.stats().spec_decode.num_accepted_tokens > 0
    result = replay_log(Log.read(log), smollm.tokenizer)
    assert result.reproduced == result.logged == seen


def test_guide_draft_masks_walk_the_grammar_and_roll_back():
    """A verify step's masks for a constrained sequence: row j is the grammar after
    drafts[:j]; a draft the grammar refuses ends the rows masked; the matcher is left
    where it was."""
    import torch
    import xgrammar as xgr

    from gpu.worker.grammar import Guide

    info = xgr.TokenizerInfo(["a", "b", "</s>", "c"], stop_token_ids=[2])
    compiled = xgr.GrammarCompiler(info).compile_grammar(xgr.Grammar.from_regex("abc"))
    guide = Guide(compiled)

    def allowed(bitmask, row):
        return {t for t in range(4) if (int(bitmask[row, t // 32]) >> (t % 32)) & 1}

    bitmask = xgr.allocate_token_bitmask(5, 4)
    assert guide.draft_masks((0, 1, 3), bitmask, 1) == [1, 2, 3, 4]
    assert [allowed(bitmask, r) for r in (1, 2, 3, 4)] == [{0}, {1}, {3}, {2}]
    assert allowed(bitmask, 0) == {0, 1, 2, 3}          # another row: untouched
    bitmask = xgr.allocate_token_bitmask(4, 4)
    assert guide.draft_masks((0, 0, 1), bitmask, 0) == [0, 1]   # the second "a" is refused
    assert allowed(bitmask, 1) == {1} and allowed(bitmask, 2) == {0, 1, 2, 3}
    # rolled back: the matcher still stands at the start
    assert guide.accept(0) and guide.accept(1)
    assert not guide.matcher.accept_token(0)
    logits = torch.zeros(3, 4)
    from gpu.worker.grammar import mask_logits
    mask_logits(logits, [guide, None, None], [(3, 2), (), ()])   # rows 0-2: after "ab"
    assert logits[0].tolist() == [float("-inf")] * 3 + [0.0]
    assert logits[1].tolist() == [float("-inf"), float("-inf"), 0.0, float("-inf")]
    assert logits[2].tolist() == [0.0] * 4                         # after the stop token: free


async def test_constrained_sequences_draft_and_change_no_token(smollm):
    """A JSON schema whose answer copies the prompt: with n-gram speculation its drafts are
    verified under the grammar's masks (most hold), and the stream is byte for byte the one
    without speculation."""
    body = ("chat", dict(messages=[{"role": "user", "content": "Repeat as JSON: " + TEXT}],
                         max_tokens=40, logprobs=True, top_logprobs=1,
                         response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {
                             "type": "object", "properties": {"text": {"type": "string"}},
                             "required": ["text"]}}}))
    off, _ = await run_streams(smollm, None, [body])
    on, (_, counts, _) = await run_streams(smollm, SPEC, [body])
    assert texts(off[0]) == texts(on[0])
    assert texts(on[0])[0][0].lstrip().startswith('{') and '"text"' in texts(on[0])[0][0]   # the grammar's
    assert same_logprobs(logprob_list(off[0]), logprob_list(on[0]))
    assert counts.num_draft_tokens >= 10 and counts.num_accepted_tokens >= 5, vars(counts)
