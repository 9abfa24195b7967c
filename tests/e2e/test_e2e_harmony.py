"""gpt-oss over HTTP with the official `openai` client: Harmony rendering, reasoning,
content and tool calls, chat and Responses, streaming and not.

The server is real (engine + Hypercorn, in a thread) and serves the tiny dummy gpt-oss
(gpu/configs/gpt-oss-tiny); its forward is replaced (test support, below) by a runner
that writes scripted Harmony completions, made by openai-harmony's own encoder. The script
is chosen by the last user message, so each test asserts exactly what the parse stage and
framers make of them. (tests/e2e/test_e2e_gpt_oss.py runs the real forward.)
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
from openai_harmony import Message, Role

import pipeline.core.parts
import pipeline.core.startup
from gpu.models.registry import config_from_hf
from gpu.config.model import ModelConfig
from gpu.tokenizers.harmony import harmony_encoding
from gpu.loader.decoder import LoadedModel, load_model
from pipeline.tools.harness import ScriptedRunner

from tests.support.live_servers import threaded_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def said(text: str, channel: str) -> Message:
    return Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)


def call(name: str, args: str) -> Message:
    return (Message.from_role_and_content(Role.ASSISTANT, args).with_channel("commentary")
            .with_recipient(f"functions.{name}").with_content_type("<|constrain|>json"))


def completion(*messages: Message) -> list[int]:
    """The tokens a gpt-oss model writes after the prompt's `<|start|>assistant`."""
    enc = harmony_encoding()
    head = enc.encode("<|start|>assistant", allowed_special="all")
    ids = [t for m in messages for t in enc.render(m)][len(head):]
    end, ret = (enc.encode(t, allowed_special="all")[0] for t in ("<|end|>", "<|return|>"))
    return ids[:-1] + [ret] if ids[-1] == end else ids


SCRIPTS = {
    "hello": completion(said("The user says hello.", "analysis"), said("Hello! 👋", "final")),
    "weather": completion(said("I need the weather tool.", "analysis"),
                          said("Let me check.", "commentary"),
                          call("get_weather", '{"city":"Tokyo"}')),
    "after": completion(said("The tool said 20C.", "analysis"), said("It is 20C.", "final")),
}


class HarmonyScript(ScriptedRunner):
    """Test support: the GPU step writes SCRIPTS[last user message] token by token (and
    <|return|> after it), whatever the model would have written."""

    def __init__(self) -> None:
        super().__init__(self.token)
        self.enc = harmony_encoding()
        self.ret = self.enc.encode("<|return|>", allowed_special="all")[0]
        self.chosen: dict[str, list[int]] = {}
        self.prompts: list[str] = []

    def execute(self, plan):
        for ns in plan.new_seqs:
            prompt = self.enc.decode(list(ns.prompt_token_ids))
            self.prompts.append(prompt)
            last_user = prompt.rsplit("<|start|>user<|message|>", 1)[-1].split("<|end|>")[0]
            self.chosen[ns.seq_id] = SCRIPTS[last_user]
        return super().execute(plan)

    def token(self, seq_id: str, n: int) -> int:
        script = self.chosen[seq_id]
        return script[n] if n < len(script) else self.ret


CONFIG = Path(__file__).parents[2] / "gpu" / "configs" / "gpt-oss-tiny"


def gpt_oss_config() -> ModelConfig:
    return config_from_hf(json.loads((CONFIG / "config.json").read_text()))


def tiny_gpt_oss() -> LoadedModel:
    """The tiny dummy gpt-oss (random weights; the scripted runner stands in for its
    forward)."""
    return load_model(CONFIG, load_format="dummy", dtype="float32", progress=False)


@pytest.fixture(scope="module")
def server():
    runner = HarmonyScript()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline.core.startup, "ModelRunner", lambda *a, **k: runner)
        with threaded_server(tiny_gpt_oss(), max_model_len=4096) as srv:
            yield SimpleNamespace(url=srv.url, runner=runner)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)


def ask(text: str, **extra) -> dict:
    return {"model": "gpt-oss-tiny", "messages": [{"role": "user", "content": text}], **extra}


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_and_content(client, stream):
    if not stream:
        r = client.chat.completions.create(**ask("hello"))
        msg = r.choices[0].message
        assert msg.content == "Hello! 👋" and r.choices[0].finish_reason == "stop"
        assert msg.model_extra["reasoning"] == "The user says hello."
        assert r.usage.completion_tokens == len(SCRIPTS["hello"])
        return
    chunks = list(client.chat.completions.create(**ask("hello"), stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Hello! 👋"
    assert "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas) == \
        "The user says hello."
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_include_reasoning_false_drops_it(client, stream):
    body = ask("hello", extra_body={"include_reasoning": False})
    if not stream:
        msg = client.chat.completions.create(**body).choices[0].message
        assert msg.content == "Hello! 👋" and "reasoning" not in (msg.model_extra or {})
        return
    chunks = list(client.chat.completions.create(**body, stream=True))
    assert not any((c.choices[0].delta.model_extra or {}).get("reasoning")
                   for c in chunks if c.choices)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call(client, server, stream):
    body = ask("weather", tools=[WEATHER])
    if not stream:
        r = client.chat.completions.create(**body)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me check."
        assert choice.message.model_extra["reasoning"] == "I need the weather tool."
        [tc] = choice.message.tool_calls
        assert tc.function.name == "get_weather" and json.loads(tc.function.arguments) == {
            "city": "Tokyo"}
        assert tc.id.startswith("call_")
    else:
        chunks = list(client.chat.completions.create(**body, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        calls = [t for d in deltas for t in d.tool_calls or ()]
        assert calls[0].function.name == "get_weather"
        assert json.loads("".join(t.function.arguments or "" for t in calls)) == {"city": "Tokyo"}
        assert "".join(d.content or "" for d in deltas) == "Let me check."
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    prompt = server.runner.prompts[-1]
    assert "<|start|>developer<|message|># Tools" in prompt and "type get_weather" in prompt


def test_the_tool_result_goes_back_as_the_functions_message(client, server):
    first = client.chat.completions.create(**ask("weather", tools=[WEATHER])).choices[0].message
    messages = [{"role": "user", "content": "weather"},
                {"role": "assistant", "content": first.content,
                 "reasoning": first.model_extra["reasoning"],
                 "tool_calls": [tc.model_dump() for tc in first.tool_calls]},
                {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "20C"},
                {"role": "user", "content": "after"}]
    r = client.chat.completions.create(model="gpt-oss-tiny", messages=messages, tools=[WEATHER])
    assert r.choices[0].message.content == "It is 20C."
    prompt = server.runner.prompts[-1]
    want = ["<|channel|>analysis<|message|>I need the weather tool.<|end|>",
            "<|channel|>commentary<|message|>Let me check.<|end|>",
            '<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json'
            '<|message|>{"city":"Tokyo"}<|call|>',
            "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>20C<|end|>"]
    at = [prompt.index(w) for w in want]
    assert at == sorted(at)


@pytest.mark.parametrize("result", [{}, {"tool_call_id": None}, {"name": "get_weather"}],
                         ids=["neither", "null-id", "name-only"])
def test_a_tool_result_without_its_call_id_is_accepted(client, server, result):
    """As vLLM: a result naming neither its call nor its function answers the earliest
    unanswered call (here the only one)."""
    messages = [{"role": "user", "content": "weather"},
                {"role": "assistant", "content": "", "tool_calls": [{
                    "id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Tokyo"}'}}]},
                {"role": "tool", "content": "20C", **result},
                {"role": "user", "content": "after"}]
    r = client.chat.completions.create(model="gpt-oss-tiny", messages=messages, tools=[WEATHER])
    assert r.choices[0].message.content == "It is 20C."
    assert ("<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>20C"
            in server.runner.prompts[-1])


def test_tool_choice_none_leaves_the_tools_out(client, server):
    r = client.chat.completions.create(**ask("hello", tools=[WEATHER], tool_choice="none"))
    assert r.choices[0].message.content == "Hello! 👋"
    assert "# Tools" not in server.runner.prompts[-1]


def test_reasoning_effort_reaches_the_system_message(client, server):
    client.chat.completions.create(**ask("hello", reasoning_effort="high"))
    assert "Reasoning: high" in server.runner.prompts[-1]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**ask("hello", reasoning_effort="minimal"))


def test_kv_transfer_prompt_token_ids(client, server):
    enc = harmony_encoding()
    ids = enc.encode("<|start|>user<|message|>hello<|end|><|start|>assistant",
                     allowed_special="all")
    r = client.chat.completions.create(**ask("ignored", extra_body={
        "kv_transfer_params": {"prompt_token_ids": ids}}))
    assert r.choices[0].message.content == "Hello! 👋" and r.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**ask("hello", extra_body={
            "kv_transfer_params": {"prompt_token_ids": [10**7]}}))
    assert "kv_transfer_params.prompt_token_ids" in str(info.value)


@pytest.mark.parametrize("stream", [False, True])
def test_responses(client, stream):
    tools = [{"type": "function", **WEATHER["function"]}]
    if not stream:
        r = client.responses.create(model="gpt-oss-tiny", input="hello")
        reasoning, message = r.output
        assert reasoning.type == "reasoning" and reasoning.content[0].text == \
            "The user says hello."
        assert message.type == "message" and r.output_text == "Hello! 👋"
        r = client.responses.create(model="gpt-oss-tiny", input="weather", tools=tools)
        kinds = [o.type for o in r.output]
        assert kinds == ["reasoning", "message", "function_call"]
        fc = r.output[-1]
        assert fc.name == "get_weather" and json.loads(fc.arguments) == {"city": "Tokyo"}
        return
    events = list(client.responses.create(model="gpt-oss-tiny", input="weather", tools=tools,
                                          stream=True))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    for t in ("response.reasoning_text.delta", "response.output_text.delta",
              "response.function_call_arguments.done"):
        assert t in types
    done = events[-1].response
    assert [o.type for o in done.output] == ["reasoning", "message", "function_call"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        "Let me check."


SCRIPTS["named"] = harmony_encoding().encode('{"city":"Paris"}') + \
    harmony_encoding().encode("<|call|>", allowed_special="all")


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_is_constrained_json(client, stream):
    """The constraint compiles against the Harmony vocabulary; the JSON is the call."""
    body = ask("named", tools=[WEATHER], tool_choice={"type": "function",
                                                      "function": {"name": "get_weather"}})
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        # named: "stop", as vLLM ("tool_calls" is for auto/required); content null: docs/api.md
        assert choice.finish_reason == "stop" and choice.message.content is None
        [tc] = choice.message.tool_calls
    else:
        chunks = list(client.chat.completions.create(**body, stream=True))
        [tc] = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or ()
                if t.function.name]
        assert chunks[-1].choices[0].finish_reason == "stop"
    assert tc.function.name == "get_weather"


@pytest.mark.parametrize("flags, words", [
    ({"reasoning_parser": "qwen3"}, "gpt-oss models speak Harmony"),
    ({"tool_call_parser": "hermes"}, "gpt-oss models speak Harmony"),
])
def test_other_parsers_are_refused_for_gpt_oss(flags, words):
    from pipeline.core.config import EngineConfig
    with pytest.raises(ValueError, match=words):
        pipeline.core.parts.Parsers.of(EngineConfig(**flags), gpt_oss_config())


def test_harmony_parsers_are_implied_and_refused_elsewhere():
    from pipeline.core.config import EngineConfig
    implied = pipeline.core.parts.Parsers.of(EngineConfig(), gpt_oss_config())
    assert implied.harmony and implied.reasoning_parser == "openai_gptoss"
    assert implied.tools.tool_call_parser == "openai" and implied.tools.enable_auto_tool_choice
    assert implied.tools.exclude_tools_when_tool_choice_none
    same = pipeline.core.parts.Parsers.of(EngineConfig(
        reasoning_parser="openai_gptoss", tool_call_parser="openai",
        enable_auto_tool_choice=True), gpt_oss_config())
    assert same == implied
    for flags in ({"reasoning_parser": "openai_gptoss"}, {"tool_call_parser": "openai"}):
        with pytest.raises(ValueError, match="needs a gpt-oss model"):
            pipeline.core.parts.Parsers.of(EngineConfig(**flags), config_from_hf(
                {"model_type": "llama", "vocab_size": 64, "hidden_size": 16,
                 "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}))


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_does_not_match_header_words(client, stream):
    """stop "final" is the final channel's name in the header (<|channel|>final): no stop
    there; "says" is in the reasoning's content: a stop."""
    r = client.chat.completions.create(**ask("hello", stop=["final", "analysis"]))
    assert r.choices[0].message.content == "Hello! 👋" and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.model_extra["reasoning"] == "The user says hello."
    if stream:
        chunks = list(client.chat.completions.create(**ask("hello", stop=["final"]), stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello! 👋"
    r = client.chat.completions.create(**ask("hello", stop=["says"]))
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.content
