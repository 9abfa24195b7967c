"""The 2026 families' <think> reasoning parsers under vLLM's names (stages/parse.py
THINK_PARSERS): glm45, kimi_k2 and deepseek_v3 split as qwen3 does, minimax_m2 as
deepseek_r1 (its template opens <think>), minimax_m2_append_think splits nothing and puts
the opened <think> back in front of the content; mistral ([THINK] ... [/THINK]) and granite
("Here is my thought process:" ... "Here is my response:", or "Here's") split as qwen3 does
with their own markers. Each is the same at every cut, hides its reasoning with
include_reasoning false, and lets structured output start after the reasoning closes."""
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
from stages.parse import REASONING_PARSERS, THINK_PARSERS, Parser, markers

NEW = ("glm45", "kimi_k2", "deepseek_v3", "minimax_m2", "minimax_m2_append_think",
       "mistral", "granite")


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
    kind, marks = THINK_PARSERS[name], markers(name)
    if kind == "append":
        return "<think>" + text, ""
    if kind == "start":
        stripped = text.lstrip()
        tag = next((t for t in marks.opens if stripped.startswith(t)), None)
        if tag is None:
            return text, ""
        text = stripped[len(tag):]
    ends = [(i, t) for t in marks.closes if (i := text.find(t)) >= 0]
    if not ends:
        return "", text
    i, tag = min(ends)
    return text[i + len(tag):], text[:i]


COMMON = ["a", "b c", " ", "\n", "{\"k\": 1}"]
FRAGMENTS = {
    "<think>": COMMON + ["<think>", "</think>", "<", "</", "think", ">", "th", "ink>"],
    "[THINK]": COMMON + ["[THINK]", "[/THINK]", "[", "[/", "THINK", "]", "TH", "INK]"],
    "Here is my thought process:": COMMON + [
        "Here is my thought process:", "Here's my thought process:", "Here is my response:",
        "Here's my response:", "Here", "Here's", " is", " my", " response", ":", "'s",
        " thought process", "Here is my"],
}


@st.composite
def cut_text(draw, name):
    text = "".join(draw(st.lists(st.sampled_from(FRAGMENTS[markers(name).opens[0]]),
                                 max_size=12)))
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=6)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in zip(bounds, bounds[1:])]


def test_the_names_are_served():
    assert set(NEW) <= set(REASONING_PARSERS)


@pytest.mark.parametrize("name", NEW)
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_the_split_is_the_same_at_every_cut(name, data):
    text, pieces = data.draw(cut_text(name))
    assert joined(parse(Parser(name), pieces)) == reference(text, name)


@pytest.mark.parametrize("name, text, want", [
    ("mistral", "[THINK]plan [/THINK] ok[/THINK]", (" ok[/THINK]", "plan ")),
    ("mistral", "no think", ("no think", "")),
    ("mistral", "[THINK]unfinished", ("", "unfinished")),
    ("granite", "Here's my thought process: a Here b Here is my response: ok",
     (" ok", " a Here b ")),
    ("granite", "Here is my thought process:x Here's my response:y", ("y", "x ")),
    ("granite", "Hello Here is my thought process: x", ("Hello Here is my thought process: x", "")),
])
def test_the_markers_split_at_every_cut(name, text, want):
    for cut in range(len(text) + 1):
        assert joined(parse(Parser(name), [text[:cut], text[cut:]])) == want
    assert joined(parse(Parser(name), list(text))) == want


@pytest.mark.parametrize("name, text, content", [
    ("glm45", "<think>plan</think>{\"a\": 1}", '{"a": 1}'),
    ("kimi_k2", "<think>plan</think>{\"a\": 1}", '{"a": 1}'),
    ("deepseek_v3", "<think>plan</think>{\"a\": 1}", '{"a": 1}'),
    ("minimax_m2", "plan</think>{\"a\": 1}", '{"a": 1}'),
    ("minimax_m2_append_think", "plan</think>ok", "<think>plan</think>ok"),
    ("mistral", "[THINK]plan[/THINK]{\"a\": 1}", '{"a": 1}'),
    ("granite", "Here is my thought process: plan Here is my response: ok", " ok"),
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
        return {"<think>": 7, "</think>": 8, "[THINK]": 9, "[/THINK]": 10}.get(token)


def _tok():
    return attrs.make_class("Tok", {"hf": attrs.field(factory=_Hf)})()


@pytest.mark.parametrize("name", [n for n in NEW if n != "granite"])
def test_structured_output_starts_after_the_reasoning(name):
    """The scheduler holds a constraint back until the closing marker (stages/schedule) for
    every parser whose markers are tokens: it is given their ids."""
    from pipeline.core.startup import _think_ids

    assert _think_ids(name, _tok()) == ((9, 10) if name == "mistral" else (7, 8))


def test_granites_phrases_are_no_tokens_so_structured_output_is_constrained_whole(caplog):
    """Granite's markers are phrases of several tokens: constrained output is constrained
    from its first token, with a warning at start-up (vLLM lists granite without
    structured-output support)."""
    from pipeline.core.startup import _think_ids

    assert _think_ids("granite", _tok()) is None
    assert "'Here is my thought process:'" in caplog.text


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
