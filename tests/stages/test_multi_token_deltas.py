"""Deltas of several tokens (speculative decoding emits up to 1 + K per step; so does
--stream-interval downstream): detokenize and parse give what one token a delta gives.
The Harmony crossing from the analysis channel to the final one inside one delta must not
leak reasoning into content (vLLM's test_gpt_oss_speculative_reasoning_leakage)."""
from __future__ import annotations

import pytest

from pipeline.tools.harness import run_stage
from stages import detokenize, parse
from stages.delta import Delta, FinishReason
from stages.messages import Step
from tests.support.harmony_turns import AUTO, call, completion, joined, parse as parse_pieces, said
from tests.support.rendered import rendered


@pytest.fixture(scope="module")
def enc():
    from gpu.tokenizers.harmony import harmony_encoding
    return harmony_encoding()


@pytest.fixture(scope="module")
def harmony_tokenizer():
    from gpu.tokenizers.harmony import harmony_tokenizer
    return harmony_tokenizer()


def by_size(ids: list[int], k: int) -> list[list[int]]:
    return [ids[i:i + k] for i in range(0, len(ids), k)]


async def test_one_step_across_analysis_end_and_final_start(enc, harmony_tokenizer):
    """One Step whose delta holds `...analysis<|end|><|start|>assistant<|channel|>final
    <|message|>4`: through the detokenize and parse stages, the reasoning is the analysis
    text and the content is "4", nothing of either in the other."""
    ids = completion(enc, said("2 plus 2 is 4.", "analysis"), said("4", "final"))
    tail = enc.encode("<|end|><|start|>assistant<|channel|>final<|message|>4",
                      allowed_special="all")
    cut = len(ids) - 1 - len(tail) - 3        # the last delta: analysis text's end and all that
    assert ids[cut + 3:-1] == tail
    req = rendered("r1", api="chat", stream=True)
    steps = [Step(0, (req,), (Delta("r1", tuple(ids[:cut])),)),
             Step(1, (), (Delta("r1", tuple(ids[cut:-1])),)),
             Step(2, (), (Delta("r1", (ids[-1],), FinishReason.STOP),))]
    out = await run_stage(detokenize.run, inputs={"receive": steps}, outputs=("send", "control"),
                          core=detokenize.Detokenizer(harmony_tokenizer))
    parsed = await run_stage(parse.run, inputs={"receive": out["send"]}, outputs=("send",),
                             core=parse.Parser("openai_gptoss"))
    deltas = [d for s in parsed["send"] for d in s.deltas]
    assert joined(deltas) == ("4", "2 plus 2 is 4.", [], FinishReason.STOP)
    crossing = deltas[1]
    assert crossing.content == "4" and crossing.reasoning.endswith(" 4.")


CASES = {
    "answer": (lambda enc: completion(enc, said("The user greets.", "analysis"),
                                      said("Hello there!", "final")),
               None, ("Hello there!", "The user greets.", [], FinishReason.STOP)),
    "call": (lambda enc: completion(enc, said("Need the weather.", "analysis"),
                                    said("Checking.", "commentary"),
                                    call("get_weather", '{"city":"Paris"}')),
             AUTO, ("Checking.", "Need the weather.", [(0, "get_weather", '{"city":"Paris"}')],
                    FinishReason.TOOL_CALLS)),
    "unicode": (lambda enc: completion(enc, said("東京 🙂", "analysis"), said("Zürich 🙂", "final")),
                None, ("Zürich 🙂", "東京 🙂", [], FinishReason.STOP)),
}


@pytest.mark.parametrize("k", range(1, 7))
@pytest.mark.parametrize("case", sorted(CASES))
def test_harmony_parse_with_deltas_of_k_tokens(enc, case, k):
    make, plan, expected = CASES[case]
    ids = make(enc)
    _, deltas = parse_pieces(by_size(ids, k), plan=plan)
    assert joined(deltas) == expected
    # and k tokens a delta from any offset (a verify step lands anywhere)
    for offset in range(1, k):
        _, deltas = parse_pieces([ids[:offset], *by_size(ids[offset:], k)], plan=plan)
        assert joined(deltas) == expected


@pytest.mark.parametrize("k", range(1, 7))
def test_detokenize_stop_string_in_a_delta_of_k_tokens(smollm_tokenizer, k):
    """A stop string inside a delta of k tokens: the text ends before it, and the tokens
    after the one that completes it are neither shown nor counted (token_ids, logprobs)."""
    tok = smollm_tokenizer
    ids = tok.encode(" one two three four five six seven eight nine ten")
    req = rendered("r1", api="completions", stop=["five"], max_tokens=20)
    core = detokenize.Detokenizer(tok)
    out_ids, text, stopped = [], "", []
    for i, piece in enumerate(by_size(ids, k)):
        step = Step(i, (req,) if i == 0 else (), (Delta("r1", tuple(piece)),))
        out, st = core.process(step)
        stopped += st
        for d in out.deltas:
            out_ids += d.token_ids
            text += d.text
        if stopped:
            break
    assert text == " one two three four "
    five = next(i for i in range(len(ids)) if "five" in tok.decode(ids[:i + 1]))
    assert out_ids == ids[:five + 1]
    assert stopped == [("r1", 0)]


@pytest.mark.parametrize("k", range(1, 7))
def test_think_reasoning_with_deltas_of_k_tokens(smollm_tokenizer, k):
    """qwen3's <think> split over real token deltas of k tokens each."""
    tok = smollm_tokenizer
    ids = tok.encode("<think>short thought</think>The answer is 4.")
    req = rendered("r1", api="chat", stream=True)
    core = detokenize.Detokenizer(tok)
    parser = parse.Parser("qwen3")
    deltas = []
    pieces = by_size(ids, k)
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        step = Step(i, (req,) if i == 0 else (),
                    (Delta("r1", tuple(piece), FinishReason.LENGTH if last else None),))
        out, _ = core.process(step)
        deltas += parser.process(out).deltas
    assert ("".join(d.content for d in deltas), "".join(d.reasoning for d in deltas)) == \
        ("The answer is 4.", "short thought")
