"""logit_bias, allowed_token_ids and bad_words over real HTTP with the openai client."""
from __future__ import annotations

import openai
import pytest

HELLO = [{"role": "user", "content": "Say hello."}]
PROMPT = "The capital of France is"


def contains(ids: list[int], word: list[int]) -> bool:
    return any(ids[i:i + len(word)] == word for i in range(len(ids) - len(word) + 1))


def completion_ids(client, model_name, **extra) -> list[int]:
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True,
                                              **extra})
    return r.choices[0].model_extra["token_ids"]


def test_logit_bias_forces_a_token(client, model_name, tokenizer):
    (banana,) = tokenizer.encode(" banana")
    bias = {str(banana): 100}
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, temperature=1.0,
                                  seed=1, logit_bias=bias, logprobs=1,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    assert r.choices[0].model_extra["token_ids"] == [banana] * 4
    assert r.choices[0].text == " banana" * 4
    # logprobs are the raw model's (vLLM's default): the forced token was not likely
    assert r.choices[0].logprobs.token_logprobs[0] < -1.0
    chat = client.chat.completions.create(model=model_name, messages=HELLO, max_tokens=3,
                                          temperature=0, logit_bias=bias, stream=True,
                                          extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == " banana" * 3
    # a bias of -100 removes the greedy choice; a bias over 100 is clamped, not refused
    first = completion_ids(client, model_name)[0]
    assert completion_ids(client, model_name, logit_bias={str(first): -100})[0] != first
    assert completion_ids(client, model_name, logit_bias={str(banana): 1e6})[0] == banana


def test_allowed_token_ids_restrict_the_output(client, model_name, tokenizer):
    allowed = [t for w in (" yes", " no", "yes", "no") for t in tokenizer.encode(w)]
    r = client.chat.completions.create(model=model_name, messages=HELLO, max_tokens=10,
                                       temperature=1.0, seed=5,
                                       extra_body={"allowed_token_ids": allowed,
                                                   "return_token_ids": True, "ignore_eos": True})
    ids = r.choices[0].model_extra["token_ids"]
    assert len(ids) == 10 and set(ids) <= set(allowed)
    ids = completion_ids(client, model_name, allowed_token_ids=allowed)
    assert len(ids) == 8 and set(ids) <= set(allowed)


def test_bad_words_never_appear(client, model_name, tokenizer):
    free = completion_ids(client, model_name)
    word = tokenizer.decode(free[:2]).strip()           # the greedy answer's first words
    banned = [tokenizer.encode(word), tokenizer.encode(" " + word)]
    assert any(contains(free, b) for b in banned)       # the ban has something to do
    ids = completion_ids(client, model_name, bad_words=[word])
    assert ids != free and len(ids) == 8
    assert not any(contains(ids, b) for b in banned)
    single = tokenizer.decode(free[:1]).strip()
    r = client.chat.completions.create(model=model_name, messages=HELLO, max_tokens=8,
                                       temperature=0,
                                       extra_body={"bad_words": [single, word],
                                                   "return_token_ids": True})
    out = r.choices[0].model_extra["token_ids"]
    assert not any(contains(out, tokenizer.encode(w)) or contains(out, tokenizer.encode(" " + w))
                   for w in (single, word))


@pytest.mark.parametrize("field, value", [
    ("logit_bias", {"abc": 5}), ("logit_bias", {"1": "high"}), ("logit_bias", {"999999999": 1}),
    ("allowed_token_ids", []), ("allowed_token_ids", [1, 10**9]), ("allowed_token_ids", [-1]),
    ("bad_words", [""]), ("bad_words", "word"),
])
@pytest.mark.parametrize("api", ["chat", "completions"])
def test_invalid_logit_controls_are_400(client, model_name, api, field, value):
    with pytest.raises(openai.BadRequestError) as info:
        if api == "chat":
            client.chat.completions.create(model=model_name, messages=HELLO, max_tokens=2,
                                           extra_body={field: value})
        else:
            client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2,
                                      extra_body={field: value})
    assert info.value.status_code == 400
    assert info.value.param == field and field in info.value.message
    assert info.value.type == "invalid_request_error"
