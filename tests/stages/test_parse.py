"""parse's pure core (Parser.process): the <think> split at any cut of the text, the tool
parser fed only what follows the reasoning, per-choice state, and what parse leaves alone.

Tool parsers on their own are tests/stages/test_tool_parsers.py; tool calls through parse
and framing, tests/stages/test_tools_stages.py; Harmony, tests/stages/test_harmony.py."""
from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.rendered import rendered
from stages.api.common import ToolPlan
from stages.delta import Delta, FinishReason
from stages.parse import REASONING_PARSERS, Parser
from stages.messages import Step


def parse(parser: Parser, pieces: list[str], req=None, finish=FinishReason.STOP) -> list[Delta]:
    """Each piece one delta of one token, the last one finished; the deltas parse made."""
    req = req or rendered("a", api="chat")
    out = []
    for i, text in enumerate(pieces):
        last = i == len(pieces) - 1
        d = Delta(req.request_id, (i,), finish if last else None, text=text, content=text)
        out += parser.process(Step(i, (req,) if i == 0 else (), (d,))).deltas
    return out


def joined(deltas: list[Delta]) -> tuple[str, str]:
    return "".join(d.content for d in deltas), "".join(d.reasoning for d in deltas)


def reference(text: str, parser: str) -> tuple[str, str]:
    """(content, reasoning) of a whole text, written from the rule, not from the code:
    qwen3 reasons only inside a leading <think>; deepseek_r1 starts inside one (its
    template opened it). The first </think> ends the reasoning; the rest is content."""
    if parser == "qwen3":
        stripped = text.lstrip()
        if not stripped.startswith("<think>"):
            return text, ""
        text = stripped[len("<think>"):]
    reasoning, closed, content = text.partition("</think>")
    return (content, reasoning) if closed else ("", reasoning)


FRAGMENTS = st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "th", "ink>",
                             "a", "b c", " ", "\n", "<t"])


@st.composite
def cut_text(draw):
    """A text of tag-like fragments, and the same text cut into pieces anywhere."""
    text = "".join(draw(st.lists(FRAGMENTS, max_size=12)))
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=6)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
@settings(max_examples=150, deadline=None)
@given(case=cut_text())
def test_think_split_is_the_same_at_every_cut(name, case):
    text, pieces = case
    assert joined(parse(Parser(name), pieces)) == reference(text, name)


def test_a_partial_tag_is_held_back_until_the_next_delta_decides():
    deltas = parse(Parser("qwen3"), ["  <th", "is is not a tag"])
    assert [(d.content, d.reasoning) for d in deltas] == [("", ""), ("  <this is not a tag", "")]
    deltas = parse(Parser("qwen3"), ["<think>plan</th", "ink>done"])
    assert [(d.content, d.reasoning) for d in deltas] == [("", "plan"), ("done", "")]


def test_the_last_delta_lets_go_of_a_partial_tag():
    assert joined(parse(Parser("qwen3"), ["<thi"])) == ("<thi", "")
    assert joined(parse(Parser("deepseek_r1"), ["why</thi"])) == ("", "why</thi")


def test_reasoning_tokens_exclude_the_tags_and_come_with_each_delta():
    """Each delta counts its own reasoning tokens (account sums them, so a stream's running
    usage grows with the reasoning); the tag's token is not one, nor is the answer's."""
    deltas = parse(Parser("deepseek_r1"), ["a", "b", "</think>", "c"])
    assert [d.reasoning_tokens for d in deltas] == [1, 1, 0, 0]
    assert [d.reasoning_span for d in deltas] == [1, 1, 1, 0]   # the tag is the reasoning's


class TagTokenizer:
    """A tokenizer whose <think> and </think> are one token each (as Qwen3's and
    DeepSeek-R1's): ids 1 and 2; every other character its own id from 10."""
    TAGS = {"<think>": 1, "</think>": 2}
    tool_call_ids = "openai"     # gpu.tokenizers.tokenizer.Tokenizer's: the form of its tool-call ids

    def encode(self, text, add_special_tokens=False):
        return [self.TAGS[text]] if text in self.TAGS else [10 + ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        names = {v: k for k, v in self.TAGS.items()}
        return "".join(names.get(i) or chr(i - 10) for i in ids)


class TextTokenizer(TagTokenizer):
    """One token per character, tags included (as SmolLM2 spells them: several tokens)."""
    TAGS = {}


def steps(parser: Parser, req, pieces: list[tuple[int, ...]], tok) -> list[Delta]:
    """Each piece a delta of several tokens (as a speculative step brings them)."""
    out = []
    for i, ids in enumerate(pieces):
        last = i == len(pieces) - 1
        d = Delta(req.request_id, ids, FinishReason.STOP if last else None,
                  text=tok.decode(ids), content=tok.decode(ids))
        out += parser.process(Step(i, (req,) if i == 0 else (), (d,))).deltas
    return out


@pytest.mark.parametrize("tok", [TagTokenizer(), TextTokenizer()], ids=["tag-ids", "text"])
@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_a_prompt_that_opens_think_starts_the_output_inside_the_reasoning(name, tok):
    """The template opened <think> (Qwen3 thinking, DeepSeek-R1): the reasoning and the
    literal </think> stay out of the content, for every choice of n > 1."""
    enc = lambda s: tuple(tok.encode(s)) if s in tok.TAGS else tuple(10 + ord(c) for c in s)
    prompt = enc("<|user|>hi<|assistant|>") + enc("<think>") + enc("\n")
    req = attrs.evolve(rendered("a", prompt=prompt, api="chat", body={"n": 2}), n=2)
    parser = Parser(name, tok)
    for index in (0, 1):
        text = "plan</think>answer"
        pieces = [enc("pl"), enc("an"), enc("</think>") + enc("ans"), enc("wer")]
        out = []
        for i, ids in enumerate(pieces):
            d = Delta("a", ids, FinishReason.STOP if i == 3 else None, text=tok.decode(ids),
                      content=tok.decode(ids), index=index)
            out += parser.process(Step(i + 10 * index, (req,) if i == 0 and index == 0 else (),
                                       (d,))).deltas
        assert joined(out) == ("answer", "plan"), (index, text)
    assert parser.states == {}


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_a_prompt_that_closed_think_makes_the_output_content(name):
    """Thinking off (`<think>\n\n</think>` in the prompt): all of it is content, even
    a <think> the model writes (as vLLM, whose parser sees the reasoning ended)."""
    tok = TagTokenizer()
    prompt = (20, 1, 30, 30, 2, 30)
    req = rendered("a", prompt=prompt, api="chat")
    out = steps(Parser(name, tok), req, [(1, 90), (91,)], tok)
    assert joined(out) == ("<think>PQ", "")
    assert sum(d.reasoning_tokens for d in out) == 0


def test_a_prompt_with_neither_tag_keeps_each_parsers_start():
    tok = TagTokenizer()
    req = rendered("a", prompt=(20, 21), api="chat")
    assert joined(steps(Parser("qwen3", tok), req, [(90,), (2, 91)], tok)) == ("P</think>Q", "")
    assert joined(steps(Parser("deepseek_r1", tok), req, [(90,), (2, 91)], tok)) == ("Q", "P")
    # without a tokenizer nothing reads the prompt: the parsers' own starts
    opened = rendered("b", prompt=(20, 1), api="chat")
    assert joined(parse(Parser("qwen3"), ["x"], opened)) == ("x", "")


def test_each_prompt_of_a_batch_decides_for_its_own_choices():
    tok = TagTokenizer()
    req = attrs.evolve(rendered("a", prompt=(20, 1), api="chat"), prompts=((20, 1), (20, 21)))
    parser = Parser("qwen3", tok)
    first = parser.process(Step(0, (req,), (Delta("a", (90,), text="P", index=0),
                                            Delta("a", (91,), text="Q", index=1))))
    assert [(d.content, d.reasoning) for d in first.deltas] == [("", "P"), ("Q", "")]


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_reasoning_tokens_of_deltas_of_several_tokens(name):
    """A delta of several tokens that crosses a tag: with one-token tags the count splits
    at the tag's token, tag excluded; the span covers the reasoning and its tag."""
    tok = TagTokenizer()
    req = rendered("a", prompt=(20, 1), api="chat")     # the prompt opened <think>
    out = steps(Parser(name, tok), req, [(90, 91), (92, 2, 93, 94), (95,)], tok)
    assert joined(out) == ("STU", "PQR")
    assert [d.reasoning_tokens for d in out] == [2, 1, 0]
    assert [d.reasoning_span for d in out] == [2, 2, 0]
    # opened and closed in one delta (qwen3 from its start: no tag in the prompt)
    req = rendered("b", prompt=(20,), api="chat")
    [d] = steps(Parser("qwen3", tok), req, [(1, 90, 91, 2, 92)], tok)
    assert (d.reasoning, d.content, d.reasoning_tokens, d.reasoning_span) == ("PQ", "R", 2, 4)
    # tags of several tokens (no reasoning model spells them so): each taken to be one
    # token of the delta, the rule for one token per delta
    text = TextTokenizer()
    req = rendered("c", prompt=(20,), api="chat")
    [d] = steps(Parser("deepseek_r1", text), req, [tuple(10 + ord(c) for c in "ab</think>c")],
                text)
    assert (d.reasoning, d.content, d.reasoning_tokens) == ("ab", "c", 11 - 1)


def test_choices_keep_their_own_state_and_it_is_dropped_when_they_end():
    parser = Parser("qwen3")
    req = rendered("a", api="chat", body={"n": 2})
    first = parser.process(Step(0, (req,), (Delta("a", (1,), text="<think>x", index=0),
                                            Delta("a", (2,), text="plain", index=1))))
    assert [(d.content, d.reasoning) for d in first.deltas] == [("", "x"), ("plain", "")]
    last = parser.process(Step(1, (), (Delta("a", (3,), FinishReason.STOP, text="y", index=0),
                                       Delta("a", (4,), FinishReason.STOP, text="z", index=1))))
    assert [(d.content, d.reasoning) for d in last.deltas] == [("", "y"), ("z", "")]
    assert parser.states == {} and parser.tools == {} and parser.harmony == {}


def test_tool_calls_are_looked_for_after_the_reasoning_only():
    """With a reasoning parser and a tool plan, a call written while reasoning is not a call;
    the one after </think> is, cut across deltas anywhere."""
    plan = ToolPlan("auto", parser="hermes")
    req = attrs.evolve(rendered("a", api="chat", body={
        "tools": [{"type": "function", "function": {"name": "get_weather"}}]}), tools=plan)
    text = ('<think>maybe <tool_call>{"name": "x", "arguments": {}}</tool_call>?</think>'
            'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>')
    for size in (1, 5, 17, len(text)):
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        deltas = parse(Parser("qwen3"), pieces, req)
        content, reasoning = joined(deltas)
        assert reasoning == 'maybe <tool_call>{"name": "x", "arguments": {}}</tool_call>?'
        assert content.strip() == "Sure."
        calls = [c for d in deltas for c in d.tool_calls]
        assert [(c.index, c.name, c.arguments) for c in calls] == [
            (0, "get_weather", '{"city": "Paris"}')], size
        assert calls[0].id.startswith("call_")
        assert deltas[-1].finish_reason is FinishReason.TOOL_CALLS


def test_without_a_parser_the_step_passes_through_untouched():
    parser = Parser(None)
    step = Step(0, (rendered("a"),), (Delta("a", (1,), text="<think>x", content="<think>x"),))
    assert parser.process(step) is step
    # a delta whose content is not its text (as an old log may hold) is reset to the text
    stale = Step(1, (), (Delta("a", (2,), text="y", content="other", reasoning="r"),))
    [d] = parser.process(stale).deltas
    assert (d.content, d.reasoning, d.reasoning_tokens) == ("y", "", 0)


def test_an_unknown_reasoning_parser_names_the_choices():
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2d2'") as info:
        Parser("r2d2")
    assert all(name in str(info.value) for name in REASONING_PARSERS)
