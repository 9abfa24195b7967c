"""EAGLE and EAGLE3 heads (issue 35) on the whole engine, SmolLM2 in fp32 as the target:
random-weight heads written in the published formats (tests/support/eagle_heads.py) draft, the
target verifies, and every stream is that of decoding without speculation, byte for byte
(text, logprobs, usage): greedy, seeded at T = 0.8, n = 2, a stop string, a JSON schema,
under preemption with chunked prefill. Random heads accept little; exactness is the point.
A start-up error for each bad head: another hidden size, another vocabulary, a missing
file (tests/gpu/test_eagle.py checks the head's parts)."""
from __future__ import annotations

import pytest

from tests.support import spec_streams as base
from tests.support.eagle_heads import eagle3_head, eagle_head

from pipeline.core.config import EngineConfig
from pipeline.core.engine import open_engine


@pytest.fixture(scope="module")
def heads(smollm, tmp_path_factory) -> dict[str, dict]:
    c = smollm.config
    root = tmp_path_factory.mktemp("eagle-heads")
    spec = {"num_speculative_tokens": 3, "adaptive": False}
    return {
        # the EAGLE3 folder: midlayer.*, a draft vocabulary of 2048 mapped by d2t, own embeddings
        "eagle3": {"method": "eagle3", **spec, "model": str(eagle3_head(
            root / "eagle3", vocab=c.vocab_size, target_hidden=c.hidden_size))},
        # RedHat's speculators format: layers.0.*, norm_before_residual, the target's
        # embeddings (hidden 576 = the target's), explicit aux layer ids
        "speculators": {"method": "eagle3", **spec, "model": str(eagle3_head(
            root / "spec", vocab=c.vocab_size, target_hidden=c.hidden_size, hidden=c.hidden_size,
            heads=9, kv_heads=3, head_dim=64, speculators=True, own_embeddings=False,
            aux_ids=[1, 14, 29], seed=1))},
        # EAGLE-1: fc over [embedding; hidden], the target's embeddings and LM head
        "eagle": {"method": "eagle", **spec, "model": str(eagle_head(
            root / "eagle", vocab=c.vocab_size, hidden=c.hidden_size, heads=9, kv_heads=3,
            head_dim=64, inter=256))},
    }


async def _on(smollm, spec, cfg, async_scheduling=False):
    """The streams, the spec counters and the head's own count of drafts it wrote."""
    from trio import open_nursery

    out: list[bytes] = [b""] * len(base.BODIES)
    async with open_engine(EngineConfig(**{"max_model_len": 256, "max_num_seqs": 8,
                                           "async_scheduling": async_scheduling,
                                           "speculative_config": spec,
                                           **base.CFGS[cfg]}), loaded=smollm) as engine:
        async def one(i, api, body):
            reply = await engine.submit(api, {"model": engine.model_names[0], "temperature": 0,
                                              "stream": True, "stream_options": {"include_usage": True},
                                              **body}, request_id=f"r{i}")
            out[i] = await reply.read()
        async with open_nursery() as n:
            for i, (api, body) in enumerate(base.BODIES):
                n.start_soon(one, i, api, body)
        stats, counts = engine.stats(), engine.scheduler.spec
        drafter = engine.runner.draft
        drafter.floated = getattr(engine.scheduler, "num_floated", 0)
    return out, stats, counts, drafter


@pytest.mark.parametrize("cfg,head,asynchronous", [("preempting", "speculators", False),
                                                   ("roomy", "eagle", False),
                                                   ("preempting", "speculators", True)])
async def test_eagle_heads_change_no_token_of_any_stream(smollm, heads, cfg, head, asynchronous):
    """The speculators format (RedHat's, EAGLE3) under preemption with chunked prefill,
    EAGLE-1 with room to spare (the EAGLE3 folder format drafts over HTTP:
    tests/e2e/test_e2e_spec_harmony.py); and EAGLE3 with --async-scheduling, its steps with
    drafts planned ahead as floating chunks that the head fills."""
    if cfg not in base.NO_SPEC_STREAMS:        # shared with test_engine_spec.py's runs (tests/support/spec_streams.py)
        base.NO_SPEC_STREAMS[cfg], _ = await base.run_streams(smollm, None, base.BODIES, **base.CFGS[cfg])
    off = base.NO_SPEC_STREAMS[cfg]
    on, stats, counts, drafter = await _on(smollm, heads[head], cfg, asynchronous)
    if asynchronous:
        assert drafter.floated >= 3, drafter.floated   # timing decides how many: 20+ seen
    if cfg == "preempting":
        assert stats.num_preemptions > 0
    assert type(drafter).__name__ == "EagleDrafter"
    # the head drafted (its own proposals, not filler) and the target verified them
    assert counts.num_draft_tokens > 100, vars(counts)
    assert drafter.drafted >= 0.9 * counts.num_draft_tokens, (drafter.drafted, vars(counts))
    for i, (a, b) in enumerate(zip(off, on)):
        assert a.endswith(b"data: [DONE]\n\n") and b.endswith(b"data: [DONE]\n\n")
        assert base.texts(a) == base.texts(b), (base.BODIES[i], base.texts(a), base.texts(b))
        assert base.same_logprobs(base.logprob_list(a), base.logprob_list(b)), base.BODIES[i]
        assert base.usage_of(a) == base.usage_of(b), base.BODIES[i]


@pytest.mark.parametrize("case", ["hidden", "vocab", "missing-weights", "missing-folder",
                                  "method"])
async def test_a_bad_head_is_a_start_up_error_naming_it(smollm, tmp_path, case):
    c = smollm.config
    method = "eagle3"
    if case == "hidden":        # a head made for a target of another width
        path = eagle3_head(tmp_path / "h", vocab=c.vocab_size, target_hidden=c.hidden_size + 64)
        want = f"is for a target of hidden size {c.hidden_size + 64}"
    elif case == "vocab":       # a head for another vocabulary
        path = eagle3_head(tmp_path / "h", vocab=c.vocab_size + 100, target_hidden=c.hidden_size)
        want = f"has a vocabulary of {c.vocab_size + 100} tokens, the target {c.vocab_size}"
    elif case == "missing-weights":
        path = eagle3_head(tmp_path / "h", vocab=c.vocab_size, target_hidden=c.hidden_size)
        (path / "model.safetensors").unlink()
        want = "has no weights"
    elif case == "missing-folder":
        path = tmp_path / "nowhere"
        want = "does not exist"
    else:                       # an EAGLE3 head asked for as EAGLE-1
        path = eagle3_head(tmp_path / "h", vocab=c.vocab_size, target_hidden=c.hidden_size)
        method, want = "eagle", 'is an EAGLE3 head: use "method": "eagle3"'
    cfg = EngineConfig(max_model_len=128, async_scheduling=False, speculative_config={
        "method": method, "model": str(path), "num_speculative_tokens": 2})
    with pytest.raises(ValueError) as err:
        async with open_engine(cfg, loaded=smollm):
            pass
    assert want in str(err.value) and str(path) in str(err.value), str(err.value)


async def test_an_eagle_head_that_knows_the_target_drafts_what_it_samples(tmp_path):
    """The wiring, not just the verify: a target whose attention adds nothing (o_proj zero,
    one layer, final norm weights 1) is a bigram model, and an EAGLE-1 head made of its
    layer with fc = [I | 0] computes the same logits up to the final norm's positive scale.
    At position p the head reads token p + 1 and must propose token p + 2, and its later
    drafts must feed on its own: then greedy decoding accepts every draft."""
    import torch
    from safetensors.torch import save_file

    from tests.support.hf_models import make_hf_model

    target = tmp_path / "target"
    hf = make_hf_model("llama", None, num_hidden_layers=1)
    with torch.no_grad():
        hf.model.layers[0].self_attn.o_proj.weight.zero_()
        hf.model.norm.weight.fill_(1.0)
    hf.save_pretrained(target, safe_serialization=True)
    sd = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    H = hf.config.hidden_size
    head = {k: v.clone() for k, v in sd.items()
            if k.startswith("layers.0.") and "input_layernorm" not in k}
    head["fc.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1)
    (tmp_path / "head").mkdir()
    save_file(head, str(tmp_path / "head" / "model.safetensors"))
    import json
    cfg = {**hf.config.to_dict(), "architectures": ["EagleLlamaForCausalLM"]}
    (tmp_path / "head" / "config.json").write_text(json.dumps(cfg))
    spec = {"method": "eagle", "model": str(tmp_path / "head"), "num_speculative_tokens": 3,
            "adaptive": False}
    import orjson
    outs = []
    for sc in (None, spec):
        async with open_engine(EngineConfig(model=str(target), dtype="float32", max_model_len=128,
                                            async_scheduling=False, speculative_config=sc)) as engine:
            reply = await engine.submit("completions", {
                "model": engine.model_names[0], "prompt": [3, 17, 42, 99, 5], "max_tokens": 25,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True})
            outs.append(orjson.loads(await reply.read())["choices"][0]["token_ids"])
            counts = engine.scheduler.spec
    assert outs[0] == outs[1] and len(outs[0]) == 25
    assert counts.num_draft_tokens >= 15, vars(counts)
    assert counts.num_accepted_tokens == counts.num_draft_tokens, vars(counts)
