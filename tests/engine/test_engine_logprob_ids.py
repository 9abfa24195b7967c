"""Whole-vocabulary logprobs (--max-logprobs -1, `-1` in a request) and logprob_token_ids
through the whole engine (real SmolLM2), against a dense forward (issue 37)."""
from __future__ import annotations

import math

import orjson
import pytest

from stages.detokenize import token_text
from tests.support.smollm_engine import complete, dense_logprobs, engine_of

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
LABELS = [28, 9066, 2]     # three ids of SmolLM2's vocabulary


def whole_vocabulary(smollm):
    return engine_of(smollm, max_logprobs=-1)


def dense_rows(smollm, prompt: list[int], out: list[int]):
    """Row j: the log-softmax the model gives the token at output position j."""
    ref = dense_logprobs(smollm, prompt + out)
    return [ref[len(prompt) - 1 + j] for j in range(len(out))]


async def test_minus_one_is_the_whole_vocabulary(smollm):
    """top_logprobs -1 (chat) and prompt_logprobs -1 (completions), one engine."""
    ids = smollm.tokenizer.encode("Paris is the capital of")
    async with whole_vocabulary(smollm) as engine:
        out = await complete(engine, "chat", messages=QUESTION, max_tokens=2, logprobs=True,
                             top_logprobs=-1, return_token_ids=True)
        prompt = await complete(engine, prompt=ids, max_tokens=1, prompt_logprobs=-1)
    choice = out["choices"][0]
    rows = dense_rows(smollm, out["prompt_token_ids"], choice["token_ids"])
    vocab = rows[0].shape[0]
    for entry, row, tok in zip(choice["logprobs"]["content"], rows, choice["token_ids"]):
        tops = entry["top_logprobs"]
        assert len(tops) == vocab
        values = [t["logprob"] for t in tops]
        assert values == sorted(values, reverse=True)
        assert math.log(sum(math.exp(v) for v in values)) == pytest.approx(0.0, abs=1e-3)
        ref_v, ref_i = row.topk(20)
        assert values[:20] == pytest.approx(ref_v.tolist(), abs=2e-3)
        assert tops[0]["token"] == entry["token"]        # greedy: the sampled one is the top
        assert entry["logprob"] == pytest.approx(row[tok].item(), abs=2e-3)
    # every prompt position scores every id of the vocabulary
    ref = dense_logprobs(smollm, ids)
    entries = prompt["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for p in range(1, len(ids)):
        row, entry = ref[p - 1], entries[p]
        assert len(entry) == row.shape[0]                # every id of the vocabulary
        for i in (ids[p], *LABELS, int(row.argmax())):
            assert entry[str(i)]["logprob"] == pytest.approx(row[i].item(), abs=2e-3)
        assert entry[str(ids[p])]["rank"] == int((row > row[ids[p]]).sum()) + 1


async def test_logprob_token_ids_report_the_chosen_ids_at_every_position(smollm):
    body = dict(messages=QUESTION, max_tokens=4, logprobs=True, top_logprobs=5,
                logprob_token_ids=LABELS, return_token_ids=True)
    async with engine_of(smollm) as engine:    # the default --max-logprobs: no limit on ids
        out = await complete(engine, "chat", **body)
        reply = await engine.submit("chat", {"model": engine.model_names[0], "temperature": 0,
                                             **body, "stream": True})
        stream = await reply.read()
        comp = await complete(engine, prompt="The capital of France is", max_tokens=2,
                              logprobs=1, logprob_token_ids=LABELS[:2], return_token_ids=True)
    choice = out["choices"][0]
    rows = dense_rows(smollm, out["prompt_token_ids"], choice["token_ids"])
    content = choice["logprobs"]["content"]
    assert len(content) == len(choice["token_ids"]) == 4
    for entry, row, tok in zip(content, rows, choice["token_ids"]):
        # vLLM's order: the sampled token, then the chosen ids (the top 5 are not asked)
        want = list(dict.fromkeys([tok, *LABELS]))
        tops = entry["top_logprobs"]
        assert [t["token"] for t in tops] == [token_text(smollm.tokenizer, i) for i in want]
        assert [t["logprob"] for t in tops] == pytest.approx([row[i].item() for i in want],
                                                             abs=2e-3)
    # streamed: the same entries, chunk by chunk
    streamed = []
    for event in stream.split(b"\n\n"):
        if event.startswith(b"data: {"):
            for c in orjson.loads(event[6:])["choices"]:
                streamed += (c.get("logprobs") or {}).get("content") or []
    # the streamed request's prompt is a prefix-cache hit: its last prompt token runs as a
    # one-row chunk (another kernel path), so the values agree to fp32 rounding, not bit for bit
    def shape(entries):
        return [(e["token"], e["bytes"], [(t["token"], t["bytes"]) for t in e["top_logprobs"]])
                for e in entries]
    def values(entries):
        return [v for e in entries for v in (e["logprob"], *(t["logprob"] for t in e["top_logprobs"]))]
    assert shape(streamed) == shape(content)
    assert values(streamed) == pytest.approx(values(content), abs=1e-4)
    # completions: the legacy dict, the sampled token first
    c = comp["choices"][0]
    rows = dense_rows(smollm, c["prompt_token_ids"], c["token_ids"])
    for top, row, tok in zip(c["logprobs"]["top_logprobs"], rows, c["token_ids"]):
        want = list(dict.fromkeys([tok, *LABELS[:2]]))
        assert list(top) == [token_text(smollm.tokenizer, i) for i in want]
        assert list(top.values()) == pytest.approx([row[i].item() for i in want], abs=2e-3)
