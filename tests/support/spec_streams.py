"""What the speculative-decoding engine tests share (tests/engine/test_engine_spec.py,
test_engine_eagle.py): SmolLM2 behind an engine without async scheduling, the requests every
layout streams (BODIES), each layout's streams without speculation (made once, NO_SPEC_STREAMS),
and the comparisons of two streams: text, logprobs to fp32's noise, usage."""
from __future__ import annotations

import orjson
import trio

from pipeline.core.config import EngineConfig
from pipeline.core.engine import open_engine

# drafts at every decode ("adaptive": false): the cost gate's choices depend on timing
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "adaptive": False}
TEXT = ("The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the "
        "lazy dog. The quick brown fox")
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"


def engine_of(smollm, **cfg):
    return open_engine(EngineConfig(**{"max_model_len": 256, "max_num_seqs": 8,
                                       "async_scheduling": False, **cfg}), loaded=smollm)


def texts(stream: bytes) -> dict[int, tuple[str, str]]:
    """Each choice's text and finish_reason, whatever the chunking (several tokens may
    come in one chunk; choices interleave by timing)."""
    out: dict[int, list] = {}
    for event in stream.split(b"\n\n"):
        if event.startswith(b"data: {"):
            for c in orjson.loads(event[6:])["choices"]:
                o = out.setdefault(c["index"], ["", None])
                o[0] += c.get("text") or (c.get("delta") or {}).get("content") or ""
                o[1] = c.get("finish_reason") or o[1]
    return {i: tuple(v) for i, v in out.items()}


BODIES = [
    ("completions", dict(prompt="Repeat this text: " + TEXT, max_tokens=24, logprobs=2)),
    ("completions", dict(prompt="Repeat this text: " + TEXT, max_tokens=24, temperature=0.8,
                         seed=11, logprobs=1)),
    ("completions", dict(prompt=CODE + "\n# the same, again:\n" + CODE[:20], max_tokens=30,
                         temperature=0.8, seed=3, n=2)),
    ("completions", dict(prompt="Copy: " + TEXT, max_tokens=30, stop=["lazy"])),
    ("completions", dict(prompt="Copy: " + TEXT, max_tokens=20, frequency_penalty=0.5,
                         presence_penalty=0.3, repetition_penalty=1.1, temperature=0.8, seed=5)),
    ("completions", dict(prompt="Copy: " + TEXT, max_tokens=20, min_tokens=15,
                         logit_bias={"13": -2.0}, bad_words=["dog"])),
    ("chat", dict(messages=[{"role": "user", "content": "Repeat exactly: " + TEXT}],
                  max_tokens=24, logprobs=True, top_logprobs=2)),
    ("completions", dict(prompt="xq zv 81 plk wre 5 mm", max_tokens=12, temperature=0.8, seed=9)),
    # constrained output drafts too: each verify row masked by the grammar walked through
    # the drafts before it (gpu/worker/grammar.py draft_masks)
    ("chat", dict(messages=[{"role": "user", "content": "Repeat as JSON: " + TEXT}], max_tokens=20,
                  response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {
                      "type": "object", "properties": {"text": {"type": "string", "maxLength": 40}},
                      "required": ["text"]}}})),
]


async def run_streams(smollm, spec, bodies, **cfg) -> tuple[list[bytes], object]:
    out: list[bytes] = [b""] * len(bodies)
    async with engine_of(smollm, speculative_config=spec, **cfg) as engine:
        async def one(i, api, body):
            reply = await engine.submit(api, {"model": engine.model_names[0], "temperature": 0,
                                              "stream": True, "stream_options": {"include_usage": True},
                                              **body}, request_id=f"r{i}")
            out[i] = await reply.read()
        async with trio.open_nursery() as n:
            for i, (api, body) in enumerate(bodies):
                n.start_soon(one, i, api, body)
        stats = engine.stats()
        spec_counts = engine.scheduler.spec
        floated = getattr(engine.scheduler, "num_floated", 0)
    return out, (stats, spec_counts, floated)


# a KV cache small enough to preempt, and chunked prefill
TIGHT = dict(num_gpu_blocks_override=14, block_size=8, max_num_batched_tokens=32)
CFGS = {"roomy": {}, "preempting": TIGHT}


def draft_spec(**kw) -> dict:
    from gpu.tokenizers.files import default_model_path

    return {"method": "draft_model", "model": str(default_model_path()),
            "num_speculative_tokens": 3, **kw}


SPECS = {"ngram": SPEC, "ngram-async": SPEC, "draft-self": draft_spec(),
         "draft-self-async": draft_spec(), "draft-bf16": draft_spec(dtype="bfloat16")}
NO_SPEC_STREAMS: dict[str, list[bytes]] = {}   # each layout's streams without speculation, made once


def logprob_list(stream: bytes) -> list:
    """Every emitted token's logprob entries, in order, per choice."""
    out: dict[int, list] = {}
    for event in stream.split(b"\n\n"):
        if event.startswith(b"data: {"):
            for c in orjson.loads(event[6:])["choices"]:
                lp = c.get("logprobs")
                if not lp:
                    continue
                if "content" in lp:          # chat
                    items = [(x["token"], x["logprob"],
                              [(t["token"], t["logprob"]) for t in x["top_logprobs"]])
                             for x in lp["content"]]
                else:
                    items = list(zip(lp["tokens"], lp["token_logprobs"]))
                out.setdefault(c["index"], []).extend(items)
    return sorted(out.items())


def same_logprobs(a: list, b: list) -> bool:
    """The same tokens with the same logprobs, to fp32's noise: a verify pass (or a
    prefill recomputed after preemption) is a wider forward than a decode."""
    if isinstance(a, float) or isinstance(b, float):
        return abs(a - b) < 2e-3
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_logprobs(x, y) for x, y in zip(a, b))
    return a == b


def usage_of(stream: bytes) -> dict:
    for event in stream.split(b"\n\n"):
        if event.startswith(b"data: {"):
            chunk = orjson.loads(event[6:])
            if chunk.get("usage"):    # cached tokens depend on which request came first
                return {k: chunk["usage"][k] for k in ("prompt_tokens", "completion_tokens")}
    raise AssertionError("no usage chunk")
