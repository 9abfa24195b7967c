"""tools and tool_choice in render: template tools, the parse plan, constraints, 400s."""
from __future__ import annotations

import json

import pytest

from gpu.worker.grammar import check
from stages.api.common import RequestError, ToolPlan, ToolSettings
from stages.api.structured import refusal
from tests.support.render_requests import FakeTokenizer, chat, error_of, make_ctx, responses

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
HERMES = ToolSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")


class ToolsTokenizer(FakeTokenizer):
    def apply_chat_template(self, messages, *, add_generation_prompt=True, tools=None, **kw):
        self.tools = tools
        self.messages = messages
        return super().apply_chat_template(messages, add_generation_prompt=add_generation_prompt)


def ctx(settings=HERMES):
    c = make_ctx(200, tools=settings)
    object.__setattr__(c, "tokenizer", ToolsTokenizer())
    return c


def test_auto_reaches_the_template_and_plans_the_parser():
    c = ctx()
    req = chat({"tools": [WEATHER, TIME]}, c)
    assert c.tokenizer.tools == [WEATHER, TIME]
    assert req.tools == ToolPlan("auto", parser="hermes")
    assert req.sampling.constraint is None


def test_none_keeps_tools_in_the_prompt_unless_excluded():
    c = ctx()
    assert chat({"tools": [WEATHER], "tool_choice": "none"}, c).tools is None
    assert c.tokenizer.tools == [WEATHER]
    c = ctx(ToolSettings(exclude_tools_when_tool_choice_none=True))
    chat({"tools": [WEATHER], "tool_choice": "none"}, c)
    assert c.tokenizer.tools is None


def test_named_and_required_are_constrained():
    named = chat({"tools": [WEATHER, TIME], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}}, ctx())
    assert named.tools == ToolPlan("named", name="get_weather")
    assert json.loads(named.sampling.constraint.spec) == WEATHER["function"]["parameters"]
    required = chat({"tools": [WEATHER, TIME], "tool_choice": "required",
                     "parallel_tool_calls": False}, ctx())
    assert required.tools == ToolPlan("required", parallel=False)
    schema = json.loads(required.sampling.constraint.spec)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2


def test_history_with_tool_calls_reaches_the_template():
    c = ctx()
    chat({"tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "20C"}]},
    ]}, c)
    assistant, tool = c.tokenizer.messages[1], c.tokenizer.messages[2]
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert tool == {"role": "tool", "content": "20C", "tool_call_id": "call_1"}


@pytest.mark.parametrize("settings, body, param, words", [
    (ToolSettings(), {"tools": [WEATHER]}, "tool_choice", "--enable-auto-tool-choice"),
    (ToolSettings(), {"tools": [WEATHER], "tool_choice": "required"}, "tool_choice",
     "--tool-call-parser"),
    (ToolSettings(), {"tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}}, "tool_choice",
     "function get_weather needs a tool-call parser: serve with --tool-call-parser"),
    (HERMES, {"tools": [WEATHER], "tool_choice": {"type": "function",
                                                  "function": {"name": "nope"}}},
     "tool_choice", "nope"),
    (HERMES, {"tools": [{"type": "function", "function": {"description": "x"}}]},
     "tools[0].function.name", "name"),
    (HERMES, {"tools": [{"type": "retrieval"}]}, "tools[0].type", "function"),
    (HERMES, {"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
     "tools[0].function.parameters", "schema"),
    (HERMES, {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "bogus"}}}], "tool_choice": "required"},
     "tools", "bogus"),
    (HERMES, {"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"},
     "tool_choice", "structured outputs"),
    (HERMES, {"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "required"),
])
def test_tool_errors_are_400_and_say_what_to_do(settings, body, param, words):
    try:    # render refuses the request's shape; admit a schema that does not parse
        err = refusal(chat(body, ctx(settings)).sampling.constraint, check)
    except RequestError as exc:
        err = exc
    assert err is not None
    assert (err.status, err.param) == (400, param)
    assert words in err.message and "'" not in err.message.replace(f"'{param}'", ""), err.message


def test_responses_function_tools_and_items():
    c = ctx()
    req = responses({"tools": [{"type": "function", "name": "get_weather",
                                "parameters": WEATHER["function"]["parameters"]}],
                     "input": [
                         {"role": "user", "content": "Weather in Paris?"},
                         {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                          "arguments": '{"city": "Paris"}'},
                         {"type": "function_call_output", "call_id": "call_1",
                          "output": "20C"}]}, c)
    assert req.tools == ToolPlan("auto", parser="hermes")
    assert c.tokenizer.tools[0]["function"]["name"] == "get_weather"
    assistant, tool = c.tokenizer.messages[1], c.tokenizer.messages[2]
    assert assistant["tool_calls"][0]["function"] == {"name": "get_weather",
                                                      "arguments": {"city": "Paris"}}
    assert tool["role"] == "tool" and tool["tool_call_id"] == "call_1"
    assert tool["content"] == "20C"
