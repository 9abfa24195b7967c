"""The 2026 families' tool-call formats (stages/api/tool_parsers/tagged.py, mistral.py,
pythonic.py's llama4_pythonic): the same content and calls whatever the pieces the text
arrives in, tested at every split, as tests/stages/test_tool_parsers.py tests the others.
Each format: zero-argument calls, nested JSON and escaped quotes, several calls in a turn,
text before the calls, and text that only looks like a call."""
from __future__ import annotations

import json

import pytest

from stages.api.tool_parsers import TOOL_PARSERS, ToolCall


def run(parser, pieces):
    content, calls = "", []
    for i, piece in enumerate(pieces):
        c, k = parser.feed(piece, i == len(pieces) - 1)
        content += c
        calls += k
    return content, calls


def splits(text):
    """Whole, char by char, and cut in two at every boundary."""
    yield [text]
    yield list(text) or [""]
    for k in range(1, len(text)):
        yield [text[:k], text[k:]]
    yield [text, ""]

W = ToolCall("get_weather", '{"city": "Paris", "unit": "c"}')
T = ToolCall("get_time", "{}")
NESTED = {"q": 'say "hi"', "opts": {"deep": [1, {"x": None}]}, "n": 3}
N = ToolCall("search", json.dumps(NESTED, ensure_ascii=False))
NESTED_JSON = json.dumps(NESTED)

DS = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", \
    "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def qwen(name, **params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def glm(name, **params):
    body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n"
                   for k, v in params.items())
    return f"<tool_call>{name}\n{body}</tool_call>"


def kimi(*calls):
    inner = "".join(f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{a}"
                    "<|tool_call_end|>" for i, (n, a) in enumerate(calls))
    return f"<|tool_calls_section_begin|>{inner}<|tool_calls_section_end|>"


def ds3(*calls):
    inner = "".join(f"{DS[2]}function{DS[4]}{n}\n```json\n{a}\n```{DS[3]}" for n, a in calls)
    return DS[0] + inner + DS[1]


def ds31(*calls):
    return DS[0] + "".join(f"{DS[2]}{n}{DS[4]}{a}{DS[3]}" for n, a in calls) + DS[1]


def minimax(*calls):
    inner = "".join(f'<invoke name="{n}">\n' + "".join(
        f'<parameter name="{k}">{v}</parameter>\n' for k, v in params.items()) + "</invoke>\n"
        for n, params in calls)
    return f"<minimax:tool_call>\n{inner}</minimax:tool_call>"


WEATHER = {"city": "Paris", "unit": "c"}
CASES = [
    # Qwen3-Coder / Qwen3.5 XML
    ("qwen3_coder", "Let me look.\n" + qwen("get_weather", city="Paris", unit="c"),
     "Let me look.\n", [W]),
    ("qwen3_xml", qwen("get_weather", city="Paris", unit="c") + "\n" + qwen("get_time"),
     "", [W, T]),
    ("qwen3_coder", qwen("search", q='say "hi"', opts=json.dumps(NESTED["opts"]), n=3),
     "", [N]),
    ("qwen3_coder", "x < y and <tool is text", "x < y and <tool is text", []),
    ("qwen3_coder", "<tool_call>not a call</tool_call>", "<tool_call>not a call</tool_call>", []),
    ("qwen3_coder", "<think>why</think>\n" + qwen("get_time"), "<think>why</think>\n", [T]),
    # GLM-4.5/4.6/4.7
    ("glm45", "Checking.\n" + glm("get_weather", city="Paris", unit="c"), "Checking.\n", [W]),
    ("glm45", glm("get_weather", city="Paris", unit="c") + glm("get_time"), "", [W, T]),
    ("glm45", glm("search", q='say "hi"', opts=json.dumps(NESTED["opts"]), n=3), "", [N]),
    ("glm45", "<tool_call>{\"not\": 1}</tool_call>", "<tool_call>{\"not\": 1}</tool_call>", []),
    # Kimi K2
    ("kimi_k2", "Sure. " + kimi(("get_weather", json.dumps(WEATHER)), ("get_time", "{}")),
     "Sure. ", [W, T]),
    ("kimi_k2", kimi(("search", NESTED_JSON)), "", [N]),
    ("kimi_k2", "<|tool_calls_section_begin|>junk<|tool_calls_section_end|>",
     "<|tool_calls_section_begin|>junk<|tool_calls_section_end|>", []),
    # DeepSeek V3 and V3.1
    ("deepseek_v3", "Hm. " + ds3(("get_weather", json.dumps(WEATHER)), ("get_time", "{}")),
     "Hm. ", [W, T]),
    ("deepseek_v3", ds3(("search", NESTED_JSON)), "", [N]),
    ("deepseek_v31", ds31(("get_weather", json.dumps(WEATHER)), ("get_time", "{}")), "",
     [W, T]),
    ("deepseek_v31", "A " + ds31(("search", NESTED_JSON)), "A ", [N]),
    # MiniMax M2
    ("minimax_m2", "Ok.\n" + minimax(("get_weather", WEATHER), ("get_time", {})), "Ok.\n",
     [W, T]),
    ("minimax_m2", minimax(("search", {"q": 'say "hi"', "opts": json.dumps(NESTED["opts"]),
                                       "n": 3})), "", [N]),
    # Mistral: the JSON-array form and v11+'s NAME[ARGS]{...}
    ("mistral", 'Let me check. [TOOL_CALLS][{"name": "get_weather", "arguments": '
                f'{json.dumps(WEATHER)}}}, {{"name": "get_time", "arguments": {{}}}}]',
     "Let me check. ", [W, T]),
    ("mistral", f"[TOOL_CALLS]get_weather[ARGS]{json.dumps(WEATHER)}[TOOL_CALLS]get_time[ARGS]{{}}",
     "", [W, T]),
    ("mistral", f"[TOOL_CALLS]search[CALL_ID]a1b2c3d4e[ARGS]{NESTED_JSON}", "", [N]),
    ("mistral", "No calls [TOOL here.", "No calls [TOOL here.", []),
    ("mistral", "[TOOL_CALLS]not a call", "[TOOL_CALLS]not a call", []),
    # Llama 4
    ("llama4_pythonic", "<|python_start|>[get_weather(city='Paris', unit='c'), get_time()]"
                        "<|python_end|>", "", [W, T]),
    ("llama4_pythonic", "[search(q='say \"hi\"', opts={'deep': [1, {'x': None}]}, n=3)]", "",
     [N]),
]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_same_result_at_every_split(name, text, content, calls):
    for pieces in splits(text):
        got_content, got_calls = run(TOOL_PARSERS[name](), pieces)
        assert (got_content, got_calls) == (content, calls), pieces


@pytest.mark.parametrize("name", ["qwen3_coder", "glm45", "kimi_k2", "deepseek_v3",
                                  "deepseek_v31", "minimax_m2"])
def test_text_after_the_calls_is_dropped_and_an_open_block_ends_with_the_answer(name):
    text = {"qwen3_coder": qwen("get_time"), "glm45": glm("get_time"),
            "kimi_k2": kimi(("get_time", "{}")), "deepseek_v3": ds3(("get_time", "{}")),
            "deepseek_v31": ds31(("get_time", "{}")),
            "minimax_m2": minimax(("get_time", {}))}[name]
    assert run(TOOL_PARSERS[name](), [text, " trailing words"]) == ("", [T])
    close = {"qwen3_coder": "</tool_call>", "glm45": "</tool_call>",
             "kimi_k2": "<|tool_calls_section_end|>", "deepseek_v3": DS[1],
             "deepseek_v31": DS[1], "minimax_m2": "</minimax:tool_call>"}[name]
    for pieces in splits(text.removesuffix(close)):
        assert run(TOOL_PARSERS[name](), pieces) == ("", [T])


@pytest.mark.parametrize("name, text, content, calls", [c for c in CASES if c[3]])
def test_through_the_parse_stage_token_by_token(name, text, content, calls):
    """The parse stage (stages/parse.py) fed one character a step, as a stream is: the
    same content, the same calls, and finish_reason tool_calls."""
    import attrs

    from tests.support.rendered import rendered
    from stages.delta import Delta, FinishReason, Usage
    from stages.messages import Step, ToolPlan
    from stages.parse import Parser

    req = attrs.evolve(rendered("r1", api="chat", stream=True),
                       tools=ToolPlan("auto", parser=name))
    parser, deltas = Parser(), []
    pieces = list(text)
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        d = Delta("r1", (5,), FinishReason.STOP if last else None, text=piece,
                  usage=Usage(3, i + 1) if last else None)
        deltas += parser.process(Step(i, (req,) if i == 0 else (), (d,))).deltas
    assert "".join(d.content for d in deltas) == content
    got = [c for d in deltas for c in d.tool_calls]
    assert [(c.name, c.arguments) for c in got] == [(c.name, c.arguments) for c in calls]
    assert deltas[-1].finish_reason is FinishReason.TOOL_CALLS
