"""`tailrace serve --quantization gguf` (issue 39; what `auto` does for a GGUF file on a CPU
with --dtype auto): the bundled SmolLM2's Q4_1/Q8_0 blocks kept packed, over real HTTP with the
official openai client. The start-up log says what runs; the greedy answer is fp32's (the
dequantized float32 model's, which the other e2e servers run)."""
from __future__ import annotations

import openai
import pytest


@pytest.fixture(scope="module")
def packed_server(serve_with_flags, tmp_path_factory):
    yield from serve_with_flags(tmp_path_factory.mktemp("e2e-gguf-packed"), "--quantization", "gguf",
                                "--log-level", "info")


def test_packed_server_answers_like_fp32(packed_server, server):
    startup = packed_server.log.read_text(errors="replace")
    assert "weights: GGUF weights kept packed (210 Q4_1, 1 Q8_0 tensors" in startup
    assert "ISA " in startup
    replies = []
    for s in (packed_server, server):   # server: --dtype float32, dequantized
        client = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0, timeout=300)
        r = client.chat.completions.create(model=client.models.list().data[0].id, temperature=0, max_tokens=16,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
        replies.append(r.choices[0].message.content)
    assert replies[0] == replies[1]
    assert replies[0].startswith("The capital of France is Paris")
