"""Chat behaviours vLLM's chat-serving tests check (issue 22, first half), over real HTTP
with the official openai client: the reasoning parser reading the prompt, assistant
history parts, usage options, include_reasoning false, n > 1 with tools, metrics and
kv_transfer_params.prompt_token_ids.

The server is real (engine + Hypercorn, in a thread) and serves SmolLM2 whose forward
is replaced (test support, below) by a runner that writes scripted completions, chosen
by a keyword of the last user message and by the choice, so each test asserts exactly
what parse, account and the framers make of a known output. Every sampled token gets a
logprob of -0.25.
"""
from __future__ import annotations

from types import SimpleNamespace

import attrs
import httpx
import openai
import pytest

import pipeline.core.startup
from gpu.interface import TokenLogprobs
from pipeline.tools.harness import ScriptedRunner

from tests.support.live_servers import threaded_server

# keyword of the last user message -> each choice's completion (choice i: SCRIPTS[k][i])
SCRIPTS = {
    "THINK": ["plan</think>answer", "other</think>reply"],
    "TOOL": ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
             "Let me see about the weather in Paris for a long while. " * 4],
    "PLAIN": [" hello there my good friend, how are you"],
}
EOS = 2
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n")
OPENS = TEMPLATE + "<think>\n{% endif %}"                   # Qwen3 thinking, DeepSeek-R1
CLOSES = TEMPLATE + "<think>\n\n</think>\n\n{% endif %}"    # Qwen3 with thinking off
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


class Script(ScriptedRunner):
    """Test support: the GPU step writes the script its prompt's keyword picks, token by
    token, then EOS."""

    def __init__(self, tokenizer) -> None:
        super().__init__(self.token)
        self.tok = tokenizer
        self.chosen: dict[str, list[int]] = {}
        self.prompts: list[str] = []

    def execute(self, plan, staged=None):
        for ns in plan.new_seqs:
            prompt = self.tok.decode(list(ns.prompt_token_ids), skip_special_tokens=False)
            self.prompts.append(prompt)
            last_user = prompt.rsplit("user\n", 1)[-1]
            key = next(k for k in SCRIPTS if k in last_user)
            choices = SCRIPTS[key]
            index = int(ns.seq_id.rsplit("#", 1)[1]) if "#" in ns.seq_id else 0
            self.chosen[ns.seq_id] = self.tok.encode(choices[index % len(choices)],
                                                     add_special_tokens=False)
        out = super().execute(plan)
        return attrs.evolve(out, logprobs=tuple(TokenLogprobs(-0.25, (t,), (-0.25,))
                                                for t in out.token_ids))

    def token(self, seq_id: str, n: int) -> int:
        script = self.chosen[seq_id]
        return script[n] if n < len(script) else EOS


@pytest.fixture(scope="module")
def servers(smollm):
    """One server per reasoning parser, each with hermes tools and per-request metrics."""
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        stack = []
        try:
            for parser in ("qwen3", "deepseek_r1"):
                runner = Script(smollm.tokenizer)
                mp.setattr(pipeline.core.startup, "ModelRunner", lambda *a, _r=runner, **k: _r)
                cm = threaded_server(smollm, max_model_len=1024, reasoning_parser=parser,
                                     enable_auto_tool_choice=True, tool_call_parser="hermes",
                                     enable_per_request_metrics=True)
                srv = cm.__enter__()
                stack.append(cm)
                out[parser] = SimpleNamespace(
                    url=srv.url, runner=runner, tok=smollm.tokenizer,
                    client=openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x",
                                         max_retries=0, timeout=120))
            yield out
        finally:
            for cm in reversed(stack):
                cm.__exit__(None, None, None)


@pytest.fixture(scope="module")
def qwen3(servers):
    return servers["qwen3"]


def ask(text: str, **extra) -> dict:
    return {"model": "", "messages": [{"role": "user", "content": text}], **extra}


def streamed(chunks) -> dict[int, dict]:
    """Per choice: its content, reasoning, finish_reason, tool calls, logprobs, ids."""
    out: dict[int, dict] = {}
    for c in chunks:
        for ch in c.choices:
            o = out.setdefault(ch.index, {"content": "", "reasoning": "", "finish": None,
                                          "calls": [], "logprobs": [], "ids": []})
            o["content"] += ch.delta.content or ""
            o["reasoning"] += (ch.delta.model_extra or {}).get("reasoning") or ""
            o["finish"] = ch.finish_reason or o["finish"]
            for tc in ch.delta.tool_calls or ():
                if tc.function.name:
                    o["calls"].append([tc.function.name, ""])
                o["calls"][-1][1] += tc.function.arguments or ""
            if ch.logprobs is not None and ch.logprobs.content:
                o["logprobs"] += [t.token for t in ch.logprobs.content]
            o["ids"] += (ch.model_extra or {}).get("token_ids") or []
    return out


# -- the reasoning parser reads the prompt ----------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_a_template_that_opens_think_starts_the_output_in_reasoning(servers, parser, stream):
    """Each choice's parser gets the prompt: the template opened <think>, so the output
    is reasoning until </think>, and no literal </think> reaches the content."""
    s = servers[parser]
    r = s.client.chat.completions.create(**ask("THINK", n=2, stream=stream,
                                               extra_body={"chat_template": OPENS}))
    if stream:
        got = streamed(r)
        pairs = [(got[i]["reasoning"], got[i]["content"]) for i in (0, 1)]
    else:
        pairs = [(c.message.model_extra.get("reasoning"), c.message.content)
                 for c in r.choices]
    assert pairs == [("plan", "answer"), ("other", "reply")]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_a_template_that_closed_think_makes_the_output_content(servers, parser, stream):
    s = servers[parser]
    r = s.client.chat.completions.create(**ask("THINK", stream=stream,
                                               extra_body={"chat_template": CLOSES}))
    if stream:
        got = streamed(r)[0]
        assert (got["reasoning"], got["content"]) == ("", "plan</think>answer")
    else:
        m = r.choices[0].message
        assert (m.model_extra.get("reasoning"), m.content) == (None, "plan</think>answer")
        assert r.usage.completion_tokens_details.reasoning_tokens == 0


def test_without_a_tag_in_the_prompt_each_parser_keeps_its_start(servers):
    """qwen3 starts in content; deepseek_r1 in reasoning (R1 may write no opening tag)."""
    q = servers["qwen3"].client.chat.completions.create(**ask("THINK", extra_body={
        "chat_template": TEMPLATE + "{% endif %}"})).choices[0].message
    r1 = servers["deepseek_r1"].client.chat.completions.create(**ask("THINK", extra_body={
        "chat_template": TEMPLATE + "{% endif %}"})).choices[0].message
    assert q.content == "plan</think>answer"
    assert (r1.model_extra.get("reasoning"), r1.content) == ("plan", "answer")


# -- usage options ------------------------------------------------------------------------------

def test_continuous_usage_stats_alone_turns_on_no_usage(qwen3):
    """As vLLM: continuous_usage_stats only adds to include_usage (chat and completions)."""
    chunks = list(qwen3.client.chat.completions.create(**ask(
        "PLAIN", max_tokens=4, stream=True, stream_options={"continuous_usage_stats": True})))
    assert chunks and all(c.usage is None for c in chunks)
    for options in ({"continuous_usage_stats": True},
                    {"include_usage": False, "continuous_usage_stats": True}):
        chunks = list(qwen3.client.completions.create(
            model="", prompt="PLAIN", max_tokens=4, stream=True, stream_options=options))
        assert chunks and all(c.usage is None for c in chunks)
    both = list(qwen3.client.completions.create(
        model="", prompt="PLAIN", max_tokens=4, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in both)


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_continuous_usage_of_n_choices_is_each_choice_own(qwen3, api):
    """As vLLM: with n > 1 each chunk's usage has its own choice's completion tokens so far
    (counted here from the chunks' token ids); the final usage chunk the request's."""
    common = dict(model="", max_tokens=5, n=2, temperature=1.0, seed=3, stream=True,
                  stream_options={"include_usage": True, "continuous_usage_stats": True},
                  extra_body={"return_token_ids": True, "ignore_eos": True})
    if api == "chat":
        chunks = list(qwen3.client.chat.completions.create(
            messages=[{"role": "user", "content": "PLAIN"}], **common))
    else:
        chunks = list(qwen3.client.completions.create(prompt="PLAIN", **common))
    seen = {0: 0, 1: 0}
    for c in chunks[:-1]:
        for ch in c.choices:
            seen[ch.index] += len((ch.model_extra or {}).get("token_ids") or ())
            assert c.usage.completion_tokens == seen[ch.index], (c, seen)
    assert seen == {0: 5, 1: 5}
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == 10


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_running_reasoning_tokens_grow_as_the_reasoning_streams(servers, parser):
    s = servers[parser]
    chunks = list(s.client.chat.completions.create(**ask(
        "THINK", stream=True, extra_body={"chat_template": OPENS},
        stream_options={"include_usage": True, "continuous_usage_stats": True})))
    counts = [c.usage.completion_tokens_details.reasoning_tokens for c in chunks]
    assert counts == sorted(counts)
    # the first reasoning token is counted on its own chunk, long before the choice ends
    first = next(i for i, c in enumerate(chunks) if c.choices
                 and (c.choices[0].delta.model_extra or {}).get("reasoning"))
    assert counts[first] == 1
    final = chunks[-1].usage
    assert 0 < final.completion_tokens_details.reasoning_tokens < final.completion_tokens


# -- include_reasoning false ----------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_include_reasoning_false_hides_its_text_ids_and_logprobs(qwen3, stream):
    """As vLLM (hide_stream_metadata / suppress_metadata): with a parser on, include_reasoning
    false sends no logprobs and no token ids at all, the answer's too; the prompt's ids and
    the usage's reasoning count stay."""
    r = qwen3.client.chat.completions.create(**ask(
        "THINK", stream=stream, logprobs=True,
        extra_body={"chat_template": OPENS, "include_reasoning": False,
                    "return_token_ids": True},
        **({"stream_options": {"include_usage": True}} if stream else {})))
    if stream:
        chunks = list(r)
        got = streamed(chunks)[0]
        reasoning, content = got["reasoning"], got["content"]
        assert got["ids"] == [] and got["logprobs"] == []
        assert all(ch.logprobs is None and "token_ids" not in (ch.model_extra or {})
                   for c in chunks for ch in c.choices)
        prompt_ids, usage = chunks[0].model_extra["prompt_token_ids"], chunks[-1].usage
    else:
        c = r.choices[0]
        reasoning, content = c.message.model_extra.get("reasoning"), c.message.content
        assert c.model_extra["token_ids"] is None and c.logprobs is None
        prompt_ids, usage = r.model_extra["prompt_token_ids"], r.usage
    assert not reasoning and content == "answer"
    assert prompt_ids and usage.completion_tokens_details.reasoning_tokens > 0


# -- assistant history parts --------------------------------------------------------------------

REPLAYED = [{"role": "user", "content": "Do a bad thing."},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "That is not allowed.", "closed": True},
                {"type": "refusal", "refusal": "I can't help with that."}]},
            {"role": "user", "content": "PLAIN"}]


def test_refusal_and_thinking_parts_are_accepted_in_history(qwen3):
    r = qwen3.client.chat.completions.create(model="", messages=REPLAYED, max_tokens=3)
    assert r.choices[0].finish_reason == "length"
    prompt = qwen3.runner.prompts[-1]
    assert "I can't help with that." in prompt and "That is not allowed." not in prompt
    # text-only parts: kv_transfer_params.prompt_token_ids are still the prompt
    ids = qwen3.tok.encode("PLAIN", add_special_tokens=False)
    r = qwen3.client.chat.completions.create(
        model="", messages=REPLAYED, max_tokens=3,
        extra_body={"kv_transfer_params": {"prompt_token_ids": ids}})
    assert r.usage.prompt_tokens == len(ids)


# -- n > 1: metrics, tools ------------------------------------------------------------------------

def test_no_per_request_metrics_when_n_is_above_one(qwen3):
    one = qwen3.client.chat.completions.create(**ask("PLAIN", max_tokens=3))
    assert one.model_extra["metrics"]["time_to_first_token_ms"] >= 0
    two = qwen3.client.chat.completions.create(**ask("PLAIN", max_tokens=3, n=2))
    assert "metrics" not in two.model_extra
    chunks = list(qwen3.client.chat.completions.create(**ask(
        "PLAIN", max_tokens=3, n=2, stream=True, stream_options={"include_usage": True})))
    assert all("metrics" not in (c.model_extra or {}) for c in chunks)


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_each_parse_their_own_tool_calls(qwen3, stream):
    """Choice 0 makes a call and ends with tool_calls; choice 1 talks until max_tokens and
    ends with length: each choice has its own tool parser and finish_reason."""
    r = qwen3.client.chat.completions.create(**ask("TOOL", n=2, max_tokens=40, tools=[WEATHER],
                                                   stream=stream))
    if stream:
        got = streamed(r)
        assert got[0]["calls"] == [["get_weather", '{"city": "Paris"}']]
        assert (got[0]["finish"], got[1]["finish"]) == ("tool_calls", "length")
        assert got[1]["calls"] == [] and got[1]["content"].startswith("Let me see")
    else:
        c0, c1 = r.choices
        assert [(t.function.name, t.function.arguments) for t in c0.message.tool_calls] == [
            ("get_weather", '{"city": "Paris"}')]
        assert (c0.finish_reason, c1.finish_reason) == ("tool_calls", "length")
        assert not c1.message.tool_calls and c1.message.content.startswith("Let me see")


def test_the_logprobs_of_tokens_a_tool_parser_swallows_are_still_streamed(qwen3):
    chunks = list(qwen3.client.chat.completions.create(**ask(
        "TOOL", tools=[WEATHER], logprobs=True, stream=True,
        stream_options={"include_usage": True})))
    got = streamed(chunks)[0]
    assert got["calls"] and got["content"].strip() == ""
    # one logprob for every generated token, the call's own tokens included
    assert len(got["logprobs"]) == chunks[-1].usage.completion_tokens
    assert "".join(got["logprobs"]).startswith("<tool_call>")


# -- kv_transfer_params.prompt_token_ids -------------------------------------------------------------

def test_echo_ignores_kv_transfer_prompt_token_ids(qwen3):
    messages = [{"role": "user", "content": "PLAIN"}, {"role": "assistant", "content": "Sure"}]
    plain = qwen3.client.chat.completions.create(model="", messages=messages, max_tokens=2,
                                                 extra_body={"echo": True})
    r = qwen3.client.chat.completions.create(
        model="", messages=messages, max_tokens=2,
        extra_body={"echo": True, "kv_transfer_params": {"prompt_token_ids": [5, 6, 7]}})
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens != 3
    assert r.choices[0].message.content.startswith("Sure")


@pytest.mark.parametrize("ids", [[1.0], [True], ["1"], 5], ids=repr)
def test_bad_kv_transfer_prompt_token_ids_are_400(qwen3, ids):
    with pytest.raises(openai.BadRequestError) as info:
        qwen3.client.chat.completions.create(
            **ask("PLAIN", max_tokens=2, extra_body={"kv_transfer_params": {
                "prompt_token_ids": ids}}))
    assert info.value.body["param"] == "kv_transfer_params.prompt_token_ids"


# -- X-data-parallel-rank ---------------------------------------------------------------------------

def test_data_parallel_rank_is_accepted_and_ignored_with_one_engine(qwen3):
    for rank in ("0", "3"):
        r = httpx.post(f"{qwen3.url}/v1/chat/completions", timeout=120,
                       headers={"X-data-parallel-rank": rank},
                       json=ask("PLAIN", max_tokens=2))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
