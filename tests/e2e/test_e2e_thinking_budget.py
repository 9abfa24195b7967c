"""thinking_token_budget over real HTTP with the official openai client (issue 37): a
server with --reasoning-parser qwen3 on a tiny random-weight Llama whose tokenizer
(SmolLM2's, with <think> and </think> added as single tokens, as Qwen3's has them) and
chat template (which leaves a <think> open, as Qwen3's in thinking mode) make every reply
start in reasoning.

A logit bias of -100 on </think> keeps the model from ever closing its reasoning itself,
and one on EOS from stopping: without a budget all max_tokens are reasoning; with one, the
reasoning is exactly `budget` tokens, the next token is the forced </think>, and the rest
is content. Token counts come from return_token_ids, text from the tokenizer."""
from __future__ import annotations

import json

import openai
import pytest

from gpu.loader.decoder import load_model
from gpu.tokenizers.files import load_tokenizer

from tests.support.live_servers import threaded_server

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n"
            "{% endif %}")
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    from tokenizers import AddedToken

    path = tmp_path_factory.mktemp("tiny-thinker")
    hf = load_tokenizer(None).hf
    hf.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    hf.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": TEMPLATE, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}))
    eos = hf.token_to_id("<|im_end|>")
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": hf.get_vocab_size(),
        "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 256,
        "eos_token_id": eos}))
    loaded = load_model(str(path), load_format="dummy", dtype="float32", progress=False)
    with threaded_server(loaded, max_model_len=256, reasoning_parser="qwen3") as srv:
        yield srv, loaded.tokenizer, hf.token_to_id("</think>"), eos


@pytest.fixture(scope="module")
def client(thinker):
    srv = thinker[0]
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=120)


def ask(client, thinker, stream: bool, **extra):
    _, _, close, eos = thinker
    body = dict(model=client.models.list().data[0].id, max_tokens=MAX_TOKENS, temperature=0,
                messages=[{"role": "user", "content": "Think about it."}],
                extra_body={"return_token_ids": True, "logit_bias": {close: -100, eos: -100},
                            **extra})
    if not stream:
        r = client.chat.completions.create(**body)
        ch = r.choices[0]
        extra_fields = ch.message.model_extra or {}
        reasoning = extra_fields.get("reasoning") or extra_fields.get("reasoning_content") or ""
        return reasoning, ch.message.content or "", ch.model_extra["token_ids"], ch.finish_reason
    reasoning, content, ids, finish = "", "", [], None
    for c in client.chat.completions.create(stream=True, **body):
        for ch in c.choices:
            d = ch.delta.model_extra or {}
            reasoning += d.get("reasoning") or d.get("reasoning_content") or ""
            content += ch.delta.content or ""
            ids += (ch.model_extra or {}).get("token_ids") or []
            finish = ch.finish_reason or finish
    return reasoning, content, ids, finish


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("budget", [None, -1])      # -1: no limit, as vLLM
def test_without_a_budget_the_whole_reply_is_reasoning(client, thinker, stream, budget):
    _, tok, close, _ = thinker
    reasoning, content, ids, finish = ask(client, thinker, stream, thinking_token_budget=budget)
    assert finish == "length" and len(ids) == MAX_TOKENS and close not in ids
    assert content == "" and reasoning == tok.decode(ids)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("budget", [0, 3])
def test_the_budget_closes_the_reasoning_after_budget_tokens(client, thinker, stream, budget):
    _, tok, close, _ = thinker
    free = ask(client, thinker, stream)[2]
    reasoning, content, ids, finish = ask(client, thinker, stream, thinking_token_budget=budget)
    assert finish == "length" and len(ids) == MAX_TOKENS
    # the first `budget` tokens are those the model reasons freely; then the forced </think>
    assert ids[:budget] == free[:budget] and ids[budget] == close and close not in ids[budget + 1:]
    assert reasoning == tok.decode(ids[:budget])
    assert content and content == tok.decode(ids[budget + 1:])


def test_a_negative_budget_other_than_minus_one_is_a_400(client, thinker):
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, thinker, False, thinking_token_budget=-2)
    assert e.value.status_code == 400 and "thinking_token_budget" in str(e.value)
