"""vLLM's request surface beyond OpenAI's (issue 8), over real HTTP with the openai client."""
from __future__ import annotations

import httpx
import openai
import pytest


HELLO = [{"role": "user", "content": "Say hello."}]


def test_return_token_ids_chat(client, model_name, tokenizer):
    r = client.chat.completions.create(model=model_name, messages=HELLO, max_tokens=6,
                                       temperature=0, extra_body={"return_token_ids": True})
    prompt_ids, ids = r.model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"]
    assert len(prompt_ids) == r.usage.prompt_tokens and len(ids) == r.usage.completion_tokens
    assert tokenizer.decode(ids) == r.choices[0].message.content
    chunks = list(client.chat.completions.create(
        model=model_name, messages=HELLO, max_tokens=6, temperature=0, stream=True,
        extra_body={"return_token_ids": True}))
    assert chunks[0].model_extra["prompt_token_ids"] == prompt_ids
    streamed = [t for c in chunks for ch in c.choices for t in (ch.model_extra.get("token_ids") or [])]
    assert streamed == ids


def test_return_token_ids_completions(client, model_name):
    r = client.completions.create(model=model_name, prompt="The capital of France is",
                                  max_tokens=4, temperature=0,
                                  extra_body={"return_token_ids": True})
    choice = r.choices[0].model_extra
    assert len(choice["prompt_token_ids"]) == r.usage.prompt_tokens
    assert len(choice["token_ids"]) == r.usage.completion_tokens
    chunks = list(client.completions.create(
        model=model_name, prompt="The capital of France is", max_tokens=4, temperature=0,
        stream=True, extra_body={"return_token_ids": True}))
    assert chunks[0].choices[0].model_extra["prompt_token_ids"] == choice["prompt_token_ids"]
    assert [t for c in chunks for ch in c.choices
            for t in (ch.model_extra.get("token_ids") or [])] == choice["token_ids"]


def test_continuous_usage_stats(client, model_name):
    chunks = list(client.chat.completions.create(
        model=model_name, messages=HELLO, max_tokens=5, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    usages = [c.usage for c in chunks]
    assert all(u is not None for u in usages)
    completion = [u.completion_tokens for u in usages]
    assert completion == sorted(completion) and completion[-1] == 5
    assert chunks[-1].choices == [] and usages[-1].total_tokens == usages[-1].prompt_tokens + 5


def test_empty_stream_options_add_nothing(client, model_name):
    chunks = list(client.chat.completions.create(model=model_name, messages=HELLO,
                                                 max_tokens=3, stream=True, stream_options={}))
    assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)


def test_truncate_prompt_tokens(client, model_name):
    long = "word " * 300
    r = client.completions.create(model=model_name, prompt=long, max_tokens=2,
                                  extra_body={"truncate_prompt_tokens": 50})
    assert r.usage.prompt_tokens == 50


def test_kv_transfer_params_prompt_token_ids(client, model_name, tokenizer):
    ids = tokenizer.encode("The capital of France is")
    r = client.chat.completions.create(model=model_name, messages=HELLO, max_tokens=3,
                                       temperature=0,
                                       extra_body={"kv_transfer_params": {"prompt_token_ids": ids}})
    assert r.usage.prompt_tokens == len(ids)
    c = client.completions.create(model=model_name, prompt=ids, max_tokens=3, temperature=0)
    assert r.choices[0].message.content == c.choices[0].text
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=HELLO, max_tokens=3,
                                       extra_body={"kv_transfer_params": {"prompt_token_ids": [10**9]}})
    assert "out of vocabulary" in info.value.message


def test_media_part_is_400(client, model_name):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                         {"type": "image_url",
                                          "image_url": {"url": "http://example.com/a.png"}}]}])
    assert "image_url" in info.value.message


def test_cache_salt_keeps_tenants_apart(client, model_name):
    prompt = "Tell me about the history of Paris. " * 8
    def cached(salt):
        r = client.completions.create(model=model_name, prompt=prompt, max_tokens=1,
                                      extra_body={"cache_salt": salt})
        return r.usage.prompt_tokens_details.cached_tokens
    cached("tenant-a")
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0


def test_tokenize_and_detokenize(server, model_name, tokenizer):
    r = httpx.post(f"{server.url}/tokenize", json={"model": model_name, "prompt": "Hello world",
                                                   "return_token_strs": True}, timeout=30)
    body = r.json()
    assert r.status_code == 200 and body["tokens"] == tokenizer.encode("Hello world", add_special_tokens=True)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 1024
    assert len(body["token_strs"]) == body["count"]
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": HELLO}, timeout=30).json()
    c = httpx.post(f"{server.url}/v1/chat/completions",
                   json={"messages": HELLO, "max_tokens": 1}, timeout=30).json()
    assert chat["count"] == c["usage"]["prompt_tokens"] and chat["token_strs"] is None
    d = httpx.post(f"{server.url}/detokenize", json={"tokens": body["tokens"]}, timeout=30)
    assert d.status_code == 200 and d.json()["prompt"].endswith("Hello world")
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [-1]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(f"{server.url}/tokenize", json={"prompt": "a", "messages": HELLO}, timeout=30)
    assert both.status_code == 400


def test_data_parallel_rank_header_is_accepted(server, model_name):
    r = httpx.post(f"{server.base_url}/completions", timeout=60,
                   headers={"X-data-parallel-rank": "0"},
                   json={"model": model_name, "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200


# -- server-wide options --------------------------------------------------------------

@pytest.fixture(scope="module")
def configured(configured_server):
    return openai.OpenAI(base_url=configured_server.base_url, api_key="x", max_retries=0,
                         timeout=120)


def test_force_include_usage(configured):
    chunks = list(configured.chat.completions.create(model="", messages=HELLO, max_tokens=3,
                                                     stream=True))
    assert all(c.usage is not None for c in chunks)          # continuous usage, unasked
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 3


def test_override_max_new_tokens_is_a_ceiling(configured):
    r = configured.completions.create(model="", prompt="Once upon a time", max_tokens=50,
                                      extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5


def test_stream_interval_keeps_every_event(configured):
    """--stream-interval 3: the events are written three tokens at a time, and the client
    reads the same reply as without streaming, one event a token."""
    whole = configured.completions.create(model="", prompt="Once upon a time", max_tokens=5,
                                          temperature=0, extra_body={"ignore_eos": True})
    chunks = list(configured.completions.create(model="", prompt="Once upon a time",
                                                max_tokens=5, stream=True, temperature=0,
                                                extra_body={"ignore_eos": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == whole.choices[0].text
    assert len([t for t in texts if t]) == 5
    assert chunks[-1].usage.completion_tokens == 5


def test_server_chat_template(configured_server):
    r = httpx.post(f"{configured_server.url}/tokenize", json={"messages": HELLO,
                                                              "return_token_strs": True},
                   timeout=30).json()
    assert "CUSTOM" in "".join(r["token_strs"])


def test_per_request_metrics(configured):
    r = configured.completions.create(model="", prompt="Once upon a time", max_tokens=4,
                                      extra_body={"ignore_eos": True})
    m = r.model_extra["metrics"]
    assert set(m) == {"queue_time_ms", "time_to_first_token_ms", "generation_time_ms",
                      "mean_itl_ms", "tokens_per_second"}
    assert m["time_to_first_token_ms"] > 0 and m["generation_time_ms"] > 0
    assert abs(m["mean_itl_ms"] - m["generation_time_ms"] / 3) < 0.01
    chunks = list(configured.chat.completions.create(model="", messages=HELLO, max_tokens=3,
                                                     stream=True))
    assert "metrics" in chunks[-1].model_extra and chunks[-1].choices == []
    assert all("metrics" not in c.model_extra for c in chunks[:-1])


def test_metrics_use_vllm_names(server, client, model_name):
    client.completions.create(model=model_name, prompt="Hello", max_tokens=3)
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    label = f'model_name="{model_name}"'
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prompt_tokens_total", "generation_tokens_total", "num_preemptions_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total"):
        assert f"vllm:{name}{{{label}}} " in text, name
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert f'vllm:{name}_bucket{{le="+Inf",{label}}} ' in text, name
        count = float(text.split(f"vllm:{name}_count{{{label}}} ")[1].split()[0])
        assert count >= 1, name
    assert f'vllm:request_success_total{{finished_reason="length",{label}}} ' in text
    assert 'finished_reason="abort",model_name' not in text     # aborts are not successes
    assert "tailrace:kv_blocks_used " in text


# -- n > 1 -------------------------------------------------------------------------------

def test_n_choices_chat(client, model_name, tokenizer):
    r = client.chat.completions.create(model=model_name, messages=HELLO, max_tokens=8, n=3,
                                       temperature=1.0, seed=11,
                                       extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 3 * 8                  # usage sums every choice
    assert len({c.message.content for c in r.choices}) > 1     # each its own stream
    again = client.chat.completions.create(model=model_name, messages=HELLO, max_tokens=8,
                                           n=3, temperature=1.0, seed=11,
                                           extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    # choice i of a seed-s request samples as a one-choice request with seed s + i
    single = client.chat.completions.create(model=model_name, messages=HELLO, max_tokens=8,
                                            temperature=1.0, seed=12,
                                            extra_body={"ignore_eos": True})
    assert single.choices[0].message.content == r.choices[1].message.content


def test_n_choices_stream(client, model_name):
    chunks = list(client.completions.create(
        model=model_name, prompt="Once upon a time", max_tokens=5, n=2, temperature=1.0,
        seed=3, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}))
    texts, finishes = {0: "", 1: ""}, {0: [], 1: []}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                finishes[ch.index].append(ch.finish_reason)
    assert finishes == {0: ["length"], 1: ["length"]}          # each sent exactly once
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    body = client.completions.create(model=model_name, prompt="Once upon a time",
                                     max_tokens=5, n=2, temperature=1.0, seed=3,
                                     extra_body={"ignore_eos": True})
    assert [c.text for c in body.choices] == [texts[0], texts[1]]


# -- --skip-tokenizer-init -----------------------------------------------------------------

def test_skip_tokenizer_init_serves_token_ids(tokenless_server, tokenizer):
    c = openai.OpenAI(base_url=tokenless_server.base_url, api_key="x", max_retries=0,
                      timeout=120)
    ids = tokenizer.encode("The capital of France is")
    r = c.completions.create(model="", prompt=ids, max_tokens=4, temperature=0,
                             extra_body={"ignore_eos": True})
    out = r.choices[0].model_extra["token_ids"]
    assert len(out) == 4 and r.choices[0].text == ""           # ids, and no text
    chat = c.chat.completions.create(model="", messages=HELLO, max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True,
                                                 "kv_transfer_params": {"prompt_token_ids": ids}})
    assert chat.choices[0].model_extra["token_ids"] == out
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="", messages=HELLO, max_tokens=4)
    assert "token ids" in info.value.message


# -- prompt lists, echo, prompt logprobs ---------------------------------------------------

def test_prompt_list_is_several_prompts(client, model_name, tokenizer):
    prompts = ["Once upon a time", "The capital of France is"]
    alone = [client.completions.create(model=model_name, prompt=p, max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True}) for p in prompts]
    r = client.completions.create(model=model_name, prompt=prompts, max_tokens=4, n=2,
                                  temperature=0, extra_body={"ignore_eos": True,
                                                             "return_token_ids": True})
    # vLLM's order: prompt i's choice j is choice i * n + j
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [alone[0].choices[0].text] * 2 + \
                                          [alone[1].choices[0].text] * 2
    assert [c.model_extra["prompt_token_ids"] for c in r.choices] == \
        [tokenizer.encode(prompts[0])] * 2 + [tokenizer.encode(prompts[1])] * 2
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)   # each prompt once
    assert r.usage.completion_tokens == 4 * 4                                   # every choice
    chunks = list(client.completions.create(
        model=model_name, prompt=[[1, 2, 3], [4, 5]], max_tokens=3, n=2, temperature=1.0,
        seed=5, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}))
    finishes = [ch.index for c in chunks for ch in c.choices if ch.finish_reason]
    assert sorted(finishes) == [0, 1, 2, 3]
    assert chunks[-1].usage.prompt_tokens == 5 and chunks[-1].usage.completion_tokens == 12


def test_completions_echo(client, model_name):
    r = client.completions.create(model=model_name, prompt="The capital of France is",
                                  max_tokens=3, temperature=0, echo=True)
    plain = client.completions.create(model=model_name, prompt="The capital of France is",
                                      max_tokens=3, temperature=0)
    assert r.choices[0].text == "The capital of France is" + plain.choices[0].text
    chunks = list(client.completions.create(model=model_name, prompt="The capital of France is",
                                            max_tokens=3, temperature=0, echo=True, stream=True))
    assert chunks[0].choices[0].text.startswith("The capital of France is")
    assert "".join(ch.text for c in chunks for ch in c.choices) == r.choices[0].text
    with pytest.raises(openai.BadRequestError) as info:   # max_tokens 0 only with echo
        client.completions.create(model=model_name, prompt="x", max_tokens=0)
    assert info.value.body["param"] == "max_tokens"


def test_chat_echo_prepends_the_final_assistant_message(client, model_name):
    msgs = HELLO + [{"role": "assistant", "content": "Hello! I am"}]
    r = client.chat.completions.create(model=model_name, messages=msgs, max_tokens=4,
                                       temperature=0, extra_body={"echo": True,
                                                                  "add_generation_prompt": False,
                                                                  "continue_final_message": True})
    plain = client.chat.completions.create(model=model_name, messages=msgs, max_tokens=4,
                                           temperature=0,
                                           extra_body={"add_generation_prompt": False,
                                                       "continue_final_message": True})
    assert r.choices[0].message.content == "Hello! I am" + plain.choices[0].message.content
    chunks = list(client.chat.completions.create(
        model=model_name, messages=msgs, max_tokens=4, temperature=0, stream=True,
        extra_body={"echo": True, "add_generation_prompt": False,
                    "continue_final_message": True}))
    assert chunks[1].choices[0].delta.content == "Hello! I am"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content


def test_chat_prompt_logprobs(client, model_name, tokenizer):
    r = client.chat.completions.create(model=model_name, messages=HELLO, max_tokens=2,
                                       temperature=0, extra_body={"prompt_logprobs": 2,
                                                                  "return_token_ids": True})
    ids = r.model_extra["prompt_token_ids"]
    lps = r.model_extra["prompt_logprobs"]
    assert lps[0] is None and len(lps) == len(ids)
    for tok, entry in zip(ids[1:], lps[1:]):
        own = entry[str(tok)]
        assert own["logprob"] <= 0 and own["rank"] >= 1
        assert own["decoded_token"] == tokenizer.decode([tok], skip_special_tokens=False)
        assert {1, 2} <= {e["rank"] for e in entry.values()}      # the top 2, and the token
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=HELLO, stream=True,
                                       extra_body={"prompt_logprobs": 1})
    assert info.value.body["param"] == "prompt_logprobs"


def test_lm_eval_loglikelihood_request(client, model_name, tokenizer, smollm):
    """lm-eval's local-completions loglikelihood: a batch of token-id prompts (context +
    continuation), echo, max_tokens 0, logprobs 1. The logprob of each continuation, and
    whether greedy decoding would produce it, against a dense forward of our own."""
    import torch

    from gpu.layers.attention_dense import DenseCausalAttention

    pairs = [("The capital of France is", " Paris"), ("One, two, three,", " banana")]
    prompts, ctxlens = [], []
    for context, continuation in pairs:
        ctx_ids = tokenizer.encode(context)
        prompts.append(ctx_ids + tokenizer.encode(continuation))
        ctxlens.append(len(ctx_ids))
    r = client.completions.create(model=model_name, prompt=prompts, echo=True, max_tokens=0,
                                  logprobs=1, temperature=0)
    assert len(r.choices) == 2 and r.usage.completion_tokens == 0
    for choice, ids, ctxlen in zip(r.choices, prompts, ctxlens):
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(ids) and lp.token_logprobs[0] is None
        got = sum(lp.token_logprobs[ctxlen:])
        greedy = all(t == max(top.values()) for t, top in
                     zip(lp.token_logprobs[ctxlen:], lp.top_logprobs[ctxlen:]))
        with torch.inference_mode():
            hidden = smollm.model(torch.tensor(ids), torch.arange(len(ids)),
                                  DenseCausalAttention())
            ref = torch.log_softmax(smollm.model.compute_logits(hidden).float(), dim=-1)
        want = sum(ref[p - 1, ids[p]].item() for p in range(ctxlen, len(ids)))
        want_greedy = all(ref[p - 1].argmax().item() == ids[p] for p in range(ctxlen, len(ids)))
        assert got == pytest.approx(want, abs=5e-3)
        assert greedy == want_greedy
    assert r.choices[1].logprobs.token_logprobs[-1] < -5     # " banana" is unlikely there
