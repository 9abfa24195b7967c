"""Issue 22: behaviours vLLM's own OpenAI-server tests expect, over HTTP with the official
openai client (SmolLM2; tools on the hermes server)."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]
# pydantic's shape for a nested model: a $ref into the parameters' own $defs
NESTED = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "options": {"$ref": "#/$defs/Options"}},
    "required": ["city", "options"], "additionalProperties": False,
    "$defs": {"Options": {"type": "object", "properties": {
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["unit"], "additionalProperties": False}}}
NESTED_TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                                  "parameters": NESTED}},
                {"type": "function", "function": {"name": "get_time", "parameters": {
                    "type": "object", "properties": {}}}}]
SCHEMAS = {"get_weather": NESTED, "get_time": {"type": "object"}}


# -- 1. tool schemas with $ref/$defs under tool_choice "required" ------------------------

def test_required_with_defs_in_chat(tools_client):
    r = tools_client.chat.completions.create(
        model="", messages=ASK, tools=NESTED_TOOLS, tool_choice="required", max_tokens=80,
        temperature=0, parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_with_defs_in_responses(tools_client):
    tools = [{"type": "function", "name": t["function"]["name"],
              "parameters": t["function"]["parameters"]} for t in NESTED_TOOLS]
    r = tools_client.responses.create(model="", input="Weather in Paris?", tools=tools,
                                      tool_choice="required", max_output_tokens=80,
                                      temperature=0, parallel_tool_calls=False)
    [call] = [item for item in r.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


# -- 3. a named tool call cut by max tokens is not a call --------------------------------

@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_call_cut_by_max_tokens_is_not_a_call(tools_client, tool_choice, stream):
    kwargs = dict(model="", messages=ASK, tools=NESTED_TOOLS, tool_choice=tool_choice,
                  max_completion_tokens=3, temperature=0)
    if not stream:
        choice = tools_client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "length"
        assert choice.message.tool_calls is None
        return
    reasons, calls = [], []
    for chunk in tools_client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            calls += c.delta.tool_calls or []
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert reasons == ["length"] and calls == []


# -- 2. Responses takes its own output back as input, reasoning items included ------------

def test_responses_output_replayed_as_input(reasoning_server):
    thinker = openai.OpenAI(base_url=reasoning_server.base_url, api_key="x", max_retries=0,
                            timeout=120)
    first = [{"role": "user", "content": "What is 2 + 2?"}]
    r = thinker.responses.create(model="thinker", input=first, max_output_tokens=6,
                                 temperature=0)
    assert any(item.type == "reasoning" for item in r.output)   # deepseek_r1: all reasoning
    then = [{"role": "user", "content": "And 3 + 3?"}]
    replayed = thinker.responses.create(model="thinker", input=first + r.output + then,
                                        max_output_tokens=2, temperature=0)
    # SmolLM2's template has no place for reasoning: the prompt is the one without it
    without = [item for item in r.output if item.type != "reasoning"]
    plain = thinker.responses.create(model="thinker", input=first + without + then,
                                     max_output_tokens=2, temperature=0)
    assert replayed.usage.input_tokens == plain.usage.input_tokens


# -- 4. GET /v1/models/{id} --------------------------------------------------------------

def test_models_retrieve(client, model_name):
    model = client.models.retrieve(model_name)
    assert model.id == model_name and model.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("org/no-such-model")


# -- 7. keys vLLM sends as null ----------------------------------------------------------

def test_null_keys_as_vllm_sends_them(client, model_name):
    chat = client.chat.completions.create(model=model_name, max_tokens=2,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert chat.prompt_logprobs is None and chat.prompt_token_ids is None
    assert chat.choices[0].token_ids is None
    cmpl = client.completions.create(model=model_name, prompt="Hi", max_tokens=2)
    choice = cmpl.choices[0]
    assert choice.prompt_logprobs is None and choice.prompt_token_ids is None
    assert choice.token_ids is None
    # asked for: the values
    cmpl = client.completions.create(model=model_name, prompt="Hi", max_tokens=2,
                                     extra_body={"return_token_ids": True,
                                                 "prompt_logprobs": 0})
    assert cmpl.choices[0].prompt_token_ids and cmpl.choices[0].prompt_logprobs[0] is None


# -- 6. completions logprobs: 0 names the sampled token ----------------------------------

@pytest.mark.parametrize("echo", [False, True])
def test_completions_logprobs_0_gives_the_sampled_token(client, model_name, echo):
    r = client.completions.create(model=model_name, prompt="The sky is", max_tokens=3,
                                  temperature=1.0, seed=3, logprobs=0, echo=echo)
    lp = r.choices[0].logprobs
    first = 1 if echo else 0          # echo: the prompt's first token has no logprob
    assert lp.top_logprobs[0] is None if echo else True
    for token, value, top in zip(lp.tokens[first:], lp.token_logprobs[first:],
                                 lp.top_logprobs[first:]):
        assert top == {token: value}
    r = client.completions.create(model=model_name, prompt="The sky is", max_tokens=4,
                                  temperature=1.0, seed=3, logprobs=1)
    lp = r.choices[0].logprobs
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == value and 1 <= len(top) <= 2


# -- 8. return_tokens_as_token_ids --------------------------------------------------------

def _is_id(token: str) -> bool:
    return token.startswith("token_id:") and token[len("token_id:"):].isdigit()


def test_return_tokens_as_token_ids(client, model_name, tokenizer):
    ids_on = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    chat = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=2, extra_body=ids_on)
    content = chat.choices[0].logprobs.content
    # each token names the id that was sampled; the text itself is unchanged
    assert [c.token for c in content] == [f"token_id:{t}" for t in chat.choices[0].token_ids]
    assert all(c.bytes == list(c.token.encode()) for c in content)
    assert all(_is_id(t.token) for c in content for t in c.top_logprobs)
    assert chat.choices[0].message.content == tokenizer.decode(chat.choices[0].token_ids)
    for stream in (False, True):
        r = client.completions.create(model=model_name, prompt="The sky is", max_tokens=3,
                                      temperature=0, logprobs=1, echo=not stream,
                                      stream=stream, extra_body=ids_on)
        lps = [c.choices[0].logprobs for c in r] if stream else [r.choices[0].logprobs]
        tokens = [t for lp in lps if lp for t in lp.tokens]
        assert tokens and all(_is_id(t) for t in tokens)
        assert all(_is_id(t) for lp in lps if lp for top in lp.top_logprobs if top
                   for t in top)
        if not stream:   # echo: the prompt's tokens first, by id too
            prompt = tokenizer.encode("The sky is")
            assert tokens[:len(prompt)] == [f"token_id:{t}" for t in prompt]
            offsets = lps[0].text_offset       # offsets count the rendered tokens
            assert offsets[1] - offsets[0] == len(tokens[0])


# -- 12. seeds and stop_token_ids out of range --------------------------------------------

@pytest.mark.parametrize("seed", [2 ** 63, -2 ** 63 - 1])
def test_seed_out_of_range_names_the_range(client, model_name, seed):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt="Hi", max_tokens=1, seed=seed)
    assert info.value.param == "seed" and "64-bit" in info.value.body["message"]


def test_out_of_vocabulary_stop_token_id_is_named(client, model_name):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, max_tokens=1,
                                       messages=[{"role": "user", "content": "Hi"}],
                                       extra_body={"stop_token_ids": [2, 10 ** 9]})
    assert info.value.param == "stop_token_ids"
    assert str(10 ** 9) in info.value.body["message"]


# -- 5. the metrics vLLM exports ---------------------------------------------------------

def _scrape(server) -> dict[tuple, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))):
            s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_vllms_request_and_step_metrics(server, client, model_name):
    before = _scrape(server)
    client.chat.completions.create(model=model_name, max_tokens=3, n=2, temperature=1.0,
                                   messages=[{"role": "user", "content": "Hi"}])
    after = _scrape(server)

    def grew(name: str) -> float:
        return after[name, ()] - before.get((name, ()), 0)

    assert grew("vllm:request_params_n_count") == 1 and grew("vllm:request_params_n_sum") == 2
    assert grew("vllm:request_params_max_tokens_sum") == 3
    assert grew("vllm:request_generation_tokens_sum") == 6
    assert grew("vllm:request_prompt_tokens_sum") > 0
    assert grew("vllm:request_inference_time_seconds_count") == 1
    assert grew("vllm:request_num_preemptions_count") == 1
    assert grew("vllm:iteration_tokens_total_count") >= 3      # a prefill, then decodes
    assert grew("vllm:iteration_tokens_total_sum") >= grew("vllm:request_prompt_tokens_sum")
    assert {dict(labels)["reason"] for name, labels in after
            if name == "vllm:num_requests_waiting_by_reason"} == {"capacity", "deferred"}
    # vLLM's iteration tokens: each choice's prompt (at its first token) plus the tokens out
    assert grew("vllm:iteration_tokens_total_sum") == 2 * grew("vllm:request_prompt_tokens_sum") + 6
    [info] = [dict(labels) for name, labels in after if name == "vllm:cache_config_info"]
    assert info["block_size"] == "16" and int(info["num_gpu_blocks"]) > 0
    blocks = int(info["num_gpu_blocks"])
    assert int(info["kv_cache_size_tokens"]) == blocks * 16
    max_len = client.models.list().data[0].model_extra["max_model_len"]
    assert float(info["kv_cache_max_concurrency"]) == pytest.approx(
        blocks / -(-max_len // 16), abs=0.01)


def test_vllms_metrics_counts(server, client, model_name):
    """vLLM's test_metrics_counts: 10 requests of 9 prompt tokens and 10 generated each
    add 190 to vllm:iteration_tokens_total's sum (prompt + generated, not the 180 tokens
    fed), 90 prompt and 100 generation tokens."""
    before = _scrape(server)
    client.completions.create(model=model_name, prompt=[list(range(100, 109))] * 10,
                              max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    after = _scrape(server)

    def grew(name: str) -> float:
        return after[name, ()] - before.get((name, ()), 0)

    assert grew("vllm:iteration_tokens_total_sum") == 190
    assert grew("vllm:prompt_tokens_total") == 90
    assert grew("vllm:generation_tokens_total") == 100


# -- 10. a custom role goes to the chat template -----------------------------------------

STRICT_TEMPLATE = ("{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
                   "{{ raise_exception('Unknown role: ' + m.role) }}{% endif %}"
                   "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                   "<|im_start|>assistant\n")


def test_custom_role_reaches_the_template(client, model_name):
    custom = [{"role": "my-custom-role", "content": "Hi"}]
    r = client.chat.completions.create(model=model_name, messages=custom, max_tokens=1)
    plain = client.chat.completions.create(model=model_name, max_tokens=1,
                                           messages=[{"role": "user", "content": "Hi"}])
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens   # the role's name is in it
    with pytest.raises(openai.BadRequestError) as info:     # a template that refuses it
        client.chat.completions.create(model=model_name, messages=custom, max_tokens=1,
                                       extra_body={"chat_template": STRICT_TEMPLATE})
    assert "Unknown role: my-custom-role" in info.value.body["message"]


def test_custom_role_has_no_place_in_harmony(gpt_oss_client):
    with pytest.raises(openai.BadRequestError) as info:
        gpt_oss_client.chat.completions.create(
            model="", max_tokens=1, messages=[{"role": "my-custom-role", "content": "Hi"}])
    assert info.value.param == "messages[0].role"


# -- 11. /invocations, --root-path, /tokenizer_info, /load, flags with underscores --------

@pytest.fixture(scope="module")
def prefixed_server(serve_with_flags, tmp_path_factory):
    """Flags as vLLM's users spell them too: underscores, a root path."""
    gen = serve_with_flags(tmp_path_factory.mktemp("e2e-prefixed-server"), "--root-path", "/llm",
                           "--enable_tokenizer_info_endpoint", "--max_model_len=512")
    yield next(gen)
    gen.close()


def test_root_path_and_vllms_extra_routes(prefixed_server):
    import httpx
    for base in ("/llm/v1", "/v1"):
        c = openai.OpenAI(base_url=prefixed_server.url + base, api_key="x", max_retries=0,
                          timeout=120)
        r = c.chat.completions.create(model="", max_tokens=2,
                                      messages=[{"role": "user", "content": "Hi"}])
        assert r.choices[0].finish_reason in ("stop", "length")
        assert c.models.list().data[0].max_model_len == 512      # --max_model_len=512
    with httpx.Client(base_url=prefixed_server.url, timeout=120) as http:
        for root in ("", "/llm"):
            r = http.post(f"{root}/invocations", json={"prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["object"] == "text_completion"
            r = http.post(f"{root}/invocations", json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
            assert r.status_code == 200 and r.json()["object"] == "chat.completion"
            assert http.get(f"{root}/load").json() == {"server_load": 0}
            info = http.get(f"{root}/tokenizer_info").json()
            assert info["tokenizer_class"] and "im_start" in info["chat_template"]
            assert info["model_max_length"] == 512


# -- 9. Responses include ["message.output_text.logprobs"] --------------------------------

def test_responses_output_text_logprobs(client, model_name):
    body = dict(model=model_name, input="Say hello.", max_output_tokens=5, temperature=0,
                include=["message.output_text.logprobs"], top_logprobs=2)
    r = client.responses.create(**body)
    [message] = [item for item in r.output if item.type == "message"]
    part = message.content[0]
    assert part.logprobs and "".join(lp.token for lp in part.logprobs) == part.text
    for lp in part.logprobs:
        assert lp.logprob <= 0 and lp.bytes == list(lp.token.encode())
        assert len(lp.top_logprobs) == 2 and lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob
    streamed, done = [], None
    for event in client.responses.create(stream=True, **body):
        if event.type == "response.output_text.delta":
            streamed += event.logprobs
        elif event.type == "response.output_text.done":
            done = event
    # (the same tokens; logprobs to float noise: the prompt now comes from the prefix cache)
    assert [lp.token for lp in streamed] == [lp.token for lp in part.logprobs]
    assert [lp.logprob for lp in streamed] == pytest.approx(
        [lp.logprob for lp in part.logprobs], abs=1e-3)
    assert [lp.token for lp in done.logprobs] == [lp.token for lp in part.logprobs]
    # not asked for: none; an include this server has nothing for is accepted
    plain = client.responses.create(model=model_name, input="Say hello.", max_output_tokens=3,
                                    include=["reasoning.encrypted_content"], top_logprobs=2)
    assert all(not p.logprobs for item in plain.output if item.type == "message"
               for p in item.content)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=model_name, input="x", include=["nonsense"])
    assert info.value.param == "include[0]"


# -- 10. issue 37: enable_response_messages, logprob_token_ids, --max-logprobs ------------

def test_enable_response_messages(client, model_name, tokenizer):
    """vLLM's test_enable_response_messages (it runs Qwen3; any model here too)."""
    body = dict(model=model_name, input="Hello?", max_output_tokens=6, temperature=0,
                extra_body={"enable_response_messages": True})
    r = client.responses.create(**body)
    assert r.status in ("completed", "incomplete")
    [inp], [out] = r.input_messages, r.output_messages
    assert inp["type"] == out["type"] == "raw_message_tokens"
    assert len(inp["message"]) > 10 and "Hello?" in inp["message"]
    assert len(inp["tokens"]) == r.usage.input_tokens and type(inp["tokens"][0]) is int
    assert tokenizer.encode(inp["message"]) == inp["tokens"]
    assert len(out["tokens"]) == r.usage.output_tokens and type(out["tokens"][0]) is int
    assert out["message"] == tokenizer.decode(out["tokens"])
    assert out["message"] == r.output_text
    # streamed: the terminal event's Response carries the same
    [final] = [e.response for e in client.responses.create(stream=True, **body)
               if e.type in ("response.completed", "response.incomplete")]
    assert (final.input_messages, final.output_messages) == (r.input_messages, r.output_messages)
    plain = client.responses.create(model=model_name, input="Hello?", max_output_tokens=2)
    assert "input_messages" not in plain.model_dump(exclude_unset=True)


def test_logprob_token_ids_and_max_logprobs(client, model_name, tokenizer):
    ids = tokenizer.encode(" Paris") + tokenizer.encode(" London")
    r = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "The capital of France?"}],
        max_tokens=3, temperature=0, logprobs=True, extra_body={"logprob_token_ids": ids})
    for entry in r.choices[0].logprobs.content:
        tops = [t.token for t in entry.top_logprobs]
        assert tops[0] == entry.token and tops[0] != tops[1]
        assert set(tops[1:]) | {entry.token} >= {tokenizer.decode([i]) for i in ids}
        assert entry.top_logprobs[0].logprob == entry.logprob
    # the default --max-logprobs (20): -1 is the whole vocabulary, over it (vLLM's words)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=[{"role": "user",
                                       "content": "x"}], logprobs=True, top_logprobs=-1)
    assert info.value.param == "top_logprobs"
    assert "Requested sample logprobs of 49152, which is greater than max allowed: 20" in str(
        info.value)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt="x", logprobs=1,
                                  extra_body={"logprob_token_ids": [49152]})
    assert info.value.param == "logprob_token_ids"
