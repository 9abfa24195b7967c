"""Tool calling over HTTP with the official openai client, against SmolLM2 served with
--enable-auto-tool-choice --tool-call-parser hermes (and the default server for 400s)."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "description": "The weather in a city",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                           "parameters": {"type": "object", "properties": {}}}}]
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def check_call(call):
    assert call.id.startswith("call_") and call.type == "function"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed, n", [(0, 1), (1, 2)])
def test_required_always_calls_a_tool(tools_client, seed, n):
    r = tools_client.chat.completions.create(
        model="", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120,
        temperature=1.0, seed=seed, n=n)
    assert len(r.choices) == n
    ids = set()
    for choice in r.choices:   # each choice: its own matcher and parser
        # the model may go on adding calls to the array until max_tokens: those before the cut
        assert choice.finish_reason in ("tool_calls", "length"), choice
        assert choice.message.content is None and choice.message.tool_calls
        for call in choice.message.tool_calls:
            check_call(call)
            ids.add(call.id)
    assert len(ids) == sum(len(c.message.tool_calls) for c in r.choices)


def test_named_streams_openai_tool_call_deltas(tools_client):
    stream = tools_client.chat.completions.create(
        model="", messages=ASK, tools=TOOLS, max_tokens=60, stream=True, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls, reasons = {}, []
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        for d in choice.delta.tool_calls or []:
            if d.id is not None:
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            calls[d.index]["arguments"] += d.function.arguments or ""
        if choice.finish_reason:
            reasons.append(choice.finish_reason)
    assert reasons == ["stop"]       # a named tool_choice's, as vLLM and OpenAI
    [call] = calls.values()
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["arguments"]), WEATHER_PARAMS)


def test_auto_and_a_multi_turn_history(tools_client):
    r = tools_client.chat.completions.create(model="", messages=ASK, tools=TOOLS,
                                             max_tokens=20, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather",
                         "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"}]
    r = tools_client.chat.completions.create(model="", messages=history, tools=TOOLS,
                                             max_tokens=20, temperature=0, tool_choice="none")
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.choices[0].message.content


def test_responses_function_call(tools_client):
    tools = [{"type": "function", "name": t["function"]["name"],
              "parameters": t["function"]["parameters"]} for t in TOOLS]
    r = tools_client.responses.create(model="", input="Weather in Paris?", tools=tools,
                                      tool_choice="required", max_output_tokens=80,
                                      temperature=0)
    calls = [item for item in r.output if item.type == "function_call"]
    assert r.status == "completed" and calls
    for call in calls:
        assert call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    follow = tools_client.responses.create(
        model="", max_output_tokens=10, temperature=0, tools=tools, tool_choice="none",
        input=[{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "21 degrees"}])
    assert follow.status in ("completed", "incomplete")


@pytest.mark.parametrize("tool_choice, words", [
    ("auto", ["--enable-auto-tool-choice", "--tool-call-parser"]),
    ("required", ["tool_choice", "--tool-call-parser"]),
    ({"type": "function", "function": {"name": "get_weather"}},
     ["tool_choice", "get_weather", "--tool-call-parser"]),
])
def test_tool_choice_without_a_parser_is_400(client, tool_choice, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="", messages=ASK, tools=TOOLS,
                                       tool_choice=tool_choice, max_tokens=4)
    message = info.value.body["message"] if isinstance(info.value.body, dict) else str(info.value)
    assert all(w in message for w in words), message
    assert "{" not in message and "'" not in message      # no Python reprs


def test_bad_tool_definition_is_400(tools_client):
    with pytest.raises(openai.BadRequestError) as info:
        tools_client.chat.completions.create(
            model="", messages=ASK, max_tokens=4, tool_choice="required",
            tools=[{"type": "function", "function": {"name": "f",
                                                     "parameters": {"type": "nope"}}}])
    assert info.value.param == "tools"
