"""Constrained decoding through the whole engine (real SmolLM2 weights, no HTTP)."""
from __future__ import annotations

import json
import re

import jsonschema
import orjson
import pytest

from stages.render import RequestError
from tests.support.smollm_engine import QUESTION, complete, engine_of

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]


async def test_json_schema_output_validates(smollm):
    async with engine_of(smollm) as engine:
        outs = [await complete(engine, "chat", messages=ASK, max_tokens=60, temperature=t,
                               seed=s, response_format={"type": "json_schema", "json_schema": {
                                   "name": "person", "schema": PERSON}})
                for t, s in ((0, None), (1.0, 1))]
        outs.append(await complete(engine, "chat", messages=ASK, max_tokens=60, temperature=1.0,
                                   seed=2, n=2, response_format={"type": "json_schema",
                                                                 "json_schema": {"schema": PERSON}}))
    choices = [c for out in outs for c in out["choices"]]
    assert len(choices) == 4
    for choice in choices:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


async def test_regex_choice_and_grammar(smollm):
    async with engine_of(smollm) as engine:
        regex = await complete(engine, "completions", prompt="My phone number is",
                               max_tokens=20, structured_outputs={"regex": r"\d{3}-\d{4}"})
        choice = await complete(engine, "chat", messages=QUESTION, max_tokens=10,
                                guided_choice=["Paris", "London", "Berlin"])
        grammar = await complete(engine, "chat", messages=QUESTION, max_tokens=10,
                                 guided_grammar='root ::= "yes" | "no"')
        obj = await complete(engine, "chat", messages=ASK, max_tokens=40,
                             response_format={"type": "json_object"})
    assert re.fullmatch(r"\d{3}-\d{4}", regex["choices"][0]["text"])
    assert choice["choices"][0]["message"]["content"] in ("Paris", "London", "Berlin")
    assert grammar["choices"][0]["message"]["content"] in ("yes", "no")
    if obj["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(obj["choices"][0]["message"]["content"]), dict)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                  "schema": {"type": "foo"}}}},
     "response_format"),
    ({"guided_regex": "(abc"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "root ::= nothere"}}, "structured_outputs.grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
])
async def test_bad_constraints_are_400(smollm, body, param):
    async with engine_of(smollm) as engine:
        with pytest.raises(RequestError) as err:
            await engine.submit("chat", {"messages": QUESTION, **body})
    assert err.value.status == 400 and err.value.param == param, err.value.message


async def test_preemption_keeps_the_matcher(smollm):
    """A tiny KV cache preempts constrained sequences; each still matches its regex."""
    body = dict(prompt="Count: ", max_tokens=40, structured_outputs={"regex": r"(\d ){8}end"})
    async with engine_of(smollm, num_gpu_blocks_override=12, block_size=4,
                         enable_prefix_caching=False, max_num_seqs=4) as engine:
        import trio
        results = []

        async def one():
            results.append(await complete(engine, **body))
        async with trio.open_nursery() as n:
            for _ in range(4):
                n.start_soon(one)
        preempted = engine.stats().num_preemptions
    assert preempted > 0
    for r in results:
        text = r["choices"][0]["text"]
        assert r["choices"][0]["finish_reason"] == "stop", text
        assert re.fullmatch(r"(\d ){8}end", text), text


async def test_replay_of_tool_calls_and_constraints(smollm, tmp_path):
    """The event log carries constraints and tool plans: replay reproduces every byte."""
    from pipeline.tools.replay import replay
    import trio

    log = tmp_path / "events.jsonl"
    seen: dict[str, bytes] = {}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"]}}}]

    async def raw(api: str, **body) -> None:
        reply = await engine.submit(api, {"model": engine.model_names[0], **body})
        seen[reply.request_id] = await reply.read()

    async with engine_of(smollm, event_log=str(log), tool_call_parser="hermes") as engine:
        async with trio.open_nursery() as reqs:
            reqs.start_soon(lambda: raw("chat", messages=QUESTION, max_tokens=30, stream=True,
                                        tools=tools, temperature=0, tool_choice={
                                            "type": "function",
                                            "function": {"name": "get_weather"}}))
            reqs.start_soon(lambda: raw("chat", messages=ASK, max_tokens=40, temperature=0,
                                        response_format={"type": "json_object"}))
    reproduced, logged = replay(log, smollm.tokenizer)
    assert logged == seen and reproduced == logged
    assert b"get_weather" in b"".join(seen.values())


def test_constraint_starts_after_the_reasoning(smollm):
    """gpu.worker.grammar.Guide with stand-in think ids: <think> may open first, anything goes
    until </think>, then the grammar holds."""
    import torch
    import xgrammar as xgr

    from gpu.worker.grammar import GrammarCompiler, Guide, accept, mask_logits
    from gpu.interface import Constraint

    tok = smollm.tokenizer
    compiled = GrammarCompiler(tok, smollm.config.vocab_size, (2,)).submit(
        Constraint("regex", "yes|no")).result()
    open_, close = tok.encode("<|im_start|>")[0], tok.encode("<|im_end|>")[0]
    V = smollm.config.vocab_size
    word = tok.encode("hello")[0]
    yes = tok.encode("yes")[0]

    def allowed(guide):
        logits = torch.zeros(1, V)
        mask_logits(logits, [guide])
        return set(torch.nonzero(logits[0] == 0).flatten().tolist())

    g = Guide(compiled, (open_, close))
    assert open_ in allowed(g) and yes in allowed(g) and word not in allowed(g)
    accept([g], [open_])
    assert word in allowed(g) and len(allowed(g)) == V          # thinking: unconstrained
    accept([g], [word])
    accept([g], [close])
    assert yes in allowed(g) and open_ not in allowed(g) and word not in allowed(g)
    g = Guide(compiled, (open_, close), thinking=True)           # the prompt opened it
    assert len(allowed(g)) == V
    g = Guide(compiled, (open_, close))
    accept([g], [yes])                                            # no reasoning: constrained
    assert open_ not in allowed(g)
    del xgr
