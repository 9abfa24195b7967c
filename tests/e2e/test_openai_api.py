"""The real server through the official openai client (and httpx where the client hides
the wire). Small max_tokens everywhere: this runs on a CPU."""
from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def chat_prompt_tokens(tokenizer, messages) -> int:
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return len(tokenizer.encode(prompt, add_special_tokens=False))


def metric(server, name: str) -> float:
    """A series without labels of its own: vLLM's carry only model_name."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    match = re.search(rf"^(?:tailrace:{name}|vllm:{name}{{model_name=\"[^\"]*\"}}) "
                      rf"([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


# -- chat ----------------------------------------------------------------------

def test_chat_greedy_knows_paris(client, model_name, tokenizer):
    r = client.chat.completions.create(model=model_name, messages=FRANCE, max_tokens=16,
                                       temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.model == model_name
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == chat_prompt_tokens(tokenizer, FRANCE)
    assert 0 < r.usage.completion_tokens <= 16
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_with_usage(client, model_name, tokenizer):
    stream = client.chat.completions.create(
        model=model_name, messages=FRANCE, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert usage_chunk.usage.prompt_tokens == chat_prompt_tokens(tokenizer, FRANCE)
    assert usage_chunk.usage.completion_tokens == 8
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text


def test_chat_stream_without_usage_has_no_usage_chunk(client, model_name):
    chunks = list(client.chat.completions.create(
        model=model_name, messages=FRANCE, max_tokens=4, stream=True))
    assert all(c.choices for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


# -- completions ---------------------------------------------------------------

def test_completion(client, model_name, tokenizer):
    prompt = "The capital of France is"
    r = client.completions.create(model=model_name, prompt=prompt, max_tokens=6,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].text
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=True))
    assert r.usage.completion_tokens == 6


def test_completion_default_max_tokens_is_16(client, model_name):
    r = client.completions.create(model=model_name, prompt="Once upon a time",
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16


def test_completion_stream_matches_greedy_body(client, model_name):
    kwargs = dict(model=model_name, prompt="1, 2, 3,", max_tokens=6, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True,
                                            stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].usage.completion_tokens == 6


# -- concurrency ---------------------------------------------------------------

def test_sixteen_concurrent_requests(client, model_name, tokenizer):
    def one(i):
        messages = [{"role": "user", "content": f"Count to {i}."}]
        r = client.chat.completions.create(model=model_name, messages=messages, max_tokens=4,
                                           extra_body={"ignore_eos": True})
        return messages, r

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    assert len({r.id for _, r in results}) == 16
    for messages, r in results:
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 4
        assert r.usage.prompt_tokens == chat_prompt_tokens(tokenizer, messages)


# -- errors --------------------------------------------------------------------

def test_negative_max_tokens_is_400(client, model_name):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=FRANCE, max_tokens=-1)
    err = info.value
    assert err.status_code == 400 and err.param == "max_tokens"
    body = err.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"


def test_too_long_prompt_is_400(client, model_name):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "hello " * 1100}])
    assert "maximum context length is 1024 tokens" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=FRANCE, max_tokens=1020)
    assert "in the messages, 1020 in the completion" in info.value.message


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-17", messages=FRANCE, max_tokens=4)
    assert info.value.code == "model_not_found" and info.value.param == "model"


@pytest.mark.parametrize("extra", [{"temperature": "hot"}, {"max_tokens": "8"},
                                   {"messages": "hello"}, {"stream": "yes"}])
def test_bad_types_are_400(server, model_name, extra):
    body = {"model": model_name, "messages": FRANCE, "max_tokens": 4, **extra}
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == next(iter(extra))


def test_malformed_json_unknown_route_and_wrong_method(server):
    r = httpx.post(f"{server.base_url}/chat/completions", content=b"{nope", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(f"{server.base_url}/nothing-here", timeout=30)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(f"{server.base_url}/chat/completions", timeout=30)
    assert r.status_code == 405 and "error" in r.json()


# -- responses -----------------------------------------------------------------

def test_responses_stream_event_order(client, model_name):
    stream = client.responses.create(model=model_name, input="Say hello.", max_output_tokens=8,
                                     instructions="Be brief.", stream=True)
    events = list(stream)
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas
    tail = types[types.index("response.output_text.done"):]
    assert tail[:3] == ["response.output_text.done", "response.content_part.done",
                        "response.output_item.done"]
    assert tail[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output[0].content[0].text == "".join(d.delta for d in deltas)
    assert final.instructions == "Be brief." and final.max_output_tokens == 8
    assert final.usage.output_tokens <= 8
    assert final.usage.total_tokens == final.usage.input_tokens + final.usage.output_tokens


def test_responses_non_stream_and_incomplete(client, model_name):
    r = client.responses.create(model=model_name, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Tell me a story."}]}],
        max_output_tokens=5, extra_body={"ignore_eos": True})
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5
    assert r.output_text


def test_responses_unsupported_field_is_400(client, model_name):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=model_name, input="hi", conversation="conv_1")
    assert info.value.param == "conversation"


# -- the rest of the surface ----------------------------------------------------

def test_models_health_and_request_id(server, model_name):
    models = httpx.get(f"{server.base_url}/models", timeout=30).json()
    assert models["object"] == "list"
    assert models["data"][0]["owned_by"] == "tailrace"
    assert models["data"][0]["max_model_len"] == 1024
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    r = httpx.post(f"{server.base_url}/completions", timeout=60,
                   json={"model": model_name, "prompt": "Hi", "max_tokens": 2},
                   headers={"x-request-id": "my-request-1"})
    assert r.headers["x-request-id"] == "my-request-1"
    assert r.json()["id"] == "cmpl-my-request-1"


def test_disconnect_frees_the_kv_cache(server, model_name):
    body = {"model": model_name, "messages": FRANCE, "max_tokens": 900, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.base_url}/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            seen = 0
            for line in lines:
                if line.startswith("data: "):
                    seen += 1
                if seen == 2:
                    break
            assert metric(server, "kv_blocks_used") > 0
    # The abort lands between engine steps; give a slow CPU step time to finish.
    deadline = time.monotonic() + 5
    while metric(server, "kv_blocks_used") > 0 or metric(server, "num_requests_running") > 0:
        assert time.monotonic() < deadline, "the aborted request still holds KV blocks"
        time.sleep(0.05)


def test_logprobs_through_the_openai_client(client, model_name):
    chat = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Say hello"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    comp = client.completions.create(model=model_name, prompt="Hello", max_tokens=3, temperature=0,
                                     logprobs=1)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3


def test_version(server):
    import httpx

    r = httpx.get(f"{server.url}/version")
    assert r.status_code == 200 and r.json()["version"] == "0.1.0"
