"""The tiny dummy gpt-oss served end to end (`tailrace serve gpu/configs/gpt-oss-tiny
--load-format dummy`, the GptOss forward on random weights) with the official client:
chat with tools, Responses, streaming. Random weights write no sensible Harmony, so these
check the whole path and the agreements that hold for any output (streamed = not
streamed, greedy); tests/e2e/test_e2e_harmony.py checks the parsing of scripted Harmony."""
from __future__ import annotations

import json

import jsonschema
import pytest

CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
        "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": CITY}}]
ASK = [{"role": "system", "content": "Be brief."},
       {"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = dict(model="gpt-oss-tiny", temperature=0, max_tokens=24)


def joined_stream(chunks) -> tuple:
    """(content, reasoning, finish_reason, [(name, arguments)]) of a streamed reply."""
    chunks = [c for c in chunks if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    calls: dict[int, list[str]] = {}
    for t in (t for d in deltas for t in d.tool_calls or ()):
        name, args = calls.setdefault(t.index, ["", ""])
        calls[t.index] = [name + (t.function.name or ""), args + (t.function.arguments or "")]
    return ("".join(d.content or "" for d in deltas),
            "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas),
            chunks[-1].choices[0].finish_reason, [tuple(calls[i]) for i in sorted(calls)])


def test_chat_with_tools_streamed_and_not_agree(gpt_oss_client):
    r = gpt_oss_client.chat.completions.create(messages=ASK, tools=TOOLS, **GREEDY)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.completion_tokens <= 24 and r.usage.prompt_tokens > 50   # Harmony system
    msg = choice.message
    streamed = joined_stream(gpt_oss_client.chat.completions.create(
        messages=ASK, tools=TOOLS, stream=True, **GREEDY))
    assert streamed == (msg.content or "", (msg.model_extra or {}).get("reasoning") or "",
                        choice.finish_reason,
                        [(t.function.name, t.function.arguments) for t in msg.tool_calls or ()])


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_makes_a_valid_call(gpt_oss_client, stream):
    """Constrained decoding on the real model: whatever the weights, the call is valid."""
    body = dict(messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {
        "name": "get_weather"}}, **{**GREEDY, "max_tokens": 40})
    if stream:
        chunks = list(gpt_oss_client.chat.completions.create(stream=True, **body))
        calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or ()]
        name = calls[0].function.name
        args = "".join(t.function.arguments or "" for t in calls)
        reason = [c for c in chunks if c.choices][-1].choices[0].finish_reason
    else:
        choice = gpt_oss_client.chat.completions.create(**body).choices[0]
        [call] = choice.message.tool_calls
        name, args, reason = call.function.name, call.function.arguments, choice.finish_reason
    # a named tool_choice finishes "stop", as vLLM's ("tool_calls" is for auto/required)
    assert name == "get_weather" and reason == "stop"
    jsonschema.validate(json.loads(args), CITY)


def test_responses_streamed_and_not_agree(gpt_oss_client):
    body = dict(model="gpt-oss-tiny", input="Hello there", instructions="Be brief.",
                temperature=0, max_output_tokens=16,
                tools=[{"type": "function", **TOOLS[0]["function"]}])
    r = gpt_oss_client.responses.create(**body)
    assert r.status in ("completed", "incomplete")
    events = list(gpt_oss_client.responses.create(stream=True, **body))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    done = events[-1].response
    assert [o.model_dump(exclude={"id"}) for o in done.output] == \
        [o.model_dump(exclude={"id"}) for o in r.output]
    assert done.usage.output_tokens == r.usage.output_tokens


def test_the_prompt_is_harmony(gpt_oss_client):
    import httpx

    base = str(gpt_oss_client.base_url).removesuffix("/v1/")
    out = httpx.post(f"{base}/tokenize", json={"messages": ASK}, timeout=60).json()
    detok = httpx.post(f"{base}/detokenize", json={"tokens": out["tokens"]}, timeout=60).json()
    assert out["tokens"][0] == 200006                  # <|start|>
    assert "Reasoning: medium" in detok["prompt"] and "Be brief." in detok["prompt"]
