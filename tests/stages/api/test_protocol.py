"""The protocol's field policy (stages/api/common.py `parse_request`), without a server:
a field this server does not know is ignored and logged once per API and name, as vLLM
ignores it (coding agents send fields no server knows yet), a field of vLLM's schema this
server does not act on is refused by name (unless it holds its harmless default), a field
that means nothing here is accepted, and every validation error names its JSON path. The error's JSON body is what the openai client reads as
`.param` and `.message`.

Through render: tests/stages/test_render.py (the model name, tools and tool_choice, types
and ranges); a server with a reasoning parser: tests/e2e/test_e2e_reasoning.py."""
from __future__ import annotations

import logging

import pytest

from stages.api.chat import ChatCompletionRequest
from stages.api.common import RequestError, parse_request
from stages.api.completions import CompletionRequest
from stages.api.responses import ResponsesRequest

HELLO = [{"role": "user", "content": "Say hello."}]
# each API's request class, with the least body it accepts
APIS = {"chat": (ChatCompletionRequest, {"messages": HELLO}),
        "completions": (CompletionRequest, {"prompt": "hi"}),
        "responses": (ResponsesRequest, {"input": "hi"})}


def parse(api: str, **fields):
    cls, body = APIS[api]
    return parse_request({**body, **fields}, cls, api)


def error_of(api: str, **fields) -> dict:
    """The OpenAI error body of the request's first problem (status 400)."""
    with pytest.raises(RequestError) as info:
        parse(api, **fields)
    assert info.value.status == 400 and info.value.type == "invalid_request_error"
    return info.value.to_dict()["error"]


@pytest.mark.parametrize("api", APIS)
def test_an_unknown_field_is_ignored_and_logged_once_naming_the_api(api, caplog):
    name = f"frobnicate_{api}"     # a name no other test logs (the log is once a process)
    with caplog.at_level(logging.WARNING, logger="tailrace.api"):
        first = parse(api, **{name: {"any": ["value"]}})
        again = parse(api, **{name: 2})
    assert first == again == parse(api)
    lines = [r for r in caplog.records if name in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert lines[0].getMessage().startswith(f"{api}: '{name}' ")


def test_an_unknown_field_is_logged_with_each_api_that_got_it(caplog):
    with caplog.at_level(logging.WARNING, logger="tailrace.api"):
        for api in APIS:
            parse(api, client_metadata_test={"k": "v"})
    apis = [r.getMessage().split(":")[0] for r in caplog.records
            if "client_metadata_test" in r.getMessage()]
    assert apis == list(APIS)


def test_a_known_field_keeps_its_checks_beside_an_unknown_one():
    error = error_of("chat", temperature="hot", frobnicate_too=1)
    assert error["param"] == "temperature"


@pytest.mark.parametrize("api, field, value", [
    ("chat", "logits_processors", ["m.f"]),
    ("chat", "documents", [{"title": "t"}]), ("completions", "vllm_xargs", {"k": 1}),
    ("responses", "conversation", "conv_1"),
])
def test_known_but_unimplemented_field_names_itself(api, field, value):
    error = error_of(api, **{field: value})
    assert error["param"] == field
    assert field in error["message"] and "not supported" in error["message"]


@pytest.mark.parametrize("api, fields", [
    ("chat", {"user": "u1", "metadata": {"k": "v"}, "service_tier": "auto", "store": False,
              "prompt_cache_key": "tenant-1", "safety_identifier": "s", "priority": 0,
              "spaces_between_special_tokens": True, "echo": False,
              "use_beam_search": False}),
    ("completions", {"user": "u1", "metadata": {}, "best_of": 1, "echo": False, "suffix": ""}),
    ("responses", {"user": "u", "service_tier": "auto", "store": True, "background": False,
                   "prompt_cache_key": "k", "safety_identifier": "s"}),
])
def test_fields_that_mean_nothing_here_are_accepted(api, fields):
    assert type(parse(api, **fields)) is APIS[api][0]


@pytest.mark.parametrize("fields, param", [
    ({"temperature": float("nan")}, "temperature"), ({"top_p": float("inf")}, "top_p"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": 7}]},
     "messages[1].content"),
    ({"messages": [{"role": "user", "content": "a"}, {"content": "b"}]}, "messages[1].role"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
])
def test_validation_errors_name_the_json_path(fields, param):
    error = error_of("chat", **fields)
    assert error["param"] == param
    assert error["message"].startswith(f"'{param}' ")


def test_null_is_absent_and_the_body_must_be_an_object():
    assert parse("chat", temperature=None, frobnicate=None).temperature is None
    with pytest.raises(RequestError, match="must be a JSON object"):
        parse_request([HELLO], ChatCompletionRequest)
