"""Bad input over real HTTP: whatever body or header a client sends to any POST endpoint,
the answer is a 2xx or a 4xx OpenAI error -- never a 500, a hang or a traceback -- and the
server keeps serving.

The server is real (SmolLM2, the whole pipeline, Hypercorn on 127.0.0.1) except that every
sampled token is replaced by EOS, so a body that happens to be valid costs one engine
step, not a generation. The POST endpoints are read from the app's routes, so an endpoint
added later is fuzzed too.
"""
from __future__ import annotations

import socket
from urllib.parse import urlsplit

import attrs
import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.live_servers import threaded_server
from web.app import create_app

# A valid body for each endpoint (others start from {}); each example breaks one thing.
BASES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
    "/v1/completions": {"prompt": "Hi", "max_tokens": 3},
    "/v1/responses": {"input": "Hi", "max_output_tokens": 3},
    "/v1/messages": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
    "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "Hi"}]},
    "/tokenize": {"prompt": "Hi"},
    "/detokenize": {"tokens": [1, 2, 3]},
}
FIELDS = ["model", "messages", "prompt", "input", "instructions", "max_tokens",
          "max_completion_tokens", "max_output_tokens", "temperature", "top_p", "top_k", "min_p",
          "seed", "stop", "stop_token_ids", "n", "stream", "stream_options", "ignore_eos",
          "min_tokens", "frequency_penalty", "presence_penalty", "repetition_penalty", "logprobs",
          "top_logprobs", "tools", "tool_choice", "echo", "response_format", "metadata", "user",
          "tokens", "add_special_tokens", "include_stop_str_in_output", "logit_bias", "text",
          "reasoning", "chat_template_kwargs", "skip_special_tokens", "best_of", "suffix",
          "allowed_token_ids", "bad_words", "prompt_logprobs", "logprob_token_ids",
          "enable_response_messages",
          # Anthropic's Messages API; stateful Responses
          "system", "stop_sequences", "thinking", "output_format", "output_config",
          "previous_response_id", "store", "background"]

EXAMPLES = 40           # per property: the whole file stays within ~20 s on 2 cores
TIMEOUT_S = 30.0        # a hang is a failure, not a stuck suite


def nested(depth: int, leaf=0):
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"a": value}
    return value


json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=False,
                                                                         allow_infinity=False),
    st.text(max_size=12), st.sampled_from([-1, 0, 2**31, 2**53 + 1, -2**63, 1e308, -1e-308, ""]))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=10)
evil_values = st.one_of(
    json_values,
    st.integers(1, 250).map(nested),                      # deep (orjson itself stops at 1024)
    st.integers(1, 20_000).map(lambda n: [0] * n),        # long arrays
    st.integers(1, 20_000).map(lambda n: "x" * n),        # long strings
    st.text(alphabet=st.characters(codec="utf-8"), max_size=40),   # any code point
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant",
                                                               "tool", "developer", "x"]),
                                    "content": json_values}), max_size=3),
)


@pytest.fixture(scope="module")
def server(smollm):
    def eos_after_one_step(engine) -> None:
        real, eos = engine.runner.execute, engine.loaded.eos_token_ids[0]

        def execute(plan, staged=None):
            result = real(plan, staged)
            return attrs.evolve(result, token_ids=(eos,) * len(result.token_ids))

        engine.runner.execute = execute

    with threaded_server(smollm, max_model_len=64, patch=eos_after_one_step) as srv:
        yield srv


@pytest.fixture(scope="module")
def post_paths(server) -> list[str]:
    app = server.call(create_app, server.engine)
    return sorted(rule.rule for rule in app.url_map.iter_rules() if "POST" in rule.methods)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as client:
        yield client


def check(response: httpx.Response) -> None:
    """A 2xx, or a 4xx whose body is an OpenAI error (or Anthropic's, whose "error" has a
    type and a message too); never a 5xx or a traceback."""
    assert response.status_code < 500, (response.status_code, response.text[:500])
    assert "Traceback" not in response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str)


def still_serving(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_every_post_endpoint_is_fuzzed(post_paths):
    assert {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
            "/v1/messages/count_tokens"} <= set(post_paths)


mutations = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(FIELDS) | st.text(min_size=1, max_size=8),
              evil_values),
    st.tuples(st.just("drop"), st.sampled_from(FIELDS), st.none()),
)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(data=st.data(), changes=st.lists(mutations, min_size=1, max_size=3))
def test_wrong_types_missing_fields_huge_and_negative_values(http, post_paths, data, changes):
    path = data.draw(st.sampled_from(post_paths))
    body = dict(BASES.get(path, {}))
    for op, field, value in changes:
        if op == "set":
            body[field] = value
        else:
            body.pop(field, None)
    check(http.post(path, content=orjson.dumps(body),
                    headers={"content-type": "application/json"}))


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), raw=st.one_of(
    st.binary(max_size=64),                                            # anything, mostly not UTF-8
    st.binary(min_size=1, max_size=8).map(lambda b: b'{"prompt": "' + b + b'\xff", "max_tokens": 2}'),
    st.text(max_size=40).map(str.encode),                              # text, mostly not JSON
    st.sampled_from([b"", b"{", b"[", b'{"prompt": }', b"null", b"[]", b"1", b'"x"', b"NaN",
                     b'{"prompt": "a", "prompt": 1}', b'\xef\xbb\xbf{"prompt": "a"}',
                     b'{"max_tokens": 1e999, "prompt": "a"}', b'{"seed": 18446744073709551616}'])))
def test_invalid_json_and_invalid_utf8(http, post_paths, data, raw):
    path = data.draw(st.sampled_from(post_paths))
    check(http.post(path, content=raw, headers={"content-type": "application/json"}))


@pytest.mark.parametrize("make", [
    pytest.param(lambda base: b"[" * 100_000 + b"]" * 100_000, id="deep-raw-nesting"),
    pytest.param(lambda base: orjson.dumps({**base, "metadata": nested(200)}), id="deep-field"),
    pytest.param(lambda base: orjson.dumps({**base, "prompt": list(range(1, 10**6))}),
                 id="huge-token-array"),
    pytest.param(lambda base: orjson.dumps({**base, "stop": ["x"] * 200_000}), id="huge-stop-list"),
    pytest.param(lambda base: orjson.dumps({**base, "prompt": "é" * 10**6}), id="1e6-char-prompt"),
    pytest.param(lambda base: orjson.dumps({**base, "model": "m" * 10**6}), id="1e6-char-model"),
    pytest.param(lambda base: orjson.dumps({**base, "x" * 10**6: 1}), id="1e6-char-key"),
    pytest.param(lambda base: orjson.dumps({**base, "messages": [{"role": "user",
                                                                  "content": "a " * 500_000}]}),
                 id="1e6-char-message"),
])
def test_huge_and_deep_bodies(http, post_paths, make):
    for path in post_paths:
        check(http.post(path, content=make(BASES.get(path, {})),
                        headers={"content-type": "application/json"}))
    still_serving(http)


def raw_request(url: str, head: bytes, body: bytes = b"") -> bytes:
    """Send bytes as they are (httpx would refuse non-ASCII header names); the reply."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=TIMEOUT_S) as sock:
        sock.sendall(head + b"\r\ncontent-length: " + str(len(body)).encode()
                     + b"\r\nconnection: close\r\n\r\n" + body)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), name=st.binary(min_size=1, max_size=12), value=st.binary(max_size=40))
def test_headers_that_are_not_ascii(server, post_paths, data, name, value):
    path = data.draw(st.sampled_from(post_paths)).encode()
    body = orjson.dumps(BASES.get(path.decode(), {}))
    value = value.replace(b"\r", b"").replace(b"\n", b"")    # a line break would end the head
    name = name.replace(b"\r", b"").replace(b"\n", b"") or b"\x80"
    heads = [b"x-request-id: " + value + b"\r\nauthorization: Bearer " + value
             + b"\r\ncontent-type: " + value + b"\r\nx-other: " + value,
             name + b": " + value]
    for head in heads:
        reply = raw_request(server.url, b"POST " + path + b" HTTP/1.1\r\nhost: t\r\n" + head, body)
        status = int(reply.split(b" ", 2)[1])
        assert status < 500 and b"Traceback" not in reply, reply[:300]


def test_the_server_still_serves_after_the_fuzz(http):
    still_serving(http)
