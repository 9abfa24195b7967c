"""Beam search over HTTP with the openai client (the shared session server)."""
from __future__ import annotations

import openai
import pytest


def test_beam_search_with_the_openai_client(client, model_name):
    messages = [{"role": "user", "content": "Name a colour."}]
    extra = {"use_beam_search": True, "ignore_eos": True}
    out = client.chat.completions.create(model=model_name, messages=messages, n=2, max_tokens=5,
                                         extra_body=extra)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].message.content != out.choices[1].message.content
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 2 * 5        # summed over the returned beams, as vLLM
    # a stream gets the same beams, each whole, once the search is over
    texts = ["", ""]
    for chunk in client.chat.completions.create(model=model_name, messages=messages, n=2,
                                                max_tokens=5, stream=True, extra_body=extra):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in out.choices]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model_name, prompt="hi", n=2, max_tokens=5, stop=["x"],
                                  extra_body={"use_beam_search": True})
    assert err.value.body["param"] == "use_beam_search"
