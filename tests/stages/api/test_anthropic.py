"""Anthropic's Messages API without a server: the request's mapping to a prompt plan, its
errors, and the framer, whose stream, joined by the official SDK's own accumulator, is the
non-streamed message for any sequence of deltas (hypothesis); render takes any JSON body
for it and answers a request or a RequestError, never anything else."""
from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stages.api import APIS
from stages.api.anthropic import MessagesFramer, error_dict
from stages.api.common import RequestError, ToolSettings, parse_request
from stages.delta import Delta, FinishReason, ToolCallDelta, Usage
from stages.render import RenderContext, Submission, render

ASK = [{"role": "user", "content": "hi"}]
TOOLS = ToolSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")


@pytest.fixture(scope="module")
def tokenizer():
    from gpu.tokenizers.files import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="module")
def ctx(tokenizer):
    return RenderContext(tokenizer=tokenizer, served_model_names=("m",), max_model_len=512,
                         vocab_size=49152, tools=TOOLS, reasoning=True)


def _render(ctx, body, rid="r1"):
    return render(Submission(rid, "messages", {"max_tokens": 16, **body}, 0.0), ctx)


def _plan(body, reasoning=False):
    spec = APIS["messages"]
    req = parse_request({"max_tokens": 16, **body}, spec.request)
    return spec.plan(req, reasoning_parser=reasoning, tools=TOOLS)


def test_blocks_become_chat_messages():
    plan = _plan({"system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                  "messages": [
                      {"role": "user", "content": [{"type": "text", "text": "q",
                                                    "cache_control": {"type": "ephemeral"}}]},
                      {"role": "assistant", "content": [
                          {"type": "thinking", "thinking": "hmm", "signature": "s"},
                          {"type": "text", "text": "let me look"},
                          {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": 1}}]},
                      {"role": "user", "content": [
                          {"type": "tool_result", "tool_use_id": "toolu_1",
                           "content": [{"type": "text", "text": "42"}]},
                          {"type": "text", "text": "thanks"}]}]})
    m = plan.messages
    assert [x["role"] for x in m] == ["system", "user", "assistant", "tool", "user"]
    assert m[0]["content"] == "a\nb" and m[1]["content"] == "q"
    assert m[2]["content"] == "let me look" and m[2]["reasoning"] == "hmm"
    assert m[2]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert m[3] == {"role": "tool", "content": "42", "tool_call_id": "toolu_1"}
    assert plan.add_generation_prompt and not plan.continue_final_message


def test_a_final_assistant_message_is_a_prefill():
    plan = _plan({"messages": ASK + [{"role": "assistant", "content": "The answer"}]})
    assert plan.continue_final_message and not plan.add_generation_prompt


@pytest.mark.parametrize("choice, kind, name, parallel", [
    ({"type": "auto"}, "auto", None, True),
    ({"type": "auto", "disable_parallel_tool_use": True}, "auto", None, False),
    ({"type": "any"}, "required", None, True),
    ({"type": "tool", "name": "f"}, "named", "f", True),
])
def test_tool_choice_maps_to_chats(choice, kind, name, parallel):
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    plan = _plan({"messages": ASK, "tools": tools, "tool_choice": choice})
    assert plan.tools.kind == kind and plan.tools.name == name
    assert plan.tools.parallel is parallel
    assert plan.template_kwargs["tools"][0]["function"]["name"] == "f"
    assert (plan.constraint is None) == (kind == "auto")


def test_none_tool_choice_and_thinking_and_output_format():
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    assert _plan({"messages": ASK, "tools": tools, "tool_choice": {"type": "none"}}).tools is None
    plan = _plan({"messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 2000}},
                 reasoning=True)
    assert plan.template_kwargs["enable_thinking"] is True
    assert _plan({"messages": ASK, "thinking": {"type": "disabled"}}).template_kwargs == {
        "enable_thinking": False}
    schema = {"type": "object"}
    plan = _plan({"messages": ASK, "output_format": {"type": "json_schema", "schema": schema}})
    assert plan.constraint.kind == "json_schema" and plan.constraint.param == "output_format"
    assert json.loads(plan.constraint.spec) == schema


@pytest.mark.parametrize("body, param", [
    ({"messages": ASK, "max_tokens": None}, "max_tokens"),
    ({"messages": ASK, "max_tokens": 0}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b"}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "document"}]}]},
     "messages[0].content[0].type"),
    ({"messages": ASK, "temperature": 1.2}, "temperature"),
    ({"messages": ASK, "stop_sequences": [""]}, "stop_sequences"),
    ({"messages": ASK, "thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"messages": ASK, "thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"messages": ASK, "tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"messages": ASK, "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"messages": ASK, "output_format": {"type": "json_object"}}, "output_format.type"),
])
def test_bad_requests_name_their_field(body, param):
    with pytest.raises(RequestError) as err:
        _plan(body)
    assert err.value.status == 400 and err.value.param == param, err.value.message
    assert error_dict(err.value) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": err.value.message}}


def test_error_types_follow_the_status():
    kinds = {s: error_dict(RequestError("x", status=s))["error"]["type"]
             for s in (400, 401, 403, 404, 413, 429, 500, 503)}
    assert kinds == {400: "invalid_request_error", 401: "authentication_error",
                     403: "permission_error", 404: "not_found_error",
                     413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                     503: "overloaded_error"}


def test_render_takes_the_stop_sequences_and_default_temperature(ctx):
    req = _render(ctx, {"messages": ASK, "stop_sequences": ["x", "y"]})
    assert req.sampling.stop == ("x", "y") and req.sampling.max_tokens == 16
    assert req.sampling.options.temperature == 1.0 and req.include_usage


def test_an_absent_temperature_is_the_generation_configs_as_vllm(ctx):
    import attrs

    configured = attrs.evolve(ctx, default_sampling={"temperature": 0.25})
    assert _render(configured, {"messages": ASK}).sampling.options.temperature == 0.25
    assert _render(configured, {"messages": ASK, "temperature": 1}
                   ).sampling.options.temperature == 1.0


# -- the framer: the stream, joined by the SDK, is the message --------------------------------

texts = st.text(alphabet="ab <>{}\"é\n", max_size=4)
steps = st.lists(st.tuples(texts, texts, st.booleans()), min_size=0, max_size=6)
endings = st.sampled_from([(FinishReason.STOP, None), (FinishReason.STOP, 2),
                           (FinishReason.STOP, "zz"), (FinishReason.LENGTH, None),
                           (FinishReason.TOOL_CALLS, None)])


def _deltas(parts, ending, prompt: int) -> list[Delta]:
    out, calls = [], 0
    for reasoning, content, call in parts:
        tool_calls = ()
        if call:
            tool_calls = (ToolCallDelta(calls, f"call_{calls}", "f", json.dumps({"n": calls})),)
            calls += 1
        out.append(Delta("r1", token_ids=(1,), reasoning=reasoning, content=content,
                         tool_calls=tool_calls))
    reason, stop = ending
    out.append(Delta("r1", finish_reason=reason, stop_reason=stop,
                     usage=Usage(prompt, len(out), cached_tokens=min(3, prompt))))
    return out


def _sdk_join(data: bytes):
    from anthropic.lib.streaming._messages import accumulate_event

    snapshot, bufs, names = None, {}, []
    for block in data.decode().split("\n\n"):
        if not block:
            continue
        name, payload = block.split("\n")
        event = json.loads(payload.removeprefix("data: "))
        assert name == "event: " + event["type"]
        names.append(event["type"])
        if event["type"] != "ping":
            snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=bufs)
    return snapshot, names


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=steps, ending=endings)
def test_the_stream_joined_by_the_sdk_is_the_message(ctx, parts, ending):
    stream = _render(ctx, {"messages": ASK, "stream": True, "stop_sequences": ["zz"]})
    whole = _render(ctx, {"messages": ASK, "stop_sequences": ["zz"]})
    framers = MessagesFramer(stream), MessagesFramer(whole)
    data = [f.start() + b"".join(f.on_delta(d) for d in
                                 _deltas(parts, ending, len(stream.prompt_token_ids)))
            for f in framers]
    assert all(f.finished for f in framers)
    body = orjson.loads(data[1])
    joined, names = _sdk_join(data[0])
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta",
                                                                      "message_stop"]
    got = joined.model_dump(exclude_none=True)
    for block in got["content"]:
        block.pop("citations", None)
    assert {**got, "id": body["id"]} == {k: v for k, v in body.items() if v is not None} | {
        "usage": {k: v for k, v in body["usage"].items()}}
    # every block opened is closed, in order
    opened = [i for i, n in enumerate(names) if n == "content_block_start"]
    closed = [i for i, n in enumerate(names) if n == "content_block_stop"]
    assert len(opened) == len(closed) == len(body["content"])
    assert all(a < b for a, b in zip(opened, closed))
    assert all(b < a for a, b in zip(opened[1:], closed))


def test_stop_reasons(ctx):
    def stop(ending, calls=False):
        req = _render(ctx, {"messages": ASK, "stop_sequences": ["zz"]})
        f = MessagesFramer(req)
        body = b"".join(f.on_delta(d) for d in _deltas([("", "x", calls)], ending, 9))
        data = orjson.loads(body)
        return data["stop_reason"], data["stop_sequence"]
    assert stop((FinishReason.STOP, 2)) == ("end_turn", None)
    assert stop((FinishReason.STOP, "zz")) == ("stop_sequence", "zz")
    assert stop((FinishReason.LENGTH, None)) == ("max_tokens", None)
    assert stop((FinishReason.TOOL_CALLS, None), calls=True) == ("tool_use", None)


def test_an_engine_error_is_anthropics_error(ctx):
    for stream in (True, False):
        f = MessagesFramer(_render(ctx, {"messages": ASK, "stream": stream}))
        out = f.on_delta(Delta("r1", finish_reason=FinishReason.ERROR, error="boom"))
        if stream:
            assert out == (b'event: error\ndata: {"type":"error","error":{"type":"api_error",'
                           b'"message":"boom"}}\n\n')
        else:
            assert f.status == 500 and orjson.loads(out) == {
                "type": "error", "error": {"type": "api_error", "message": "boom"}}


# -- fuzzed bodies ------------------------------------------------------------------------------

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12)
FIELDS = ["model", "messages", "system", "max_tokens", "stop_sequences", "temperature",
          "top_p", "top_k", "tools", "tool_choice", "thinking", "output_format",
          "output_config", "metadata", "stream", "seed"]
block = st.fixed_dictionaries({"type": st.sampled_from(
    ["text", "tool_use", "tool_result", "thinking", "image", "redacted_thinking", "x"])},
    optional={k: json_values for k in ("text", "id", "name", "input", "tool_use_id",
                                       "content", "thinking")})
message = st.fixed_dictionaries({
    "role": st.sampled_from(["user", "assistant", "system", 3]),
    "content": st.one_of(st.text(max_size=20), st.lists(block, max_size=3), json_values)})
BODIES = st.one_of(
    json_values,
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6),
    st.fixed_dictionaries({"messages": st.lists(message, max_size=3)},
                          optional={k: json_values for k in FIELDS if k != "messages"}),
    st.fixed_dictionaries({"messages": st.lists(message, min_size=1, max_size=3),
                           "max_tokens": st.integers(1, 8)},
                          optional={"tools": st.lists(st.fixed_dictionaries(
                              {"name": st.text(max_size=4)},
                              optional={"input_schema": json_values, "type": json_values}),
                              max_size=2), "tool_choice": json_values,
                              "system": st.one_of(st.text(max_size=8), st.lists(block))}),
)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=BODIES)
def test_render_never_raises_anything_but_request_error(ctx, body):
    try:
        out = render(Submission("r", "messages", body, 0.0), ctx)
    except RequestError as err:
        assert 400 <= err.status < 500 and err.message
        assert error_dict(err)["error"]["type"] in ("invalid_request_error", "not_found_error")
        return
    assert 0 < len(out.prompt_token_ids) < 512 and out.sampling.max_tokens >= 1
