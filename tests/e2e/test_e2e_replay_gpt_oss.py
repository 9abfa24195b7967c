"""Replay of a gpt-oss event log with no flags: a real `tailrace serve gpu/configs/gpt-oss-tiny
--load-format dummy --event-log LOG` (Harmony, random weights) answers a streamed chat with
tools and a Responses request; `tailrace replay LOG` then loads the Harmony tokenizer the
config implies (gpu.tokenizers.files.load_tokenizer, as the server does) and the resolved parsers
from the header, and reproduces both replies byte for byte."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import openai

from pipeline.core.events import read_events

CONFIG = Path(__file__).parents[2] / "gpu" / "configs" / "gpt-oss-tiny"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def test_a_gpt_oss_log_replays_with_no_flags(tmp_path, serve_with_flags):
    log = tmp_path / "events.jsonl"
    serve = serve_with_flags(tmp_path, str(CONFIG), "--load-format", "dummy",
                             "--event-log", str(log))
    server = next(serve)
    try:
        c = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)
        chunks = list(c.chat.completions.create(
            model="gpt-oss-tiny", messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=TOOLS, max_tokens=8, temperature=0, stream=True))
        assert chunks[-1].choices[0].finish_reason is not None
        r = c.responses.create(model="gpt-oss-tiny", input="Hello", max_output_tokens=6,
                               temperature=0)
        assert r.status in ("completed", "incomplete")
    finally:
        serve.close()    # SIGTERM: the server drains and flushes the log

    header = next(read_events(log))
    assert header["flags"]["reasoning_parser"] is None          # no parser flag was given ...
    assert header["parsers"] == {                               # ... Harmony's were implied
        "reasoning_parser": "openai_gptoss", "tool_call_parser": "openai",
        "enable_auto_tool_choice": True, "exclude_tools_when_tool_choice_none": True,
        "harmony": True}
    cli = subprocess.run([sys.executable, "-m", "web.cli", "replay", str(log)],
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert "replayed 2 requests: 2 identical, 0 differ" in cli.stdout
    assert "note:" not in cli.stderr                            # the tokenizer hash matched
