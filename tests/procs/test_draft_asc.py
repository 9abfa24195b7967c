"""A draft model under `--api-server-count 2`: SmolLM2 drafting for itself in the engine
process (gpu/worker/spec_decode/draft.py), requests through both frontends with the official client; the
texts are those of the same model in one process without speculation, and /metrics
shows that drafts were verified and held (vllm:spec_decode_num_accepted_tokens_per_pos)."""
from __future__ import annotations

import json

import orjson
import pytest
import trio

from pipeline.core.config import EngineConfig
from pipeline.core.engine import open_engine
from tests.support.serve_processes import metrics, start

PROMPT = "Repeat this text: The quick brown fox jumps over the lazy dog. The quick brown fox"
BODIES = [dict(prompt=PROMPT, max_tokens=16, temperature=0),
          dict(prompt=PROMPT, max_tokens=16, temperature=0.8, seed=7, n=2),
          dict(prompt="def add(a, b):\n    return a + b\n\ndef sub(a, b):", max_tokens=16,
               temperature=0, stop=["\n\n"])]


@pytest.fixture(scope="module")
def draft_server(tmp_path_factory):
    from gpu.tokenizers.files import default_model_path

    spec = {"method": "draft_model", "model": str(default_model_path()),
            "num_speculative_tokens": 3, "adaptive": False}
    server = start(tmp_path_factory.mktemp("draft-asc2"), "--api-server-count", "2",
                   "--served-model-name", "m", "--max-num-seqs", "4",
                   "--kv-cache-memory-bytes", "64Mi", "--speculative-config", json.dumps(spec))
    yield server
    server.stop()


async def _reference(smollm) -> list[list[str]]:
    out = []
    async with open_engine(EngineConfig(max_model_len=512, max_num_seqs=4), loaded=smollm) as engine:
        for body in BODIES:
            reply = await engine.submit("completions", {"model": engine.model_names[0], **body})
            choices = orjson.loads(await reply.read())["choices"]
            out.append([c["text"] for c in sorted(choices, key=lambda c: c["index"])])
    return out


def test_draft_model_behind_two_frontends_changes_no_token(draft_server, smollm):
    import openai

    client = openai.OpenAI(base_url=f"{draft_server.url}/v1", api_key="x", max_retries=0,
                           timeout=300)
    got = []
    for _ in range(2):     # twice: the frontends take turns, both serve
        for body in BODIES:
            r = client.completions.create(model="m", **body)
            got.append([c.text for c in sorted(r.choices, key=lambda c: c.index)])
    want = trio.run(_reference, smollm)
    assert got == want + want
    m = metrics(draft_server.url)
    drafted = m["vllm:spec_decode_num_draft_tokens_total"]
    accepted = m["vllm:spec_decode_num_accepted_tokens_total"]
    assert drafted > 20 and accepted >= 0.9 * drafted, (drafted, accepted)
    per_pos = [v for k, v in m.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos")]
    assert len(per_pos) == 3 and sum(per_pos) == accepted and per_pos[0] >= per_pos[2] > 0
