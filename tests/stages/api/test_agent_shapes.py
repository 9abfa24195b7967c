"""What coding agents send, mapped without a server: Claude Code's shapes on /v1/messages
(system-role messages inside `messages`, `cache_control` anywhere, thinking blocks echoed
back, tool results of text and image blocks, server tools, `thinking` and
`context_management` on a model without a reasoning parser) and Codex's on /v1/responses
(`client_metadata`, hosted tools, custom tools, the items of a follow-up turn).

The recorded requests themselves, through a server and the SDKs:
tests/e2e/test_e2e_agents.py."""
from __future__ import annotations

import json
import logging

import pytest

from stages.api import APIS
from stages.api.anthropic import error_dict
from stages.api.common import RequestError, ToolSettings, parse_request
from stages.api.tools import CUSTOM_PARAMETERS

ASK = [{"role": "user", "content": "hi"}]
TOOLS = ToolSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")
F = {"name": "f", "input_schema": {"type": "object"}}


@pytest.fixture(autouse=True)
def fresh_log(monkeypatch):
    """Each test sees its own lines (a field is logged once a process)."""
    from stages.api import common

    monkeypatch.setattr(common, "_logged", set())


def _plan(api: str, body: dict, reasoning: bool = False):
    spec = APIS[api]
    req = parse_request(body, spec.request, spec.path)
    return spec.plan(req, reasoning_parser=reasoning, tools=TOOLS)


def _messages(body: dict, reasoning: bool = False):
    return _plan("messages", {"max_tokens": 16, **body}, reasoning)


# -- Claude Code on /v1/messages ----------------------------------------------------------

def test_system_messages_join_the_system_prompt_in_order_not_in_place():
    plan = _messages({"system": [{"type": "text", "text": "top"}], "messages": [
        {"role": "user", "content": "q"},
        {"role": "system", "content": "mid one"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
        {"role": "system", "content": [{"type": "text", "text": "mid two",
                                        "cache_control": {"type": "ephemeral"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "ok"}]}]})
    roles = [m["role"] for m in plan.messages]
    assert roles == ["system", "user", "assistant", "tool"]     # the call and its result adjoin
    assert plan.messages[0]["content"] == "top\n\nmid one\n\nmid two"


def test_a_system_message_alone_is_the_system_prompt():
    plan = _messages({"messages": [{"role": "system", "content": "be brief"}, *ASK]})
    assert [(m["role"], m["content"]) for m in plan.messages] == [
        ("system", "be brief"), ("user", "hi")]


@pytest.mark.parametrize("role", ["tool", "developer", "critic"])
def test_an_unknown_role_is_a_400_naming_it(role):
    with pytest.raises(RequestError) as err:
        _messages({"messages": [*ASK, {"role": role, "content": "x"}]})
    assert err.value.status == 400 and err.value.param == "messages[1].role"
    assert repr(role) in err.value.message and "user, assistant, system" in err.value.message
    assert error_dict(err.value)["error"]["type"] == "invalid_request_error"


def test_a_tool_result_of_text_and_image_blocks_keeps_both_in_order():
    png = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
    plan = _messages({"messages": [
        *ASK, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "before", "cache_control": {"type": "ephemeral"}},
            {"type": "image", "source": png},
            {"type": "text", "text": "after"}]}]}]})
    tool = plan.messages[-1]
    assert tool["role"] == "tool" and tool["tool_call_id"] == "t1"
    kinds = [(p["type"], p.get("text")) for p in tool["content"]]
    assert kinds == [("text", "before"), ("image", None), ("text", "after")]
    assert tool["content"][1]["image_url"] == "data:image/png;base64,iVBORw0KGgo="


def test_a_tool_result_of_text_blocks_is_their_text():
    plan = _messages({"messages": [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}]})
    assert plan.messages[-1]["content"] == "a\nb"


def test_a_tool_result_of_another_block_is_a_400():
    with pytest.raises(RequestError) as err:
        _messages({"messages": [{"role": "user", "content": [{
            "type": "tool_result", "tool_use_id": "t1",
            "content": [{"type": "tool_use", "id": "x", "name": "f"}]}]}]})
    assert err.value.param == "messages[0].content[0].content[0].type"


def test_thinking_blocks_echoed_back_are_the_turns_reasoning():
    plan = _messages({"messages": [*ASK, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "let me see", "signature": "sig",
         "cache_control": {"type": "ephemeral"}},
        {"type": "redacted_thinking", "data": "opaque"},
        {"type": "text", "text": "hello"}]}, {"role": "user", "content": "again"}]})
    assert plan.messages[1]["reasoning"] == "let me see"
    assert plan.messages[1]["content"] == "hello"


def test_thinking_and_context_management_without_a_reasoning_parser_are_served(caplog):
    body = {"messages": ASK, "thinking": {"type": "adaptive"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
            "output_config": {"effort": "high"}}
    with caplog.at_level(logging.WARNING, logger="tailrace.api"):
        plan = _messages(body)
    assert "enable_thinking" not in plan.template_kwargs     # runs without reasoning
    assert plan.messages == [{"role": "user", "content": "hi"}]   # the prompt served whole
    with_parser = _messages(body, reasoning=True)
    assert with_parser.template_kwargs["enable_thinking"] is True


def test_server_tools_are_left_out_and_custom_tools_served():
    plan = _messages({"messages": ASK, "tools": [
        F, {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]})
    assert [t["function"]["name"] for t in plan.template_kwargs["tools"]] == ["f"]
    only_server = _messages({"messages": ASK, "tool_choice": {"type": "auto"}, "tools": [
        {"type": "web_search_20250305", "name": "web_search"}]})
    assert only_server.tools is None and "tools" not in only_server.template_kwargs


def test_cache_control_is_accepted_everywhere():
    cc = {"type": "ephemeral", "ttl": "1h"}
    plan = _messages({"cache_control": cc,
                      "system": [{"type": "text", "text": "s", "cache_control": cc}],
                      "tools": [{**F, "cache_control": cc}],
                      "messages": [{"role": "user", "content": [
                          {"type": "text", "text": "q", "cache_control": cc}]}]})
    assert plan.messages[0]["content"] == "s" and plan.messages[1]["content"] == "q"


# -- Codex on /v1/responses -------------------------------------------------------------------

CODEX_TOOLS = [
    {"type": "function", "name": "exec_command", "strict": False,
     "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}},
    {"type": "namespace", "name": "multi_agent_v1", "description": "sub-agents",
     "tools": [{"type": "function", "name": "close_agent", "parameters": {"type": "object"}}]},
    {"type": "custom", "name": "apply_patch", "description": "Edit files.",
     "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
    {"type": "web_search", "external_web_access": False},
    {"type": "file_search", "vector_store_ids": ["vs_1"]},
]


def _responses(body: dict, reasoning: bool = False):
    return _plan("responses", body, reasoning)


def test_codexs_first_turn_fields_are_served(caplog):
    with caplog.at_level(logging.WARNING, logger="tailrace.api"):
        plan = _responses({
            "input": "hi", "tools": CODEX_TOOLS, "tool_choice": "auto",
            "parallel_tool_calls": True, "reasoning": {"effort": "medium", "summary": "auto"},
            "store": False, "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "k", "client_metadata": {"x-codex-turn-metadata": "{}"}})
    tools = plan.template_kwargs["tools"]
    assert [t["function"]["name"] for t in tools] == ["exec_command", "apply_patch"]
    assert tools[1]["function"]["parameters"] == CUSTOM_PARAMETERS
    assert plan.tools.kind == "auto" and plan.tools.parallel
    assert "reasoning_effort" not in plan.template_kwargs    # no reasoning parser
    logged = " ".join(r.getMessage() for r in caplog.records)
    for what in ("namespace", "web_search", "file_search"):
        assert f"tools[].type {what}" in logged


def test_only_hosted_tools_leave_no_tools():
    plan = _responses({"input": "hi", "tool_choice": "auto",
                       "tools": [{"type": "web_search"}]})
    assert plan.tools is None and "tools" not in plan.template_kwargs


def test_a_custom_tool_choice_names_its_function():
    plan = _responses({"input": "hi", "tools": CODEX_TOOLS,
                       "tool_choice": {"type": "custom", "name": "apply_patch"}})
    assert plan.tools.kind == "named" and plan.tools.name == "apply_patch"


def test_codexs_follow_up_items_become_the_history():
    plan = _responses({"input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": None,
         "encrypted_content": "gAAAA"},
        {"type": "function_call", "call_id": "c1", "name": "exec_command",
         "arguments": "{\"cmd\": \"ls\"}", "id": "fc_1"},
        {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch",
         "input": "*** Begin Patch", "status": "completed"},
        {"type": "web_search_call", "id": "ws_1", "status": "completed",
         "action": {"type": "search", "query": "x"}},
        {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "Done!"},
    ], "tools": CODEX_TOOLS})
    roles = [m["role"] for m in plan.messages]
    assert roles == ["user", "assistant", "tool", "tool"]
    calls = plan.messages[1]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["exec_command", "apply_patch"]
    assert calls[0]["function"]["arguments"] == {"cmd": "ls"}
    assert calls[1]["function"]["arguments"] == {"input": "*** Begin Patch"}
    assert plan.messages[3] == {"role": "tool", "tool_call_id": "c2", "content": "Done!"}


def test_a_custom_tool_call_without_input_is_a_400():
    with pytest.raises(RequestError) as err:
        _responses({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "p"}]})
    assert err.value.param == "input[0].input"


def test_reasoning_effort_with_a_reasoning_parser_reaches_the_template():
    plan = _responses({"input": "hi", "reasoning": {"effort": "low"}}, reasoning=True)
    assert plan.template_kwargs["reasoning_effort"] == "low"


def test_codex_arguments_stay_json():
    # (the follow-up's arguments are a JSON string; a custom call's input is any text)
    plan = _responses({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "p",
                                  "input": "\"quoted\" {not json"}]})
    assert json.loads(json.dumps(plan.messages[0]["tool_calls"][0]["function"]["arguments"]))
