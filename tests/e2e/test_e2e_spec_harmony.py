"""The seed's no-leak test over HTTP (issue 35, the seed's
test_gpt_oss_speculative_reasoning_leakage): the tiny gpt-oss (Harmony, random weights)
served with --speculative-config, an EAGLE3 head (random, written in the published format
by tests/support/eagle_heads.py) and n-gram lookup, streamed with the openai client. Several
tokens arrive in one step; the reasoning and content deltas, joined, must be those of the
server without speculation (the session's gpt_oss_client), and no delta's content may hold
analysis text. The requests favour Harmony's framing words by logit_bias so that the
random weights write parsed text; they write no analysis channel (the framing special
tokens are not sampled), so the reasoning side is only checked to be equal (empty)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.eagle_heads import eagle3_head

CONFIG = Path(__file__).parents[2] / "gpu" / "configs" / "gpt-oss-tiny"
ASK = [{"role": "system", "content": "Be brief."},
       {"role": "user", "content": "Think, then say hello twice: hello hello."}]


@pytest.fixture(scope="module", params=["eagle3", "ngram"])
def spec_client(request, serve_with_flags, tmp_path_factory):
    import openai

    tmp = tmp_path_factory.mktemp(f"e2e-spec-{request.param}")
    if request.param == "eagle3":
        cfg = json.loads((CONFIG / "config.json").read_text())
        head = eagle3_head(tmp / "head", vocab=cfg["vocab_size"], target_hidden=cfg["hidden_size"],
                           hidden=cfg["hidden_size"], own_embeddings=False, aux_ids=[0, 1, 2],
                           draft_vocab=4096)
        spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3,
                "adaptive": False}
    else:
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                "prompt_lookup_max": 2, "adaptive": False}
    for server in serve_with_flags(tmp, str(CONFIG), "--load-format", "dummy",
                                   "--speculative-config", json.dumps(spec)):
        yield openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)


def _ids(client, text: str) -> list[int]:
    import httpx

    r = httpx.post(str(client.base_url).removesuffix("/v1/") .removesuffix("/v1") + "/tokenize",
                   json={"model": "gpt-oss-tiny", "prompt": text, "add_special_tokens": False})
    r.raise_for_status()
    return r.json()["tokens"]


def _bias(client) -> dict[str, float]:
    """Harmony's framing tokens and a few words, strongly favoured: random weights then
    write analysis and final channels (and malformed framing) within a few tokens."""
    special = {"<|channel|>": 200005, "<|message|>": 200008, "<|end|>": 200007,
               "<|start|>": 200006}
    words = [t for w in ("analysis", "final", "assistant", " hello", " think") for t in _ids(client, w)]
    return {str(t): 40.0 for t in [*special.values(), *words]}


def _deltas(client, **body) -> tuple[list[str], list[str], str | None]:
    stream = client.chat.completions.create(model="gpt-oss-tiny", messages=ASK, stream=True,
                                            max_tokens=32, **body)
    content, reasoning, finish = [], [], None
    for chunk in stream:
        for c in chunk.choices:
            d = c.delta
            extra = d.model_extra or {}
            if d.content:
                content.append(d.content)
            r = extra.get("reasoning") or extra.get("reasoning_content")
            if r:
                reasoning.append(r)
            finish = c.finish_reason or finish
    return content, reasoning, finish


BODIES = [dict(temperature=0), dict(temperature=0.8, seed=7)]


@pytest.mark.parametrize("body", BODIES)
def test_speculative_streams_leak_no_reasoning_into_content(spec_client, gpt_oss_client, body):
    body = {**body, "logit_bias": _bias(gpt_oss_client)}
    off_c, off_r, off_f = _deltas(gpt_oss_client, **body)
    on_c, on_r, on_f = _deltas(spec_client, **body)
    assert ("".join(on_c), "".join(on_r), on_f) == ("".join(off_c), "".join(off_r), off_f)
    # no content delta carries analysis text: the content deltas join to the content of
    # the unspeculated stream (whose analysis went to reasoning), and none holds framing
    for piece in on_c:
        assert "<|channel|>" not in piece and "<|message|>" not in piece, piece


def test_the_streams_hold_reasoning_and_content(gpt_oss_client):
    """Not vacuous: the biased model's streams carry parsed text."""
    body = {"logit_bias": _bias(gpt_oss_client)}
    seen = []
    for b in BODIES:
        c, r, f = _deltas(gpt_oss_client, **body, **b)
        seen.append(("".join(c), "".join(r), f))
    print(seen)
    assert any(c or r for c, r, _ in seen), seen
