"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) against a real
`tailrace serve`, with the official `anthropic` SDK (and LangChain's ChatAnthropic): text,
streaming with Anthropic's exact event order, a tool-use round trip, stop sequences,
max_tokens, thinking blocks from the qwen3 reasoning parser, structured output, token
counting, and errors in Anthropic's shape, with the API key in `x-api-key`."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

KEY = "sk-ant-tailrace-test"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}          # the SDK takes temperature only through extra_body
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object",
                            "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tmp_path_factory, serve_with_flags):
    serve = serve_with_flags(tmp_path_factory.mktemp("e2e-messages"), "--api-key", KEY,
                             "--reasoning-parser", "qwen3", "--enable-auto-tool-choice",
                             "--tool-call-parser", "hermes")
    yield next(serve)
    serve.close()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=300)   # a busy 2-core CI box


@pytest.fixture(scope="module")
def model(server) -> str:
    r = httpx.get(f"{server.url}/v1/models", headers={"x-api-key": KEY})
    return r.json()["data"][0]["id"]


def _events(server, body: dict) -> list[tuple[str, dict]]:
    """A raw stream: (event name, data) per SSE event."""
    out = []
    with httpx.stream("POST", f"{server.url}/v1/messages", json={**body, "stream": True},
                      headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                      timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_bytes()).decode()
    for block in raw.split("\n\n"):
        if not block:
            continue
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == name[len("event: "):]
        out.append((payload["type"], payload))
    return out


def _same_message(a, b) -> None:
    """Two replies to one greedy request: the same blocks, stop and token counts (the
    prefix cache may move tokens between input_tokens and cache_read_input_tokens)."""
    def blocks(m):   # a tool_use id is the request's own
        return [{**x.model_dump(), "id": x.type} if x.type == "tool_use" else x.model_dump()
                for x in m.content]
    assert blocks(a) == blocks(b)
    assert (a.stop_reason, a.stop_sequence, a.model, a.role) == (
        b.stop_reason, b.stop_sequence, b.model, b.role)
    assert a.usage.output_tokens == b.usage.output_tokens
    def prompt(u):    # Anthropic's split of the prompt (as vLLM's)
        return u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
    assert prompt(a.usage) == prompt(b.usage)


def test_create_answers_with_a_text_message(client, model):
    m = client.messages.create(model=model, max_tokens=12, messages=ASK,
                               system="You are a geography teacher.", extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model == model
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    u = m.usage
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens > 10
    assert 0 < u.output_tokens <= 12 and u.cache_creation_input_tokens % 16 == 0


def test_max_tokens_stops_with_max_tokens(client, model):
    m = client.messages.create(model=model, max_tokens=3, messages=ASK, extra_body=GREEDY)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_stop_sequences_stop_with_the_sequence_named(client, model):
    m = client.messages.create(model=model, max_tokens=20, messages=ASK,
                               stop_sequences=["nothing like it", " Paris"], extra_body=GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == " Paris"
    assert "Paris" not in m.content[0].text and m.content[0].text.endswith("is")


def test_stream_has_anthropics_event_sequence(server, model):
    events = _events(server, {"model": model, "max_tokens": 6, "messages": ASK,
                              "temperature": 0})
    names = [n for n, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["role"] == "assistant"
    assert events[2][1] == {"type": "content_block_start", "index": 0,
                            "content_block": {"type": "text", "text": ""}}
    deltas = [d for n, d in events if n == "content_block_delta"]
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for d in deltas)
    final = events[-2][1]
    assert final["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert final["usage"]["output_tokens"] == 6


@pytest.mark.parametrize("kwargs", [
    {"messages": ASK, "max_tokens": 10},
    {"messages": ASK, "max_tokens": 30, "stop_sequences": [" Paris"]},
    {"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 40,
     "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}},
])
def test_the_stream_joined_equals_the_message(client, model, kwargs):
    made = client.messages.create(model=model, extra_body=GREEDY, **kwargs)
    with client.messages.stream(model=model, extra_body=GREEDY, **kwargs) as stream:
        texts = list(stream.text_stream)
        streamed = stream.get_final_message()
    _same_message(streamed, made)
    assert "".join(texts) == "".join(b.text for b in made.content if b.type == "text")


def test_a_tool_use_round_trip(client, model):
    ask = [{"role": "user", "content": "What is the weather like in Paris?"}]
    m = client.messages.create(model=model, max_tokens=40, messages=ask, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "get_weather"},
                               extra_body=GREEDY)
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])
    history = ask + [{"role": "assistant", "content": m.content},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                    "content": "Sunny, 24 degrees."}]}]
    answer = client.messages.create(model=model, max_tokens=20, messages=history,
                                    tools=[WEATHER], extra_body=GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"
    assert answer.content[0].text
    # the tool's result is in the prompt: the whole history counts more than the question
    counted = client.messages.count_tokens(model=model, messages=history, tools=[WEATHER])
    u = answer.usage   # Anthropic's split of the prompt
    assert counted.input_tokens == (u.input_tokens + u.cache_read_input_tokens
                                    + u.cache_creation_input_tokens)


def test_a_streamed_tool_use_arrives_as_input_json_delta(server, model):
    events = _events(server, {"model": model, "max_tokens": 40, "temperature": 0,
                              "messages": [{"role": "user", "content": "Weather in Paris?"}],
                              "tools": [WEATHER],
                              "tool_choice": {"type": "tool", "name": "get_weather"}})
    starts = [d for n, d in events if n == "content_block_start"]
    uses = [d for d in starts if d["content_block"]["type"] == "tool_use"]
    assert uses and uses[0]["content_block"]["input"] == {}
    index = uses[0]["index"]
    parts = [d["delta"]["partial_json"] for n, d in events
             if n == "content_block_delta" and d["index"] == index]
    jsonschema.validate(json.loads("".join(parts)), WEATHER["input_schema"])
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_any_tool_choice_makes_a_call(client, model):
    m = client.messages.create(model=model, max_tokens=60, tools=[WEATHER],
                               messages=[{"role": "user", "content": "Weather in Rome?"}],
                               tool_choice={"type": "any"}, extra_body=GREEDY)
    assert any(b.type == "tool_use" and b.name == "get_weather" for b in m.content)


def test_thinking_blocks_come_from_the_reasoning_parser(client, model, server):
    # qwen3's parser: a reply that starts inside <think> (here an assistant prefill) reasons
    kwargs = dict(model=model, max_tokens=8, thinking={"type": "enabled", "budget_tokens": 1024},
                  messages=ASK + [{"role": "assistant", "content": "<think>\n"}],
                  extra_body=GREEDY)
    m = client.messages.create(**kwargs)
    assert m.content[0].type == "thinking" and m.content[0].thinking
    assert m.content[0].signature == ""
    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    _same_message(streamed, m)
    body = {k: v for k, v in kwargs.items() if k != "extra_body"}
    events = _events(server, {**body, "temperature": 0})
    kinds = [d["delta"]["type"] for n, d in events if n == "content_block_delta"]
    assert kinds[0] == "thinking_delta" and "signature_delta" in kinds


def test_thinking_needs_a_reasoning_parser_flag_message(client, model):
    # served with qwen3 here: "disabled" is accepted and passed to the template
    m = client.messages.create(model=model, max_tokens=4, messages=ASK,
                               thinking={"type": "disabled"}, extra_body=GREEDY)
    assert m.content[0].type == "text"


def test_output_format_constrains_the_reply_to_the_schema(client, model):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 12}},
              "required": ["capital"], "additionalProperties": False}
    m = client.messages.create(model=model, max_tokens=40, messages=ASK, extra_body={
        **GREEDY, "output_format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(m.content[0].text), schema)
    m = client.messages.create(model=model, max_tokens=40, messages=ASK, extra_body=GREEDY,
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(m.content[0].text), schema)


def test_count_tokens_equals_the_rendered_prompt(client, model):
    kwargs = dict(model=model, system=[{"type": "text", "text": "Be brief."}], messages=ASK)
    counted = client.messages.count_tokens(**kwargs)
    m = client.messages.create(max_tokens=1, extra_body=GREEDY, **kwargs)
    assert counted.input_tokens == (m.usage.input_tokens + m.usage.cache_read_input_tokens
                                    + m.usage.cache_creation_input_tokens)
    choice = {"type": "tool", "name": "get_weather"}
    with_tools = client.messages.count_tokens(tools=[WEATHER], tool_choice=choice, **kwargs)
    m = client.messages.create(max_tokens=1, tools=[WEATHER], tool_choice=choice,
                               extra_body=GREEDY, **kwargs)
    assert with_tools.input_tokens == (m.usage.input_tokens + m.usage.cache_read_input_tokens
                                       + m.usage.cache_creation_input_tokens)


def test_sampling_fields_in_the_body_are_honoured(client, model):
    body = {"temperature": 0.9, "top_p": 0.9, "top_k": 20, "seed": 7}
    a = client.messages.create(model=model, max_tokens=8, messages=ASK, extra_body=body)
    b = client.messages.create(model=model, max_tokens=8, messages=ASK, extra_body=body)
    assert a.content == b.content                       # seeded: the same draw


@pytest.mark.parametrize("body, status, param", [
    ({"messages": ASK}, 400, "max_tokens"),
    ({"messages": ASK, "max_tokens": 5, "temperature": 1.5}, 400, "temperature"),
    ({"messages": [{"role": "tool", "content": "x"}], "max_tokens": 5}, 400, "'tool'"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
      "max_tokens": 5}, 400, "image"),
    ({"messages": ASK, "max_tokens": 5, "tools": [{"name": "f"}]}, 400, "input_schema"),
    ({"messages": ASK, "max_tokens": 5, "tool_choice": {"type": "maybe"}}, 400, "tool_choice"),
    ({"messages": ASK, "max_tokens": 5, "thinking": {"type": "sometimes"}}, 400, "thinking"),
    ({"messages": ASK, "max_tokens": 5, "model": "claude-sonnet-4-5"}, 404, "does not exist"),
    ({"messages": ASK, "max_tokens": 5000}, 400, "context length"),
])
def test_errors_are_in_anthropics_shape(server, model, body, status, param):
    r = httpx.post(f"{server.url}/v1/messages", json={"model": model, **body},
                   headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == status, r.text
    data = r.json()
    assert data["type"] == "error" and set(data["error"]) == {"type", "message"}
    assert data["error"]["type"] == ("not_found_error" if status == 404
                                     else "invalid_request_error")
    assert param in data["error"]["message"]


def test_sdk_raises_its_own_errors(client, model, server):
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=model, max_tokens=5, messages=[])
    assert err.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-opus-4-1", max_tokens=5, messages=ASK)
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        wrong.messages.create(model=model, max_tokens=5, messages=ASK)
    assert err.value.body["error"]["type"] == "authentication_error"


def test_bearer_keys_and_other_routes(server, model):
    r = httpx.post(f"{server.url}/v1/messages", json={"model": model, "max_tokens": 2,
                                                      "messages": ASK, "temperature": 0},
                   headers={"authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200 and r.json()["type"] == "message"
    r = httpx.get(f"{server.url}/v1/messages/nothing", headers={"x-api-key": KEY})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(f"{server.url}/v1/messages", content=b"{not json",
                   headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["type"] == "error"
    # the OpenAI APIs keep OpenAI's shape, and take x-api-key too
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": []},
                   headers={"x-api-key": KEY})
    assert r.status_code == 400 and "type" not in r.json()


def test_langchain_chat_anthropic(server, model):
    from langchain_anthropic import ChatAnthropic

    llm = ChatAnthropic(model=model, base_url=server.url, api_key=KEY, max_tokens=12,
                        temperature=0, max_retries=0)
    answer = llm.invoke("What is the capital of France?")
    assert "Paris" in answer.content
    assert answer.usage_metadata["output_tokens"] > 0
    chunks = list(llm.stream("What is the capital of France?"))
    assert "".join(c.text for c in chunks) == answer.content
