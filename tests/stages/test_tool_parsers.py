"""Tool-call parsers: the same content and calls whatever the pieces the text arrives in."""
from __future__ import annotations

import json

import pytest

from stages.api.tool_parsers import (TOOL_PARSERS, NamedToolParser, RequiredToolParser, ToolCall,
                                 call_id)


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

CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
               '"unit": "c"}}\n</tool_call>', "Let me check.\n", [W]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
               '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
     "", [W, T]),
    ("hermes", "No tools needed: 2 < 3 and <tool is not a tag.", "No tools needed: 2 < 3 and "
               "<tool is not a tag.", []),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {}}', "", [T]),     # unclosed at the end
    ("hermes", "<tool_call>not json</tool_call> done", "<tool_call>not json</tool_call> done", []),
    ("hermes", 'x <tool_call>{"name": "get_time", "arguments": "{}"}</tool_call> trailing',
     "x ", [T]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}',
     "", [W]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
                    '"unit": "c"}}; {"name": "get_time", "parameters": {}}', "", [W, T]),
    ("llama3_json", "  The weather is {fine}.", "  The weather is {fine}.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", '{"name": "get_time", "parameters": {"s": "a } \\" {"}}',
     "", [ToolCall("get_time", '{"s": "a } \\" {"}')]),
    ("pythonic", "[get_weather(city='Paris', unit=\"c\"), get_time()]", "", [W, T]),
    ("pythonic", "[get_time(flag=True, x=None, l=[1, 2])]",
     "", [ToolCall("get_time", '{"flag": true, "x": null, "l": [1, 2]}')]),
    ("pythonic", "Sure, [1, 2] is a list.", "Sure, [1, 2] is a list.", []),
    ("pythonic", "[1, 2]", "[1, 2]", []),
    ("pythonic", "[get_time(", "[get_time(", []),
]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_same_result_at_every_split(name, text, content, calls):
    for pieces in splits(text):
        got = run(TOOL_PARSERS[name](), pieces)
        assert got == (content, calls), pieces
    for c in calls:
        json.loads(c.arguments)


def test_named_and_required():
    text = '{"city": "Paris"}'
    for pieces in splits(text):
        assert run(NamedToolParser("get_weather"), pieces) == (
            "", [ToolCall("get_weather", text)])
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}, ' \
           '{"name": "get_time", "parameters": {}}]'
    for pieces in splits(text):
        assert run(RequiredToolParser(), pieces) == ("", [W, T])
    assert run(RequiredToolParser(), ['[{"name": "get_w']) == ('[{"name": "get_w', [])
    # cut by max tokens: no call with the broken arguments, the text is the content
    for pieces in splits('{"city": "Pa'):
        assert run(NamedToolParser("get_weather"), pieces) == ('{"city": "Pa', [])


def test_call_ids_are_stable_and_distinct():
    assert call_id("r1", 0) == call_id("r1", 0) != call_id("r1", 1) != call_id("r2", 0)
    assert call_id("r1", 0).startswith("call_")
