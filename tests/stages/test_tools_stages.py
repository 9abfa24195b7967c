"""Tool calls through parse and emit: the parse plan, finish_reason tool_calls, OpenAI's
chat deltas and message.tool_calls, Responses function_call items and events."""
from __future__ import annotations

import attrs
import orjson
import pytest

from stages.api.common import ToolPlan
from stages.delta import Delta, FinishReason, Usage
from stages.emit import framer_for
from stages.parse import Parser
from stages.messages import Step
from tests.support.rendered import rendered

TOOLS = [{"type": "function", "function": {"name": "get_weather"}}]
TEXT = ['Sure.', ' <tool_', 'call>{"name": "get_weather", "arguments": {"city": ',
        '"Paris"}}</tool_call>']


def run_parse(plan: ToolPlan, pieces: list[str], finish=FinishReason.STOP, api="chat",
              stream=False, body=None):
    req = attrs.evolve(rendered("r1", api=api, stream=stream,
                                body={"tools": TOOLS, **(body or {})}), tools=plan)
    parser = Parser()
    steps = []
    for i, text in enumerate(pieces):
        last = i == len(pieces) - 1
        d = Delta("r1", (5,), finish if last else None, text=text,
                  usage=Usage(3, i + 1) if last else None)
        steps.append(parser.process(Step(i, (req,) if i == 0 else (), (d,))))
    return req, [s.deltas[0] for s in steps]


def framed(req, deltas) -> bytes:
    f = framer_for(req)
    return f.start() + b"".join(f.on_delta(d) for d in deltas)


def test_parse_makes_calls_and_finish_reason_tool_calls():
    _, deltas = run_parse(ToolPlan("auto", parser="hermes"), TEXT)
    assert "".join(d.content for d in deltas) == "Sure. "
    calls = [c for d in deltas for c in d.tool_calls]
    assert [(c.index, c.name, c.arguments) for c in calls] == [(0, "get_weather",
                                                                '{"city": "Paris"}')]
    assert calls[0].id.startswith("call_")
    assert deltas[-1].finish_reason is FinishReason.TOOL_CALLS


def test_length_stays_length_and_no_parser_without_a_plan():
    _, deltas = run_parse(ToolPlan("auto", parser="hermes"), TEXT, FinishReason.LENGTH)
    assert deltas[-1].finish_reason is FinishReason.LENGTH
    parser = Parser()
    req = rendered("r2", api="chat")
    out = parser.process(Step(0, (req,), (Delta("r2", (5,), FinishReason.STOP,
                                                text="<tool_call>{}</tool_call>"),)))
    assert out.deltas[0].content == "<tool_call>{}</tool_call>" and not out.deltas[0].tool_calls


def test_parallel_false_keeps_the_first_call():
    two = ['[{"name": "a", "parameters": {}}, {"name": "b", "parameters": {}}]']
    _, deltas = run_parse(ToolPlan("required", parallel=False), two)
    assert [c.name for c in deltas[-1].tool_calls] == ["a"]
    _, deltas = run_parse(ToolPlan("required"), two)
    assert [c.name for c in deltas[-1].tool_calls] == ["a", "b"]


def test_chat_body_has_tool_calls_and_null_content():
    req, deltas = run_parse(ToolPlan("named", name="get_weather"), ['{"city":', ' "Paris"}'])
    body = orjson.loads(framed(req, deltas))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"     # a named tool_choice's, as vLLM and OpenAI
    assert choice["message"]["content"] is None   # OpenAI's null (vLLM: ""; docs/api.md)
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_chat_stream_tool_call_deltas():
    req, deltas = run_parse(ToolPlan("auto", parser="hermes"), TEXT, stream=True)
    chunks = [orjson.loads(line[6:]) for line in framed(req, deltas).split(b"\n\n")
              if line.startswith(b"data: {")]
    calls = [c["choices"][0]["delta"]["tool_calls"] for c in chunks
             if c["choices"] and "tool_calls" in c["choices"][0]["delta"]]
    first, rest = calls[0][0], calls[1:]
    assert first["index"] == 0 and first["type"] == "function"
    assert first["id"].startswith("call_") and first["function"]["name"] == "get_weather"
    args = first["function"]["arguments"] + "".join(c[0]["function"]["arguments"] for c in rest)
    assert orjson.loads(args) == {"city": "Paris"}
    assert all("id" not in c[0] for c in rest)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_responses_function_call_items(stream):
    req, deltas = run_parse(ToolPlan("auto", parser="hermes"), TEXT, api="responses",
                            stream=stream, body={"tools": [{"type": "function",
                                                            "name": "get_weather"}]})
    out = framed(req, deltas)
    if not stream:
        response = orjson.loads(out)
    else:
        events = [orjson.loads(block.split(b"data: ", 1)[1]) for block in out.split(b"\n\n")
                  if block]
        types = [e["type"] for e in events]
        i = types.index("response.function_call_arguments.delta")
        assert types[i - 1] == "response.output_item.added"
        assert events[i - 1]["item"]["type"] == "function_call"
        assert types[i + 1:i + 3] == ["response.function_call_arguments.done",
                                      "response.output_item.done"]
        response = events[-1]["response"]
        assert types[-1] == "response.completed"
    assert response["status"] == "completed"
    message, call = response["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == "Sure. "
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert call["call_id"].startswith("call_") and call["status"] == "completed"
    assert orjson.loads(call["arguments"]) == {"city": "Paris"}


PATCH = ['<tool_call>{"name": "apply_patch", "arguments": {"input": "*** Begin Patch\\n',
         '+ \\"hi\\"\\n*** End Patch"}}</tool_call>']


@pytest.mark.parametrize("stream", [False, True])
def test_responses_custom_tool_call_items_carry_the_free_text_input(stream):
    tools = [{"type": "custom", "name": "apply_patch", "format": {"type": "text"}},
             {"type": "function", "name": "get_weather"}]
    req, deltas = run_parse(ToolPlan("auto", parser="hermes"), PATCH, api="responses",
                            stream=stream, body={"tools": tools})
    out = framed(req, deltas)
    patch = '*** Begin Patch\n+ "hi"\n*** End Patch'
    if stream:
        events = [orjson.loads(block.split(b"data: ", 1)[1]) for block in out.split(b"\n\n")
                  if block]
        types = [e["type"] for e in events]
        i = types.index("response.custom_tool_call_input.delta")
        assert events[i - 1]["item"] == {"call_id": events[i - 1]["item"]["call_id"],
                                         "input": "", "name": "apply_patch",
                                         "type": "custom_tool_call",
                                         "id": events[i]["item_id"], "status": "in_progress"}
        assert events[i]["delta"] == patch
        assert types[i + 1:i + 3] == ["response.custom_tool_call_input.done",
                                      "response.output_item.done"]
        assert events[i + 1]["input"] == patch
        assert "response.function_call_arguments.delta" not in types
        response = events[-1]["response"]
    else:
        response = orjson.loads(out)
    [call] = response["output"]
    assert call["type"] == "custom_tool_call" and call["name"] == "apply_patch"
    assert call["input"] == patch and call["id"].startswith("ctc_")
    assert call["call_id"].startswith("call_") and call["status"] == "completed"
