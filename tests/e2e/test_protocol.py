"""The protocol's field policy and the behaviours that follow vLLM, over real HTTP with
the official openai client."""
from __future__ import annotations

import openai
import pytest

HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.mark.parametrize("api", ["chat", "completions", "responses"])
def test_unknown_field_is_refused_as_openai_does(client, model_name, api):
    with pytest.raises(openai.BadRequestError) as info:
        if api == "chat":
            client.chat.completions.create(model=model_name, messages=HELLO, max_tokens=2,
                                           extra_body={"frobnicate": 1})
        elif api == "completions":
            client.completions.create(model=model_name, prompt="hi", max_tokens=2,
                                      extra_body={"frobnicate": 1})
        else:
            client.responses.create(model=model_name, input="hi", max_output_tokens=2,
                                    extra_body={"frobnicate": 1})
    assert info.value.param == "frobnicate"
    assert info.value.message.endswith("Unrecognized request argument supplied: frobnicate")


def test_fields_that_mean_nothing_here_are_accepted(client, model_name):
    r = client.chat.completions.create(
        model=model_name, messages=HELLO, max_tokens=2, user="u1", metadata={"k": "v"},
        service_tier="auto", store=False, prompt_cache_key="tenant-1", safety_identifier="s")
    assert r.choices[0].finish_reason in ("stop", "length")


def test_known_but_unimplemented_field_names_itself(client, model_name):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=HELLO, max_tokens=2,
                                       extra_body={"use_beam_search": True})
    assert info.value.param == "use_beam_search" and "use_beam_search" in info.value.message


def test_validation_error_names_the_json_path(client, model_name):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model_name, max_tokens=2,
            messages=[{"role": "user", "content": "a"}, {"role": "user", "content": 7}])
    assert info.value.param == "messages[1].content"


@pytest.mark.parametrize("kwargs, param", [
    ({"tools": []}, "tools"), ({"tool_choice": "auto"}, "tool_choice")])
def test_empty_tools_and_tool_choice_without_tools(client, model_name, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=HELLO, max_tokens=2, **kwargs)
    assert info.value.param == param


def test_empty_model_means_the_default(client, model_name):
    r = client.completions.create(model="", prompt="The capital of France is", max_tokens=2)
    assert r.model == model_name


# -- a reasoning parser, two served names ---------------------------------------------

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
    assert r.choices[0].logprobs.content == []
    assert r.usage.completion_tokens_details.reasoning_tokens == 4
