"""Harmony (gpt-oss) at the stage level: rendering a chat request to Harmony tokens, and
parsing Harmony tokens (made by openai-harmony's own encoder) to reasoning, content and
tool calls, streamed and not."""
from __future__ import annotations

import datetime
import itertools
import json
import random

import orjson
import pytest
from openai_harmony import (Author, Conversation, DeveloperContent, Message, ReasoningEffort,
                            RenderConversationConfig, Role, SystemContent, ToolDescription)

from gpu.tokenizers.harmony import harmony_encoding, uses_harmony
from stages.api.common import RequestError, ToolPlan, ToolSettings
from stages.delta import FinishReason
from stages.emit import framer_for
from stages.api.harmony import HarmonyState
from stages.messages import Submission
from stages.render import RenderContext, render, tokenize
from tests.support.harmony_turns import AUTO, call, completion, joined, parse, said

HARMONY = ToolSettings(True, "openai", True)       # what the engine implies for gpt-oss
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time"}}


@pytest.fixture(scope="module")
def enc():
    return harmony_encoding()


@pytest.fixture(scope="module")
def ctx():
    from gpu.tokenizers.harmony import harmony_tokenizer
    return RenderContext(tokenizer=harmony_tokenizer(), served_model_names=("gpt-oss",),
                         max_model_len=4096, reasoning=True, vocab_size=201088, tools=HARMONY,
                         harmony=True)


def chat(body: dict, ctx: RenderContext, api: str = "chat"):
    return render(Submission("r1", api, body, 0.0), ctx)


# -- the expected conversations, built with openai-harmony's own API ---------------------------

def system(effort=ReasoningEffort.MEDIUM) -> Message:
    return Message.from_role_and_content(Role.SYSTEM, SystemContent.new().with_reasoning_effort(
        effort).with_conversation_start_date(datetime.date.today().isoformat()))


def developer(instructions: str | None = None, tools: list[dict] | None = None) -> Message:
    dev = DeveloperContent.new()
    if instructions is not None:
        dev = dev.with_instructions(instructions)
    if tools:
        dev = dev.with_function_tools([ToolDescription.new(
            t["function"]["name"], t["function"].get("description", ""),
            parameters=t["function"].get("parameters")) for t in tools])
    return Message.from_role_and_content(Role.DEVELOPER, dev)


def user(text: str) -> Message:
    return Message.from_role_and_content(Role.USER, text)


def result(name: str, text: str) -> Message:
    return (Message.from_author_and_content(Author.new(Role.TOOL, f"functions.{name}"), text)
            .with_channel("commentary").with_recipient("assistant"))


def prompt_of(enc, *messages: Message) -> tuple[int, ...]:
    return tuple(enc.render_conversation_for_completion(
        Conversation.from_messages(list(messages)), Role.ASSISTANT,
        RenderConversationConfig(auto_drop_analysis=False)))


# -- rendering ---------------------------------------------------------------------------

def test_uses_harmony_reads_the_model_type():
    assert uses_harmony({"model_type": "gpt_oss"}) and not uses_harmony({"model_type": "llama"})
    assert not uses_harmony(object())


USER = [{"role": "user", "content": "What is the weather in Tokyo?"}]
SYS = [{"role": "system", "content": "Answer briefly."}]


@pytest.mark.parametrize("case", ["user only", "system, no tools", "system and tools",
                                  "tools, no system", "developer role"])
def test_the_four_prompt_shapes(enc, ctx, case):
    q = user("What is the weather in Tokyo?")
    body, want = {
        "user only": ({"messages": USER}, [system(), q]),
        "system, no tools": ({"messages": SYS + USER}, [system(), developer("Answer briefly."), q]),
        "system and tools": ({"messages": SYS + USER, "tools": [WEATHER, TIME]},
                             [system(), developer("Answer briefly.", [WEATHER, TIME]), q]),
        "tools, no system": ({"messages": USER, "tools": [WEATHER]},
                             [system(), developer(None, [WEATHER]), q]),
        "developer role": ({"messages": [{"role": "developer", "content": "Answer briefly."},
                                         *USER]}, [system(), developer("Answer briefly."), q]),
    }[case]
    req = chat(body, ctx)
    assert req.prompt_token_ids == prompt_of(enc, *want)
    text = enc.decode(list(req.prompt_token_ids))
    assert text.startswith("<|start|>system<|message|>") and text.endswith("<|start|>assistant")
    if "tools" in body:
        assert req.tools == ToolPlan("auto", parser="openai")
        assert "type get_weather = (_: {" in text


@pytest.mark.parametrize("effort", ["low", "medium", "high"])
def test_reasoning_effort_and_date_are_in_the_system_message(enc, ctx, effort):
    req = chat({"messages": USER, "reasoning_effort": effort}, ctx)
    want = {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM,
            "high": ReasoningEffort.HIGH}[effort]
    assert req.prompt_token_ids == prompt_of(enc, system(want), user(USER[0]["content"]))
    text = enc.decode(list(req.prompt_token_ids))
    assert f"Reasoning: {effort}" in text
    assert f"Current date: {datetime.date.today().isoformat()}" in text


def test_a_bad_reasoning_effort_is_a_400(ctx):
    with pytest.raises(RequestError) as info:
        chat({"messages": USER, "reasoning_effort": "extreme"}, ctx)
    assert info.value.status == 400 and info.value.param == "reasoning_effort"


ARGS = '{"city": "Tokyo"}'


def assistant_call(**extra) -> dict:
    return {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": ARGS}}], **extra}


@pytest.mark.parametrize("case", ["reasoning and content", "call", "preamble", "empty string",
                                  "empty list", "content only"])
def test_assistant_history(enc, ctx, case):
    turn, want = {
        "reasoning and content": ({"role": "assistant", "reasoning": "Think.", "content": "Hi."},
                                  [said("Think.", "analysis"), said("Hi.", "final")]),
        "call": (assistant_call(reasoning="Need weather."),
                 [said("Need weather.", "analysis"), call("get_weather", ARGS)]),
        "preamble": (assistant_call(content="Let me check."),
                     [said("Let me check.", "commentary"), call("get_weather", ARGS)]),
        "empty string": ({"role": "assistant", "reasoning": "Only thoughts.", "content": ""},
                         [said("Only thoughts.", "analysis")]),
        "empty list": ({"role": "assistant", "reasoning_content": "Only thoughts.",
                        "content": []}, [said("Only thoughts.", "analysis")]),
        "content only": ({"role": "assistant", "content": "Hello."}, [said("Hello.", "final")]),
    }[case]
    req = chat({"messages": [*USER, turn, {"role": "user", "content": "And?"}]}, ctx)
    assert req.prompt_token_ids == prompt_of(enc, system(), user(USER[0]["content"]), *want,
                                             user("And?"))


@pytest.mark.parametrize("content", ["20C", [{"type": "text", "text": "20"},
                                             {"type": "text", "text": "C"}]])
def test_tool_results_are_authored_by_the_function(enc, ctx, content):
    messages = [*USER, assistant_call(), {"role": "tool", "tool_call_id": "call_1",
                                          "content": content}]
    req = chat({"messages": messages, "tools": [WEATHER]}, ctx)
    text = "20C"      # text parts joined with nothing, as vLLM's Harmony path joins them
    assert req.prompt_token_ids == prompt_of(
        enc, system(), developer(None, [WEATHER]), user(USER[0]["content"]),
        call("get_weather", ARGS), result("get_weather", text))
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>" \
        in enc.decode(list(req.prompt_token_ids))


def test_tool_results_without_an_id_or_a_name_answer_the_calls_in_order(enc, ctx):
    """As vLLM accepts them: a result that names neither its call nor its function is
    the earliest unanswered call's; with no call at all, an unnamed function's."""
    two = {"role": "assistant", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}},
        {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}
    messages = [*USER, two, {"role": "tool", "content": "20C"},
                {"role": "tool", "tool_call_id": None, "content": "noon"}]
    req = chat({"messages": messages, "tools": [WEATHER]}, ctx)
    assert req.prompt_token_ids == prompt_of(
        enc, system(), developer(None, [WEATHER]), user(USER[0]["content"]),
        call("get_weather", ARGS), call("get_time", "{}"), result("get_weather", "20C"),
        result("get_time", "noon"))
    # a name answers its own call, leaving the other for the next result without one
    named = [*USER, two, {"role": "tool", "name": "get_time", "content": "noon"},
             {"role": "tool", "content": "20C"}]
    assert chat({"messages": named, "tools": [WEATHER]}, ctx).prompt_token_ids == prompt_of(
        enc, system(), developer(None, [WEATHER]), user(USER[0]["content"]),
        call("get_weather", ARGS), call("get_time", "{}"), result("get_time", "noon"),
        result("get_weather", "20C"))
    # no call to answer (an unknown id included): vLLM's unnamed `functions.`
    for orphan in ({"role": "tool", "tool_call_id": "nope", "content": "x"},
                   {"role": "tool", "content": "x"}):
        req = chat({"messages": [*USER, orphan]}, ctx)
        assert "<|start|>functions. to=assistant" in enc.decode(list(req.prompt_token_ids))


WEATHER_TURNS = [
    {"role": "user", "content": "Weather in Tokyo?"},
    {"role": "assistant", "reasoning": "I should call get_weather.", "content": "",
     "tool_calls": [{"id": "c1", "type": "function", "function": {
         "name": "get_weather", "arguments": '{"city": "Tokyo"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 20}'},
    {"role": "assistant", "content": "It is 20C in Tokyo."},
    {"role": "user", "content": "And Paris?"},
    {"role": "assistant", "reasoning": "Call it again for Paris.",
     "tool_calls": [{"id": "c2", "type": "function", "function": {
         "name": "get_weather", "arguments": '{"city":"Paris"}'}}]},   # kept as written
    {"role": "tool", "tool_call_id": "c2", "content": '{"temp": 15}'},
]


def test_the_four_turn_weather_conversation_renders_in_full(enc, ctx):
    req = chat({"messages": WEATHER_TURNS, "tools": [WEATHER]}, ctx)
    assert req.prompt_token_ids == prompt_of(
        enc, system(), developer(None, [WEATHER]), user("Weather in Tokyo?"),
        said("I should call get_weather.", "analysis"), call("get_weather", '{"city": "Tokyo"}'),
        result("get_weather", '{"temp": 20}'), said("It is 20C in Tokyo.", "final"),
        user("And Paris?"), said("Call it again for Paris.", "analysis"),
        call("get_weather", '{"city":"Paris"}'), result("get_weather", '{"temp": 15}'))
    text = enc.decode(list(req.prompt_token_ids))
    order = ["I should call get_weather.", '{"city": "Tokyo"}', '{"temp": 20}',
             "It is 20C in Tokyo.", "And Paris?", "Call it again for Paris.",
             '{"city":"Paris"}', '{"temp": 15}']
    at = [text.index(s) for s in order]
    assert at == sorted(at)


def test_tool_choice_none_drops_the_tools(enc, ctx):
    req = chat({"messages": USER, "tools": [WEATHER], "tool_choice": "none"}, ctx)
    assert req.prompt_token_ids == prompt_of(enc, system(), user(USER[0]["content"]))
    assert req.tools is None


def test_named_and_required_tool_choice_are_constrained(ctx):
    named = chat({"messages": USER, "tools": [WEATHER, TIME], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}}, ctx)
    assert named.tools == ToolPlan("named", name="get_weather")
    assert json.loads(named.sampling.constraint.spec) == WEATHER["function"]["parameters"]
    required = chat({"messages": USER, "tools": [WEATHER, TIME], "tool_choice": "required"}, ctx)
    assert required.tools.kind == "required" and required.sampling.constraint is not None


def test_kv_transfer_prompt_token_ids_are_reused_and_checked(enc, ctx):
    ids = list(prompt_of(enc, system(), user("hi")))
    req = chat({"messages": USER, "kv_transfer_params": {"prompt_token_ids": ids}}, ctx)
    assert req.prompt_token_ids == tuple(ids)
    for bad in ([201088], [], [-1], "x"):
        with pytest.raises(RequestError) as info:
            chat({"messages": USER, "kv_transfer_params": {"prompt_token_ids": bad}}, ctx)
        assert info.value.status == 400
        assert info.value.param == "kv_transfer_params.prompt_token_ids"


def test_tokenize_renders_harmony_too(enc, ctx):
    out = tokenize({"messages": USER}, ctx)
    assert tuple(out.tokens) == prompt_of(enc, system(), user(USER[0]["content"]))


def test_chat_template_and_continue_final_message_are_400s(ctx):
    for extra, param in (({"chat_template": "{{ x }}"}, "chat_template"),
                         ({"continue_final_message": True, "add_generation_prompt": False,
                           "messages": [*USER, {"role": "assistant", "content": "I"}]},
                          "continue_final_message")):
        with pytest.raises(RequestError) as info:
            chat({"messages": USER, **extra}, ctx)
        assert info.value.param == param


def test_responses_input_renders_through_harmony(enc, ctx):
    body = {"instructions": "Answer briefly.", "reasoning": {"effort": "high"},
            "tools": [{"type": "function", **WEATHER["function"]}],
            "input": [{"type": "message", "role": "user", "content": "Weather in Tokyo?"},
                      {"type": "function_call", "call_id": "c1", "name": "get_weather",
                       "arguments": '{"city": "Tokyo"}'},
                      {"type": "function_call_output", "call_id": "c1", "output": "20C"}]}
    req = chat(body, ctx, api="responses")
    assert req.prompt_token_ids == prompt_of(
        enc, system(ReasoningEffort.HIGH), developer("Answer briefly.", [WEATHER]),
        user("Weather in Tokyo?"), call("get_weather", '{"city": "Tokyo"}'),
        result("get_weather", "20C"))


# -- parsing -------------------------------------------------------------------------------

def splits(ids: list[int]):
    """All at once, one token at a time, and a few random cuts."""
    yield [ids]
    yield [[t] for t in ids]
    rng = random.Random(len(ids))
    for _ in range(3):
        cuts = sorted(rng.sample(range(1, len(ids)), min(4, len(ids) - 1)))
        yield [ids[a:b] for a, b in itertools.pairwise([0, *cuts, len(ids)])]


def test_analysis_is_reasoning_and_final_is_content(enc):
    ids = completion(enc, said("The user greets.", "analysis"), said("Hello there!", "final"))
    for pieces in splits(ids):
        assert joined(parse(pieces)[1]) == ("Hello there!", "The user greets.", [],
                                            FinishReason.STOP)


def test_reasoning_tokens_are_the_analysis_text_tokens_at_every_cut(enc):
    """Counted per token, so a delta of several tokens across analysis and final counts
    only its analysis text (not the headers, not the answer); the span is the delta's
    leading tokens that are no answer's (what include_reasoning false hides)."""
    analysis = enc.encode("The user greets.", allowed_special="all")
    ids = completion(enc, said("The user greets.", "analysis"), said("Hello there!", "final"))
    for pieces in splits(ids):
        deltas = parse(pieces)[1]
        assert sum(d.reasoning_tokens for d in deltas) == len(analysis)
        hidden = [t for p, d in zip(pieces, deltas) for t in p[:d.reasoning_span]]
        shown = [t for p, d in zip(pieces, deltas) for t in p[d.reasoning_span:]]
        assert enc.decode(shown).find("Hello there!") >= 0
        if len(pieces) == len(ids):          # one token a delta: exactly the analysis part
            assert enc.decode(hidden).find("The user greets.") >= 0
            assert "Hello" not in enc.decode(hidden)


def test_a_call_to_a_function_is_a_tool_call(enc):
    ids = completion(enc, said("Need the weather.", "analysis"),
                     said("Checking.", "commentary"), call("get_weather", '{"city":"Paris"}'))
    for pieces in splits(ids):
        _, deltas = parse(pieces, plan=AUTO)
        assert joined(deltas) == ("Checking.", "Need the weather.",
                                  [(0, "get_weather", '{"city":"Paris"}')],
                                  FinishReason.TOOL_CALLS)
        assert all(c.id.startswith("call_") for d in deltas for c in d.tool_calls)


def test_two_calls_and_parallel_false(enc):
    ids = completion(enc, call("get_weather", '{"city":"Paris"}'), call("get_time", "{}"))
    _, deltas = parse([ids], plan=AUTO)
    assert joined(deltas)[2] == [(0, "get_weather", '{"city":"Paris"}'), (1, "get_time", "{}")]
    _, deltas = parse([ids], plan=ToolPlan("auto", parser="openai", parallel=False))
    assert joined(deltas)[2] == [(0, "get_weather", '{"city":"Paris"}')]


def test_without_tools_a_call_is_not_made(enc):
    ids = completion(enc, call("get_weather", '{"city":"Paris"}'))
    content, _, calls, reason = joined(parse([ids])[1])
    assert calls == [] and reason is FinishReason.STOP and content == '{"city":"Paris"}'


def test_a_call_cut_by_max_tokens_is_not_made(enc):
    ids = completion(enc, call("get_weather", '{"city":"Paris"}'))[:-3]
    assert joined(parse([ids], plan=AUTO, finish=FinishReason.LENGTH)[1])[2:] == \
        ([], FinishReason.LENGTH)


def test_no_control_token_leaks(enc):
    ids = completion(enc, said("a <b> c", "analysis"), said("Preamble.", "commentary"),
                     call("get_weather", '{"city":"<|x|>"}'))
    for pieces in splits(ids):
        content, reasoning, calls, _ = joined(parse(pieces, plan=AUTO)[1])
        for text in (content, reasoning, *(n for _, n, _ in calls)):
            for special in enc.special_tokens_set:
                assert special not in text
        assert (content, reasoning) == ("Preamble.", "a <b> c")


def test_text_that_is_not_harmony_stays_content(enc):
    ids = enc.encode("plain words, no channels")
    for pieces in splits(ids):
        assert joined(parse(pieces)[1])[0] == "plain words, no channels"


def test_text_after_harmony_that_breaks_it_stays_content(enc):
    """After a message ends only <|start|> may follow; a model that writes on in plain text
    keeps that text as content (control tokens dropped), in every split."""
    ids = completion(enc, said("ok.", "final"), end="<|end|>") + enc.encode(" plain 東京🙂") + \
        enc.encode("<|end|>", allowed_special="all")
    for pieces in splits(ids):
        assert joined(parse(pieces)[1])[0] == "ok. plain 東京🙂"


def test_unicode_split_across_tokens(enc):
    ids = completion(enc, said("東京 🙂 Zürich", "final"))
    for pieces in splits(ids):
        assert joined(parse(pieces)[1])[0] == "東京 🙂 Zürich"


def test_named_tool_choice_reads_the_constrained_json():
    """...and finishes with stop, as vLLM and OpenAI do for a named tool_choice."""
    _, deltas = parse([[1], [2]], plan=ToolPlan("named", name="get_weather"),
                      text=['{"city":', '"Paris"}'])
    assert joined(deltas)[2:] == ([(0, "get_weather", '{"city":"Paris"}')],
                                  FinishReason.STOP)


def test_required_tool_choice_reads_the_constrained_array():
    text = ['[{"name":"get_weather","parameters":{"city":"Paris"}},', '{"name":"get_time",',
            '"parameters":{}}]']
    _, deltas = parse([[1], [2], [3]], plan=ToolPlan("required"), text=text)
    assert joined(deltas)[2:] == ([(0, "get_weather", '{"city": "Paris"}'),
                                   (1, "get_time", "{}")], FinishReason.TOOL_CALLS)


def framed(req, deltas) -> bytes:
    f = framer_for(req)
    return f.start() + b"".join(f.on_delta(d) for d in deltas)


def sse(raw: bytes) -> list[dict]:
    return [orjson.loads(b.split(b"data: ", 1)[1]) for b in raw.split(b"\n\n")
            if b"data: {" in b]


@pytest.mark.parametrize("include_reasoning", [True, False])
def test_chat_replies_stream_and_not_agree(enc, include_reasoning):
    ids = completion(enc, said("Think.", "analysis"), said("Checking.", "commentary"),
                     call("get_weather", '{"city":"Paris"}'))
    body = {"include_reasoning": include_reasoning, "tools": [WEATHER]}
    req, deltas = parse([ids], plan=AUTO, body=body)
    message = orjson.loads(framed(req, deltas))["choices"][0]
    assert message["finish_reason"] == "tool_calls"
    assert message["message"]["content"] == "Checking."
    assert message["message"].get("reasoning") == ("Think." if include_reasoning else None)
    [tc] = message["message"]["tool_calls"]
    assert tc["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}
    req, deltas = parse([[t] for t in ids], plan=AUTO, body=body, stream=True)
    chunks = [c["choices"][0] for c in sse(framed(req, deltas)) if c["choices"]]
    streamed = "".join(c["delta"].get("reasoning") or "" for c in chunks)
    assert streamed == ("Think." if include_reasoning else "")
    assert "".join(c["delta"].get("content") or "" for c in chunks) == "Checking."
    calls = [t for c in chunks for t in c["delta"].get("tool_calls") or ()]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"] == tc["id"]
    assert "".join(t["function"]["arguments"] for t in calls) == '{"city":"Paris"}'
    assert chunks[-1]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_responses_items_and_events(enc, stream):
    ids = completion(enc, said("Think.", "analysis"), said("It is sunny.", "final"))
    req, deltas = parse([[t] for t in ids] if stream else [ids], api="responses", stream=stream)
    out = framed(req, deltas)
    if stream:
        events = sse(out)
        types = [e["type"] for e in events]
        assert "response.reasoning_text.delta" in types
        assert "response.output_text.delta" in types
        assert types.index("response.reasoning_text.delta") < types.index(
            "response.output_text.delta")
        response = events[-1]["response"]
    else:
        response = orjson.loads(out)
    reasoning, message = response["output"]
    assert reasoning["type"] == "reasoning"
    assert reasoning["content"][0]["text"] == "Think."
    assert message["type"] == "message" and message["content"][0]["text"] == "It is sunny."
    ids = completion(enc, call("get_weather", '{"city":"Paris"}'))
    req, deltas = parse([[t] for t in ids] if stream else [ids], api="responses",
                        stream=stream, plan=AUTO,
                        body={"tools": [{"type": "function", "name": "get_weather"}]})
    out = framed(req, deltas)
    response = sse(out)[-1]["response"] if stream else orjson.loads(out)
    [fc] = response["output"]
    assert fc["type"] == "function_call" and fc["name"] == "get_weather"
    assert fc["arguments"] == '{"city":"Paris"}'
    if stream:
        types = [e["type"] for e in sse(out)]
        assert "response.function_call_arguments.done" in types


def test_state_alone_matches_openai_harmonys_own_parse(enc):
    """The parser agrees with openai-harmony's non-streaming parse of the same tokens."""
    msgs = [said("a", "analysis"), said("b", "commentary"), call("f", "{}")]
    ids = completion(enc, *msgs)
    parsed = enc.parse_messages_from_completion_tokens(ids, Role.ASSISTANT)
    assert [(m.channel, m.recipient, m.content[0].text) for m in parsed] == \
        [("analysis", None, "a"), ("commentary", None, "b"), ("commentary", "functions.f", "{}")]
    out = HarmonyState(AUTO).feed(ids, final=True)
    assert (out.reasoning, out.content, [(c.name, c.arguments) for c in out.calls]) == \
        ("a", "b", [("f", "{}")])
