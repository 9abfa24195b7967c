"""Issue 22's differences from vLLM found by its own OpenAI-server tests, checked without a
server (the HTTP side: tests/e2e/test_e2e_vllm_parity.py)."""
from __future__ import annotations

import json

import jsonschema

from stages.api.common import ToolSettings
from stages.api.tools import responses_tools, tool_request

HERMES = ToolSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")

# what pydantic emits for a nested model: the parameters refer to their own $defs
OPTIONS = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]},
                                            "days": {"type": "integer"}},
           "required": ["unit"], "additionalProperties": False}
NESTED = {"type": "object", "properties": {"city": {"type": "string"},
                                           "options": {"$ref": "#/$defs/Options"}},
          "required": ["city", "options"], "$defs": {"Options": OPTIONS}}
# a recursive one: "#" is the parameters' own root
TREE = {"type": "object", "properties": {"name": {"type": "string"},
                                         "children": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["name"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": NESTED}},
         {"type": "function", "function": {"name": "tree", "parameters": TREE}},
         # a second tool with a $defs entry of the same name, meaning something else
         {"type": "function", "function": {"name": "other", "parameters": {
             "type": "object", "properties": {"o": {"$ref": "#/$defs/Options"}},
             "$defs": {"Options": {"type": "string"}}}}}]


def test_required_tool_schemas_keep_their_refs_resolvable():
    tr = tool_request(TOOLS, "required", None, HERMES)   # checked by xgrammar: no 400
    schema = json.loads(tr.constraint.spec)
    good = [{"name": "weather", "parameters": {"city": "Paris", "options": {"unit": "c"}}},
            {"name": "tree", "parameters": {"name": "a", "children": [{"name": "b"}]}},
            {"name": "other", "parameters": {"o": "x"}}]
    jsonschema.validate(good, schema)
    for bad in ([{"name": "weather", "parameters": {"city": "P", "options": {"unit": "k"}}}],
                [{"name": "tree", "parameters": {"name": "a", "children": [{"x": 1}]}}],
                [{"name": "other", "parameters": {"o": {"unit": "c"}}}]):
        try:
            jsonschema.validate(bad, schema)
        except jsonschema.ValidationError:
            continue
        raise AssertionError(f"{bad} should not match")


def test_required_tool_refs_in_responses_form():
    tools = responses_tools([{"type": "function", "name": "weather", "parameters": NESTED}])
    tr = tool_request(tools, "required", None, HERMES)
    jsonschema.validate([{"name": "weather", "parameters": {"city": "P",
                                                            "options": {"unit": "f"}}}],
                        json.loads(tr.constraint.spec))


# -- 2. Responses takes reasoning items back (a client replaying response.output) ---------

def _responses_messages(items):
    from stages.api.common import parse_request
    from stages.api.responses import ResponsesRequest, plan
    return plan(parse_request({"input": items}, ResponsesRequest),
                reasoning_parser=True).messages


def test_reasoning_items_go_with_the_assistant_turn_they_led_to():
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [], "status": "completed",
                 "content": [{"type": "reasoning_text", "text": "2 + 2 is 4."}]}
    answer = {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
              "content": [{"type": "output_text", "text": "4", "annotations": [],
                           "logprobs": []}]}
    messages = _responses_messages([{"role": "user", "content": "2 + 2?"}, reasoning, answer,
                                    {"role": "user", "content": "And 3 + 3?"}])
    assert messages == [
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4", "reasoning": "2 + 2 is 4.",
         "reasoning_content": "2 + 2 is 4."},
        {"role": "user", "content": "And 3 + 3?"}]
    # before calls: on the calls' assistant message; a summary when there is no content
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
    summary = {"type": "reasoning", "id": "rs_2",
               "summary": [{"type": "summary_text", "text": "Call f."}]}
    messages = _responses_messages([{"role": "user", "content": "go"}, summary, call])
    assert messages[1]["reasoning"] == "Call f." and messages[1]["tool_calls"]
    # reasoning that led to no assistant turn is dropped
    messages = _responses_messages([{"role": "user", "content": "a"}, reasoning,
                                    {"role": "user", "content": "b"}])
    assert [m["role"] for m in messages] == ["user", "user"]
    assert not any("reasoning" in m for m in messages)


# -- 12. seeds out of int64's range get the range message, both ways ----------------------

def test_seed_range_both_ends():
    import orjson
    from stages.api.chat import ChatCompletionRequest
    from stages.api.common import RequestError, parse_request
    for raw in (b"9223372036854775808", b"-9223372036854775809", b"1e30"):
        body = orjson.loads(b'{"messages": [{"role": "user", "content": "x"}], "seed": '
                            + raw + b"}")
        try:
            parse_request(body, ChatCompletionRequest)
        except RequestError as err:
            assert err.param == "seed" and "64-bit" in err.message, (raw, err.message)
        else:
            raise AssertionError(raw)
    for value, what in ((1.5, "got a number"), (5.0, "got a number"), (True, "boolean"),
                        ("3", "string")):
        try:
            parse_request({"messages": [{"role": "user", "content": "x"}], "seed": value},
                          ChatCompletionRequest)
        except RequestError as err:
            assert err.param == "seed" and "must be an integer" in err.message
            assert what in err.message
        else:
            raise AssertionError(value)
    for ok in (-2 ** 63, 2 ** 63 - 1, 0):
        req = parse_request({"messages": [{"role": "user", "content": "x"}], "seed": ok},
                            ChatCompletionRequest)
        assert req.seed == ok


# -- 10. a custom role goes to the template ----------------------------------------------

def test_custom_role_reaches_the_template():
    from stages.api.chat import template_messages
    from stages.api.common import converter
    from stages.api.request_types import ChatMessage
    msgs = [converter.structure({"role": "my-custom-role", "content": "x"}, ChatMessage)]
    assert template_messages(msgs, "messages") == [{"role": "my-custom-role", "content": "x"}]


# -- 13. vLLM's extensions not served: a 400 that names them -----------------------------

def test_unserved_vllm_extensions_are_named():
    from stages.api.chat import ChatCompletionRequest
    from stages.api.common import RequestError, parse_request
    hi = {"messages": [{"role": "user", "content": "x"}]}
    for field, value in (("logits_processors", ["x"]), ("vllm_xargs", {"a": 1})):
        try:
            parse_request({**hi, field: value}, ChatCompletionRequest)
        except RequestError as err:
            assert err.param == field and "not supported" in err.message
        else:
            raise AssertionError(field)
    # beam search is served (issue 37): tests/stages/test_beam_schedule.py
    assert parse_request({**hi, "use_beam_search": True}, ChatCompletionRequest).use_beam_search
    # logprob_token_ids, prompt_logprobs -1 and enable_response_messages are served (issue
    # 37): tests/stages/test_render.py
