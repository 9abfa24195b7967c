"""Multi-LoRA serving (issue 33) over real HTTP with the openai client, on the bundled SmolLM2.

Three PEFT adapters are made here on SmolLM2's own weights (tests/support/lora_adapters.py: the
GGUF's weights as a transformers model, random nonzero B), of different ranks and targets.
The oracle is peft's merged model (W + scale * B A) run by transformers; base-model requests
on the LoRA server must answer exactly as the session's server without LoRA does.
"""
from __future__ import annotations

import concurrent.futures
import json
import os

import httpx
import openai
import pytest

from tests.support.lora_adapters import hf_from_ours, hf_greedy, make_adapter

N = 8    # greedy tokens per oracle check
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {          # name -> rank, targets, rslora
    "sql": (8, ["q_proj", "v_proj"], False),
    "poet": (16, ALL, True),
    "mlp": (32, ["gate_proj", "up_proj", "down_proj"], False),
}
PROMPTS = {"sql": "The capital of France is", "poet": "Once upon a time, there",
           "mlp": "def fibonacci(n):"}
BASE_PROMPTS = ["The best way to learn", "Water boils at"]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                           "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def lora(smollm, tmp_path_factory, serve_with_flags):
    """(server, oracles, tmp): the LoRA server, and per adapter its prompt's ids, greedy
    tokens and logprobs from the merged model; oracles["base"][name]: the base model's
    greedy tokens on that prompt; oracles["chat"]: poet's on ASK with TOOLS as the server
    renders them (its /tokenize)."""
    tmp = tmp_path_factory.mktemp("e2e-lora")
    tok = smollm.tokenizer
    hf = hf_from_ours(smollm.model)
    oracles = {"base": {}}
    poet = None
    for i, (name, (r, targets, rslora)) in enumerate(ADAPTERS.items()):
        ids = tok.encode(PROMPTS[name])
        merged = make_adapter(hf, tmp / name, r=r, targets=targets, use_rslora=rslora, seed=i,
                              std=0.04)
        oracles[name] = (ids, *hf_greedy(merged, ids, N))
        oracles["base"][name] = hf_greedy(hf, ids, N)[0]
        if name == "poet":
            poet = merged
        del merged
    del hf
    modules = ["sql=" + str(tmp / "sql"),
               json.dumps({"name": "poet", "path": str(tmp / "poet"), "base_model_name": "smol"}),
               "mlp=" + str(tmp / "mlp")]
    old = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    try:
        gen = serve_with_flags(tmp, "--enable-lora", "--max-loras", "3", "--max-lora-rank", "32",
                               "--max-cpu-loras", "4", "--enable-prompt-tokens-details",
                               "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                               "--lora-modules", *modules)
        server = next(gen)
    finally:
        if old is None:
            del os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]
        else:
            os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = old
    r = httpx.post(server.url + "/tokenize", json={"model": "poet", "messages": ASK, "tools": TOOLS})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    oracles["chat"] = (ids, *hf_greedy(poet, ids, N))
    del poet
    yield server, oracles, tmp
    gen.close()


@pytest.fixture(scope="module")
def lclient(lora):
    return openai.OpenAI(base_url=lora[0].base_url, api_key="x", max_retries=0, timeout=600)


def _complete(client, model, prompt, n=N, **extra):
    r = client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0,
                                  logprobs=1, extra_body={"return_token_ids": True,
                                                          "ignore_eos": True, **extra})
    c = r.choices[0]
    return r, c.model_extra["token_ids"], c.logprobs.token_logprobs


def test_three_adapters_and_base_in_one_batch_match_the_merged_models(lora, lclient, server,
                                                                     model_name, smollm):
    _, oracles, _ = lora
    tok = smollm.tokenizer
    jobs = [(name, oracles[name][0]) for name in ADAPTERS]
    jobs += [(model_name, tok.encode(p)) for p in BASE_PROMPTS]
    # the session's server, without LoRA (its client waits as long as a busy box needs)
    plain = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=600)
    with concurrent.futures.ThreadPoolExecutor(2 * len(jobs)) as pool:   # one batch, all at once
        mine = [pool.submit(_complete, lclient, *job) for job in jobs]
        theirs = [pool.submit(_complete, plain, model_name, prompt) for _, prompt in jobs]
        got = [f.result() for f in mine]
        without = [f.result()[1:] for f in theirs]
    for (name, _), (reply, ids, lps) in zip(jobs, got):
        assert reply.model == name
        if name in oracles:
            assert ids == oracles[name][1], name
            for a, b in zip(lps, oracles[name][2]):
                assert abs(a - b) < 2e-3, (name, lps, oracles[name][2])
    # the adapters really change what the model says (the server without LoRA differs): the
    # tokens of most, the logprobs of each (the MLP adapter keeps fibonacci's greedy tokens)
    changed = 0
    for name, (base_ids, base_lps) in zip(ADAPTERS, without):
        changed += base_ids != oracles[name][1]
        assert base_ids != oracles[name][1] or max(
            abs(a - b) for a, b in zip(base_lps, oracles[name][2])) > 0.05, name
    assert changed >= 2
    # base requests: exactly what the server without LoRA answers
    for (_, ids, lps), (want, want_lps) in zip(got[3:], without[3:]):
        assert ids == want
        assert max(abs(a - b) for a, b in zip(lps, want_lps)) < 1e-3


def test_chat_streaming_and_responses_select_the_adapter(lora, lclient, model_name):
    messages = [{"role": "user", "content": "Name a color."}]
    whole = lclient.chat.completions.create(model="poet", messages=messages, max_tokens=6,
                                            temperature=0)
    base = lclient.chat.completions.create(model=model_name, messages=messages, max_tokens=6,
                                           temperature=0)
    assert whole.model == "poet" and whole.choices[0].message.content != base.choices[0].message.content
    stream = lclient.chat.completions.create(model="poet", messages=messages, max_tokens=6,
                                             temperature=0, stream=True)
    chunks = list(stream)
    assert {c.model for c in chunks} == {"poet"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) \
        == whole.choices[0].message.content
    resp = lclient.responses.create(model="poet", input=messages, max_output_tokens=6, temperature=0)
    assert resp.model == "poet" and resp.output_text == whole.choices[0].message.content


def test_models_lists_adapters_and_tokenize_takes_their_names(lora, lclient, model_name):
    server, _, tmp = lora
    cards = {m.id: m for m in lclient.models.list().data}
    assert set(cards) == {model_name, "sql", "poet", "mlp"}
    assert cards["sql"].model_extra["root"] == str(tmp / "sql")
    assert cards["sql"].model_extra["parent"] == model_name
    assert cards["poet"].model_extra["parent"] == "smol"
    assert lclient.models.retrieve("mlp").id == "mlp"
    r = httpx.post(server.url + "/tokenize", json={"model": "sql", "prompt": "hi there"})
    assert r.status_code == 200 and r.json()["count"] > 0
    with pytest.raises(openai.NotFoundError):
        lclient.completions.create(model="nope", prompt="x", max_tokens=1)


def test_two_adapters_never_share_prefix_cache(lora, lclient, smollm):
    prompt = smollm.tokenizer.encode("A long shared prefix about the history of Rome. " * 6)

    def cached(model):
        r, _, _ = _complete(lclient, model, prompt, n=1)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("sql") == 0
    assert cached("sql") > 0          # the same adapter hits its own blocks
    assert cached("mlp") == 0         # another adapter does not
    assert cached("poet") == 0


def _metric(server, name: str) -> str:
    text = httpx.get(server.url + "/metrics").text
    return "\n".join(l for l in text.splitlines() if l.startswith(name))


def test_runtime_load_use_unload_reload(lora, lclient):
    server, oracles, tmp = lora
    url = server.url + "/v1/"
    missing = httpx.post(url + "load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp / "none")})
    assert missing.status_code == 404 and "No adapter" in missing.json()["error"]["message"]
    bad = tmp / "dora"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 8, "target_modules": ["q_proj"], "use_dora": True}))
    (bad / "adapter_model.safetensors").write_bytes(b"")
    r = httpx.post(url + "load_lora_adapter", json={"lora_name": "x", "lora_path": str(bad)})
    assert r.status_code == 400 and "DoRA" in r.json()["error"]["message"]
    r = httpx.post(url + "load_lora_adapter", json={"lora_name": "sql2", "lora_path": str(tmp / "sql")})
    assert r.status_code == 200, r.text
    dup = httpx.post(url + "load_lora_adapter", json={"lora_name": "sql2", "lora_path": str(tmp / "sql")})
    assert dup.status_code == 400 and "already been loaded" in dup.json()["error"]["message"]
    ids, want, _ = oracles["sql"]
    assert _complete(lclient, "sql2", ids)[1] == want

    # unloading under a running request: it runs to its end on the adapter
    stream = lclient.completions.create(model="sql2", prompt=ids, max_tokens=48, temperature=0,
                                        stream=True, extra_body={"ignore_eos": True,
                                                                 "return_token_ids": True})
    it = iter(stream)
    first = next(it)
    r = httpx.post(url + "unload_lora_adapter", json={"lora_name": "sql2"})
    assert r.status_code == 200, r.text
    rest = list(it)
    tokens = [t for c in [first, *rest] if c.choices for t in c.choices[0].model_extra.get("token_ids") or []]
    assert len(tokens) == 48 and tokens[:N] == want
    assert rest[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError):
        lclient.completions.create(model="sql2", prompt=ids, max_tokens=1)
    again = httpx.post(url + "unload_lora_adapter", json={"lora_name": "sql2"})
    assert again.status_code == 404
    assert "sql2" not in {m.id for m in lclient.models.list().data}
    # reloaded under the same name: served again, same answers
    r = httpx.post(url + "load_lora_adapter", json={"lora_name": "sql2", "lora_path": str(tmp / "sql")})
    assert r.status_code == 200
    assert _complete(lclient, "sql2", ids)[1] == want
    assert httpx.post(url + "unload_lora_adapter", json={"lora_name": "sql2"}).status_code == 200
    # nothing left behind: no request running, no adapter in use, no block held
    info = _metric(server, "vllm:lora_requests_info")
    assert 'running_lora_adapters=""' in info and 'max_lora="3"' in info
    assert _metric(server, "vllm:num_requests_running").endswith(" 0.0")
    assert _metric(server, "vllm:kv_cache_usage_perc").endswith(" 0.0")


def test_langchain_selects_an_adapter(lora, lclient):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="mlp", base_url=lora[0].base_url, api_key="x", temperature=0,
                     max_tokens=6, max_retries=0, timeout=600)
    messages = [{"role": "user", "content": "Say something."}]
    want = lclient.chat.completions.create(model="mlp", messages=messages, max_tokens=6, temperature=0)
    got = llm.invoke([("user", "Say something.")])
    assert got.content == want.choices[0].message.content
    assert got.response_metadata["model_name"] == "mlp"


def test_auto_tool_choice_and_chat_logprobs_follow_the_merged_model(lora, lclient):
    """Chat with tools (auto, hermes): the rendered prompt (tools included) through the
    adapter gives the merged model's greedy tokens and logprobs; top_logprobs rank them."""
    _, oracles, _ = lora
    ids, want, want_lps = oracles["chat"]
    r = lclient.chat.completions.create(
        model="poet", messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=N, temperature=0,
        logprobs=True, top_logprobs=2, extra_body={"return_token_ids": True, "ignore_eos": True})
    assert r.model == "poet" and r.model_extra["prompt_token_ids"] == ids
    c = r.choices[0]
    assert c.model_extra["token_ids"] == want
    assert c.finish_reason == "length" and c.message.content and not c.message.tool_calls
    got = c.logprobs.content
    assert len(got) == N
    for t, lp in zip(got, want_lps):
        assert abs(t.logprob - lp) < 2e-3, ([t.logprob for t in got], want_lps)
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == t.logprob
        assert t.top_logprobs[1].logprob <= t.logprob


def test_named_tool_choice_on_an_adapter_streams_the_same_call(lora, lclient):
    import jsonschema

    body = dict(model="mlp", messages=ASK, tools=TOOLS, max_tokens=40, temperature=0,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = lclient.chat.completions.create(**body)
    assert whole.model == "mlp"
    [call] = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    args = ""
    for chunk in lclient.chat.completions.create(**body, stream=True):
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                args += d.function.arguments or ""
    assert args == call.function.arguments


def test_structured_outputs_take_the_adapter_greedy_path(lora, lclient, model_name, smollm):
    """A choice between the adapter's greedy text and the base model's: each model, masked to
    the two, follows its own argmax, so the adapter answers its merged model's text."""
    _, oracles, _ = lora
    tok = smollm.tokenizer
    picked = 0
    for name in ADAPTERS:
        ids, want, _ = oracles[name]
        a, b = tok.decode(want), tok.decode(oracles["base"][name])
        if a.startswith(b) or b.startswith(a):
            continue
        picked += 1
        for model, expect in ((name, a), (model_name, b)):
            r = lclient.completions.create(model=model, prompt=ids, max_tokens=N + 8, temperature=0,
                                           extra_body={"structured_outputs": {"choice": [a, b]}})
            assert r.choices[0].text == expect, (model, a, b)
    assert picked >= 1


def test_n2_seeded_json_schema_choices_equal_single_requests(lora, lclient):
    """n=2 with a seed on an adapter, under a json_schema: choice i is the one-choice request
    with seed + i (docs/api.md), each valid against the schema."""
    import jsonschema

    schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 6}},
              "required": ["word"], "additionalProperties": False}
    body = dict(model="sql", messages=[{"role": "user", "content": "Give a word as JSON."}],
                max_tokens=48, temperature=1.0,
                response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}})
    both = lclient.chat.completions.create(**body, n=2, seed=5)
    assert both.model == "sql" and len(both.choices) == 2
    singles = [lclient.chat.completions.create(**body, seed=5 + i).choices[0].message.content
               for i in range(2)]
    assert [c.message.content for c in sorted(both.choices, key=lambda c: c.index)] == singles
    for text in singles:
        jsonschema.validate(json.loads(text), schema)
