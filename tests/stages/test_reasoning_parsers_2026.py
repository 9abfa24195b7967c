"""The 2026 families' <think> reasoning parsers under vLLM's names (stages/parse.py
THINK_PARSERS): glm45, kimi_k2 and deepseek_v3 split as qwen3 does, minimax_m2 as
deepseek_r1 (its template opens <think>), minimax_m2_append_think splits nothing and puts
the opened <think> back in front of the content. Each is the same at every cut, hides its
reasoning with include_reasoning false, and lets structured output start after </think>."""
from __future__ import annotations

import attrs
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.rendered import rendered
from stages.emit import framer_for
from stages.delta import Delta, FinishReason, Usage
from stages.messages import Step
from stages.parse import REASONING_PARSERS, THINK_PARSERS, Parser

NEW = ("glm45", "kimi_k2", "deepseek_v3", "minimax_m2", "minimax_m2_append_think")


def parse(parser: Parser, pieces: list[str], req=None) -> list[Delta]:
    req = req or rendered("a", api="chat")
    out = []
    for i, text in enumerate(pieces):
        last = i == len(pieces) - 1
        d = Delta(req.request_id, (i,), FinishReason.STOP if last else None, text=text,
                  content=text, usage=Usage(3, i + 1) if last else None)
        out += parser.process(Step(i, (req,) if i == 0 else (), (d,))).deltas
    return out


def joined(deltas: list[Delta]) -> tuple[str, str]:
    return "".join(d.content for d in deltas), "".join(d.reasoning for d in deltas)


def reference(text: str, name: str) -> tuple[str, str]:
    """(content, reasoning), from the rule: reasoning only inside a leading <think> (the
    qwen3 kind), or from the start (the template opened it), to the first </think>."""
    kind = THINK_PARSERS[name]
    if kind == "append":
        return "<think>" + text, ""
    if kind == "start":
        stripped = text.lstrip()
        if not stripped.startswith("<think>"):
            return text, ""
        text = stripped[len("<think>"):]
    reasoning, closed, content = text.partition("</think>")
    return (content, reasoning) if closed else ("", reasoning)


FRAGMENTS = st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "th", "ink>",
                             "a", "b c", " ", "\n", "{\"k\": 1}"])


@st.composite
def cut_text(draw):
    text = "".join(draw(st.lists(FRAGMENTS, max_size=12)))
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=6)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in zip(bounds, bounds[1:])]


def test_the_names_are_served():
    assert set(NEW) <= set(REASONING_PARSERS)


@pytest.mark.parametrize("name", NEW)
@settings(max_examples=100, deadline=None)
@given(case=cut_text())
def test_the_split_is_the_same_at_every_cut(name, case):
    text, pieces = case
    assert joined(parse(Parser(name), pieces)) == reference(text, name)


@pytest.mark.parametrize("name, text, content", [
    ("glm45", "<think>plan</think>{\"a\": 1}", '{"a": 1}'),
    ("kimi_k2", "<think>plan</think>{\"a\": 1}", '{"a": 1}'),
    ("deepseek_v3", "<think>plan</think>{\"a\": 1}", '{"a": 1}'),
    ("minimax_m2", "plan</think>{\"a\": 1}", '{"a": 1}'),
    ("minimax_m2_append_think", "plan</think>ok", "<think>plan</think>ok"),
])
def test_include_reasoning_false_hides_the_reasoning(name, text, content):
    req = rendered("a", api="chat", body={"include_reasoning": False})
    deltas = parse(Parser(name), list(text), req)
    framer = framer_for(req)
    body = orjson.loads(b"".join(framer.on_delta(d) for d in deltas))
    message = body["choices"][0]["message"]
    assert message["content"] == content and not message.get("reasoning")


class _Hf:
    def token_to_id(self, token):
        return {"<think>": 7, "</think>": 8}.get(token)


@pytest.mark.parametrize("name", NEW)
def test_structured_output_starts_after_the_reasoning(name):
    """The scheduler holds a constraint back until </think> (stages/schedule) for every
    <think> parser: it is given the tags' ids."""
    from pipeline.core.startup import _think_ids

    assert _think_ids(name, attrs.make_class("Tok", {"hf": attrs.field(factory=_Hf)})()) \
        == (7, 8)


@pytest.mark.parametrize("name, prompt_end, text, want", [
    # deepseek_v3's thinking per request is its template's: <think> opened, or closed
    ("deepseek_v3", "<think>", "plan</think>answer", ("answer", "plan")),
    ("deepseek_v3", "</think>", "answer", ("answer", "")),
    ("glm45", "</think>", "<think>x", ("<think>x", "")),
])
def test_the_prompts_last_tag_decides(name, prompt_end, text, want):
    from stages.parse import ThinkState

    state = ThinkState(name, "reasoning" if prompt_end == "<think>" else "content")
    content, reasoning, _, _ = state.feed(text, True)
    assert (content, reasoning) == want
