"""The requests Claude Code 2.1.197 and Codex CLI 0.171 really send
(tests/fixtures/agents/*.json, recorded from `tailrace serve`'s event log and, for the turns
after a tool call, from a scripted stand-in server), rendered through the whole render
stage with the bundled model's tokenizer and chat template: no field, tool or item of
theirs is refused, and the prompt holds what they meant.

Through a server, with the SDKs and the CLIs themselves: tests/e2e/test_e2e_agents.py."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from stages.api import APIS
from stages.api.common import ToolSettings, parse_request
from stages.render import RenderContext, Submission, render

FIXTURES = Path(__file__).parents[2] / "fixtures" / "agents"
TOOLS = ToolSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")
CLAUDE = ("claude_code_first_turn", "claude_code_follow_up", "claude_code_tool_results")
CODEX = ("codex_first_turn", "codex_tool_outputs")


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())["body"]


@pytest.fixture(scope="module")
def ctx():
    from gpu.tokenizers.files import load_tokenizer

    return RenderContext(tokenizer=load_tokenizer(None), served_model_names=(
        "SmolLM2-135M-Instruct",), max_model_len=32768, vocab_size=49152, tools=TOOLS)


def _plan(api: str, body: dict):
    spec = APIS[api]
    return spec.plan(parse_request(body, spec.request, spec.path), reasoning_parser=False,
                     tools=TOOLS)


@pytest.mark.parametrize("name", CLAUDE)
def test_claude_codes_requests_render_whole(ctx, name):
    body = fixture(name)
    out = render(Submission("r", "messages", body, 0.0), ctx)
    assert out.sampling.max_tokens == body["max_tokens"] and out.stream
    plan = _plan("messages", body)
    roles = [m["role"] for m in plan.messages]
    assert roles.count("system") == 1 and roles[0] == "system"   # every system text, merged
    system = plan.messages[0]["content"]
    assert "Available agent types for the Agent tool" in system   # the mid-history one
    assert system.index("interactive agent") < system.index("Available agent types")
    assert len(plan.template_kwargs["tools"]) == len(body["tools"]) >= 20
    assert plan.tools.kind == "auto" and plan.tools.parser == "hermes"


def test_claude_codes_tool_results_follow_their_parallel_calls(ctx):
    plan = _plan("messages", fixture("claude_code_tool_results"))
    roles = [m["role"] for m in plan.messages]
    assert roles[-3:] == ["assistant", "tool", "tool"]
    calls = plan.messages[-3]["tool_calls"]
    assert [c["id"] for c in calls] == ["toolu_01", "toolu_02"]
    assert plan.messages[-3]["reasoning"] == "I will run it."     # its thinking block
    results = {m["tool_call_id"]: m["content"] for m in plan.messages[-2:]}
    assert results == {"toolu_01": "hi", "toolu_02": "there"}


@pytest.mark.parametrize("name", CODEX)
def test_codexs_requests_render_whole(ctx, name, caplog):
    body = fixture(name)
    with caplog.at_level(logging.WARNING, logger="tailrace.api"):
        out = render(Submission("r", "responses", body, 0.0), ctx)
    assert out.stream and len(out.prompt_token_ids) > 1000
    plan = _plan("responses", body)
    served = [t["function"]["name"] for t in plan.template_kwargs["tools"]]
    functions = [t["name"] for t in body["tools"] if t["type"] == "function"]
    assert served == functions and len(served) < len(body["tools"])   # hosted ones left out
    assert plan.tools.kind == "auto" and plan.tools.parallel
    assert plan.messages[0]["role"] == "system"                # developer -> system


def test_codexs_tool_outputs_follow_their_reasoning_and_calls():
    plan = _plan("responses", fixture("codex_tool_outputs"))
    assert [m["role"] for m in plan.messages][-3:] == ["assistant", "tool", "tool"]
    turn = plan.messages[-3]
    assert turn["reasoning"] == "I will run echo."
    assert [c["function"]["arguments"] for c in turn["tool_calls"]] == [
        {"cmd": "echo hi"}, {"cmd": "echo there"}]
    assert plan.messages[-2]["tool_call_id"] == "call_1"
    assert plan.messages[-2]["content"].endswith("Output:\nhi\n")
