"""The server's own logs through structlog (pipeline/core/logs.py): `tailrace serve --log-format json`
writes one JSON object per stderr line; a failed GPU step's line carries its step number and
the whole traceback. The text format keeps one readable line with key=value fields."""
from __future__ import annotations

import io
import json
import logging

import openai
import pytest

from pipeline.core.logs import formatter


def test_a_failed_step_is_one_json_line_with_its_traceback(tmp_path, serve_with_flags):
    serve = serve_with_flags(tmp_path, "--fault-steps", "1", "--log-format", "json")
    server = next(serve)
    try:
        c = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)
        with pytest.raises(openai.InternalServerError):     # step 1 fails: that request fails
            c.completions.create(model="", prompt="Hello", max_tokens=3)
        assert c.completions.create(model="", prompt="Hello", max_tokens=3).choices  # serving on
    finally:
        serve.close()
    lines = [line for line in server.log.read_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]           # every line is one JSON object
    [failed] = [r for r in records if r.get("logger") == "tailrace.gpu"]
    assert failed["level"] == "error" and failed["step"] == 1 and failed["sequences"] == 1
    assert "step 1 failed" in failed["event"] and "StepFault" in failed["event"]
    assert failed["exception"].startswith("Traceback") and "_execute" in failed["exception"]
    assert "timestamp" in failed


def test_the_text_format_keeps_fields_as_key_value():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter("text"))
    log = logging.getLogger("tailrace.test-log-format")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("request %s refused", "chatcmpl-1", extra={"request_id": "chatcmpl-1"})
    finally:
        log.removeHandler(handler)
    [line] = stream.getvalue().splitlines()
    assert "[warning" in line and "request chatcmpl-1 refused" in line
    assert "request_id=chatcmpl-1" in line and "[tailrace.test-log-format]" in line
    with pytest.raises(ValueError, match="log format"):
        formatter("xml")
