"""A server with a reasoning parser and two served names, over real HTTP with the official
openai client: replies name the first served model, reasoning is the `reasoning` field,
reasoning tokens are counted once per choice, include_reasoning false hides it. (The
protocol's field policy without a server: tests/stages/api/test_protocol.py.)"""
from __future__ import annotations

import openai
import pytest

HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def thinker(reasoning_server):
    return openai.OpenAI(base_url=reasoning_server.base_url, api_key="x", max_retries=0,
                         timeout=120)


def test_replies_name_the_first_served_model_whichever_alias(thinker):
    r = thinker.chat.completions.create(model="thinker-alias", messages=HELLO, max_tokens=2)
    assert r.model == "thinker"
    with pytest.raises(openai.NotFoundError):
        thinker.chat.completions.create(model="other", messages=HELLO, max_tokens=2)


def test_reasoning_is_the_reasoning_field(thinker):
    r = thinker.chat.completions.create(model="thinker", messages=HELLO, max_tokens=6,
                                        temperature=0, extra_body={"ignore_eos": True})
    message = r.choices[0].message
    assert message.reasoning and not message.content
    assert "reasoning_content" not in message.model_extra
    assert r.usage.completion_tokens_details.reasoning_tokens == 6
    chunks = list(thinker.chat.completions.create(
        model="thinker", messages=HELLO, max_tokens=6, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    streamed = "".join(getattr(c.choices[0].delta, "reasoning", None) or ""
                       for c in chunks if c.choices)
    assert streamed == message.reasoning


def test_reasoning_tokens_sum_every_choice_once(thinker):
    chunks = list(thinker.chat.completions.create(
        model="thinker", messages=HELLO, max_tokens=5, temperature=1.0, seed=4, n=2,
        stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    final = chunks[-1].usage
    assert final.completion_tokens == 10
    assert final.completion_tokens_details.reasoning_tokens == 10     # all of it, once each
    assert all(c.usage.completion_tokens_details.reasoning_tokens <= 10 for c in chunks)


def test_include_reasoning_false_hides_reasoning_and_its_logprobs(thinker):
    r = thinker.chat.completions.create(
        model="thinker", messages=HELLO, max_tokens=4, temperature=0, logprobs=True,
        extra_body={"ignore_eos": True, "include_reasoning": False})
    message = r.choices[0].message
    assert not getattr(message, "reasoning", None) and not message.content
    assert r.choices[0].logprobs is None     # with a parser on, none at all (as vLLM)
    assert r.usage.completion_tokens_details.reasoning_tokens == 4
