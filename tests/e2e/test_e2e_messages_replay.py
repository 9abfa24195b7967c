"""The event log replays Messages replies byte for byte: a `tailrace serve --event-log`
answers /v1/messages streamed and not (text, a stop sequence, max_tokens, a tool use, a
thinking block, an error), then `tailrace replay` reproduces every byte."""
from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from pipeline.tools.replay import Log, replay_log

ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object",
                            "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"], "additionalProperties": False}}
BODIES = {
    "text": {"messages": ASK, "max_tokens": 8, "temperature": 0},
    "text_stream": {"messages": ASK, "max_tokens": 8, "temperature": 0, "stream": True},
    "stop_stream": {"messages": ASK, "max_tokens": 20, "temperature": 0, "stream": True,
                    "stop_sequences": [" Paris"]},
    "seeded": {"messages": ASK, "max_tokens": 6, "temperature": 0.9, "seed": 3},
    "tool_stream": {"messages": [{"role": "user", "content": "Weather in Paris?"}],
                    "max_tokens": 40, "temperature": 0, "stream": True, "tools": [WEATHER],
                    "tool_choice": {"type": "tool", "name": "get_weather"}},
    "tool": {"messages": [{"role": "user", "content": "Weather in Paris?"}],
             "max_tokens": 40, "temperature": 0, "tools": [WEATHER],
             "tool_choice": {"type": "tool", "name": "get_weather"}},
    "thinking_stream": {"messages": ASK + [{"role": "assistant", "content": "<think>\n"}],
                        "max_tokens": 6, "temperature": 0, "stream": True,
                        "thinking": {"type": "enabled", "budget_tokens": 1024}},
}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, serve_with_flags):
    tmp = tmp_path_factory.mktemp("e2e-messages-replay")
    log = tmp / "events.jsonl"
    serve = serve_with_flags(tmp, "--event-log", str(log), "--reasoning-parser", "qwen3",
                             "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    server = next(serve)
    seen: dict[str, tuple[str, bytes]] = {}
    try:
        def call(body: dict) -> tuple[str, bytes]:
            with httpx.stream("POST", f"{server.url}/v1/messages", json=body,
                              timeout=120) as r:
                assert r.status_code == 200, r.read()
                return r.headers["x-request-id"], b"".join(r.iter_bytes())

        with concurrent.futures.ThreadPoolExecutor(len(BODIES)) as pool:
            futures = {name: pool.submit(call, body) for name, body in BODIES.items()}
            seen = {name: f.result() for name, f in futures.items()}
        refused = httpx.post(f"{server.url}/v1/messages", json={"messages": ASK}, timeout=60)
        assert refused.status_code == 400 and refused.json()["type"] == "error"
    finally:
        serve.close()      # SIGTERM: the log is flushed and closed
    return log, seen


def test_messages_replies_replay_byte_for_byte(recorded):
    from gpu.tokenizers.files import load_tokenizer

    log, seen = recorded
    result = replay_log(Log.read(log), load_tokenizer(None), reasoning_parser="qwen3")
    for name, (rid, body) in seen.items():
        assert result.logged[rid] == body, name          # the log holds what the client got
        assert result.reproduced[rid] == body, name      # ... and replay makes it again
        assert result.apis[rid].startswith("messages")
    assert result.differences == []
    assert b'"input_json_delta"' in seen["tool_stream"][1]
    assert b'"thinking_delta"' in seen["thinking_stream"][1]
    assert b'"stop_sequence":" Paris"' in seen["stop_stream"][1]
    assert b'"tool_use"' in seen["tool"][1]


def test_the_replay_command_needs_no_flags(recorded, capsys):
    from web.cli import main

    log, seen = recorded
    capsys.readouterr()
    assert main(["replay", str(log)]) == 0
    n = len(seen)
    assert f"replayed {n} requests: {n} identical, 0 differ" in capsys.readouterr().out
