"""One pipeline, three process layouts: the same requests, sent one at a time, stream the
same bytes (less the ids and timestamps that differ between any two runs) and the same
usage from one process, from `--api-server-count 2` and from `--tensor-parallel-size 2`
(the CPU, gloo).

The model is the tiny gpt-oss (gpu/configs/gpt-oss-tiny, random weights saved once as
safetensors so that every layout and every rank loads the same ones; Harmony, sinks, a
sliding window, MoE): SmolLM2's 9 heads do not split in two. Every server runs n-gram
speculation, whose output is that of decoding one token at a time (docs/cli.md), so the
requests cover a speculative config in each layout; /metrics shows it drafted. The
requests: n = 2 seeded, a stop string, a named tool call (structured output: the random
model cannot fail to call), logprobs in completions and chat.
"""
from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import httpx
import orjson
import pytest

from tests.support.serve_processes import metrics, start

CONFIG = Path(__file__).parents[2] / "gpu" / "configs" / "gpt-oss-tiny"
# drafts at every step ("adaptive": false): the cost gate's choices depend on timing
SPEC = ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, '
        '"prompt_lookup_max": 3, "adaptive": false}')
# the same sizes everywhere: a TP server sizes its KV cache as the minimum over its ranks
COMMON = ("--served-model-name", "m", "--max-num-seqs", "4", "--num-gpu-blocks-override", "64",
          "--speculative-config", SPEC)
LAYOUTS = {"one": (), "asc2": ("--api-server-count", "2"), "tp2": ("--tensor-parallel-size", "2")}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                             "enum": ["Paris", "Rome"]}},
                   "required": ["city"]}}}]
STREAM = {"stream": True, "stream_options": {"include_usage": True}}
PROMPT = "The history of the city of Paris begins"
# (path, body): sent in this order to every layout
REQUESTS = [
    ("completions", {"prompt": PROMPT, "max_tokens": 12, "n": 2, "seed": 7, "temperature": 0.8,
                     "logprobs": 2}),
    ("completions", {"prompt": PROMPT + " again", "max_tokens": 16, "temperature": 0,
                     "logprobs": 1}),
    ("chat", {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
              "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
              "max_tokens": 24, "temperature": 0}),
    ("chat", {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 10,
              "temperature": 0, "logprobs": True, "top_logprobs": 2}),
    # random weights never repeat themselves: a bias makes one token win every step, so
    # that n-gram lookup finds it again and drafts that hold
    ("completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "logprobs": 1,
                     "logit_bias": {"1000": 100}}),
]
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory) -> str:
    import torch
    import transformers

    out = tmp_path_factory.mktemp("gpt-oss-tiny")
    config = transformers.AutoConfig.from_pretrained(CONFIG)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.save_pretrained(out, safe_serialization=True)
    return str(out)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, gpt_oss_dir):
    """One server per layout, their start-ups overlapping."""
    def one(name):
        return start(tmp_path_factory.mktemp(f"layout-{name}"), gpt_oss_dir, *COMMON,
                     *LAYOUTS[name])
    with concurrent.futures.ThreadPoolExecutor(len(LAYOUTS)) as pool:
        futures = {name: pool.submit(one, name) for name in LAYOUTS}
        concurrent.futures.wait(futures.values())
    started = {name: f.result() for name, f in futures.items() if f.exception() is None}
    try:
        for f in futures.values():
            f.result()               # the first start-up that failed, with its stderr
        yield started
    finally:
        for server in started.values():
            server.stop()


def _events(body: bytes) -> list:
    """The SSE events, JSON ones without what differs between any two runs: the reply's
    id, its creation time and each tool call's id."""
    out = []
    for block in body.split(b"\n\n"):
        if not block.startswith(b"data: "):
            assert not block.strip(), block
            continue
        data = block[len(b"data: "):]
        if data == b"[DONE]":
            out.append("[DONE]")
            continue
        event = orjson.loads(data)
        event.pop("id", None)
        event.pop("created", None)
        for choice in event.get("choices", ()):
            for call in (choice.get("delta") or {}).get("tool_calls") or ():
                call.pop("id", None)
        out.append(event)
    return out


def _post(server, api: str, body: dict) -> list:
    r = httpx.post(f"{server.url}{PATHS[api]}", json={"model": "m", **body, **STREAM},
                   timeout=300)     # a loaded 2-core machine runs three servers
    assert r.status_code == 200, r.text
    events = _events(r.content)
    assert events[-1] == "[DONE]" and events[-2]["usage"], events[-2:]
    return events


def _text(events: list, index: int = 0) -> str:
    return "".join(c.get("text") or "" for e in events[:-1] for c in e["choices"]
                   if c["index"] == index)


def _stop_request(servers) -> tuple[str, dict]:
    """A stop string the model does write: three characters from the middle of the
    one-process layout's greedy text (random weights: no string is known beforehand)."""
    body = REQUESTS[1][1]
    text = _text(_post(servers["one"], "completions", body))
    middle = len(text) // 2
    stop = next(text[i:i + 3] for i in range(middle, len(text) - 2) if text[i:i + 3].strip())
    return "completions", {**body, "stop": [stop]}


@pytest.fixture(scope="module")
def replies(servers) -> dict[str, list[list]]:
    """Every layout's events for the same calls, sent to each one at a time (so its prefix
    cache holds the same blocks as the others', and cached_tokens agree)."""
    t0 = time.monotonic()
    calls = [*REQUESTS, _stop_request(servers)]
    def run(server):
        return [_post(server, api, body) for api, body in calls]
    with concurrent.futures.ThreadPoolExecutor(len(servers)) as pool:   # the layouts at once
        got = dict(zip(servers, pool.map(run, servers.values())))
    print(f"layouts identity: {len(calls)} requests x {len(got)} layouts in "
          f"{time.monotonic() - t0:.1f} s")
    return {"calls": calls, **got}


def _same(a, b, logprob_tol: float, where: str = "") -> None:
    """a == b, keys in the same order (as the bytes would have them), but for logprobs
    within logprob_tol (0: the same float)."""
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], logprob_tol, f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, logprob_tol, f"{where}[{i}]")
    elif isinstance(a, float) and ".logprobs" in where:
        assert abs(a - b) <= logprob_tol, (where, a, b)
    else:
        assert a == b, (where, a, b)


# TP 2 sums each row's products in two halves and adds them (an all-reduce): its logits,
# and so its logprobs, may differ from one rank's in fp32's last bits (tests/tp: 1e-4);
# every token, every chunk boundary and the usage are the same. The frontend cut runs the
# same arithmetic as one process: the same floats.
LOGPROB_TOL = {"asc2": 0.0, "tp2": 1e-4}


@pytest.mark.parametrize("layout", ["asc2", "tp2"])
def test_a_layout_streams_what_one_process_streams(replies, layout):
    for i, (api, body) in enumerate(replies["calls"]):
        _same(replies[layout][i], replies["one"][i], LOGPROB_TOL[layout],
              f"{layout} {api} {sorted(body)} events")
        if not LOGPROB_TOL[layout]:      # then the very bytes, less ids and timestamps
            assert orjson.dumps(replies[layout][i]) == orjson.dumps(replies["one"][i])


def test_the_requests_cover_what_they_claim(replies, servers):
    """Not vacuous: two choices, logprobs, a tool call, a stop string that stopped, and
    drafts that held in every layout."""
    one, calls = replies["one"], replies["calls"]
    assert {c["index"] for e in one[0][:-2] for c in e["choices"]} == {0, 1}      # n = 2
    assert one[0][-2]["usage"]["completion_tokens"] == 24
    assert any(c["logprobs"] for e in one[1][:-2] for c in e["choices"])
    made = [call for e in one[2][:-2] for c in e["choices"]
            for call in (c["delta"].get("tool_calls") or ())]
    assert made and made[0]["function"]["name"] == "get_weather"
    assert one[2][-3]["choices"][0]["finish_reason"] == "stop"   # named: as vLLM (docs/api.md)
    assert any(c["logprobs"] for e in one[3][:-2] for c in e["choices"])
    assert len({t for e in one[4][:-2] for c in e["choices"]
                for t in (c["logprobs"] or {}).get("tokens", ())}) == 1          # the biased token
    ends = [c for e in one[5][:-2] for c in e["choices"] if c["finish_reason"]]
    assert ends[-1]["finish_reason"] == "stop" and ends[-1]["stop_reason"] == calls[5][1]["stop"][0]
    assert one[5][-2]["usage"]["completion_tokens"] < calls[5][1]["max_tokens"]
    for name, server in servers.items():
        m = metrics(server.url)
        assert m["vllm:spec_decode_num_drafts_total"] > 0, name
        assert m["vllm:spec_decode_num_accepted_tokens_total"] > 0, name


async def _spec_off(model: str, calls: list) -> list[dict]:
    """The same calls to the same weights in this process without speculation: each
    choice's text, content and tool calls' arguments (what a layout's deltas join to)."""
    from pipeline.core.config import EngineConfig
    from pipeline.core.engine import open_engine

    out = []
    cfg = EngineConfig(model=model, max_model_len=512, dtype="float32", max_num_seqs=4,
                       num_gpu_blocks_override=64)
    async with open_engine(cfg) as engine:
        for api, body in calls:
            reply = await engine.submit(api, {"model": engine.model_names[0], **body})
            out.append(_joined([orjson.loads(await reply.read())], api, stream=False))
    return out


def _joined(events: list, api: str, stream: bool = True) -> dict:
    """index -> the choice's text (completions) or content and tool calls' arguments (chat)."""
    got: dict[int, str] = {}
    for e in events:
        for c in e.get("choices", ()):
            if api == "completions":
                part = c.get("text") or ""
            else:
                m = c.get("delta" if stream else "message") or {}
                part = (m.get("content") or "") + "".join(
                    (t.get("function") or {}).get("arguments") or "" for t in m.get("tool_calls") or ())
            got[c["index"]] = got.get(c["index"], "") + part
    return got


def test_speculation_in_every_layout_writes_what_no_speculation_writes(replies, gpt_oss_dir):
    """n-gram drafts (some of which hold, above) under --api-server-count 2 and TP 2 change
    no token: greedy, seeded n = 2 and a tool call join to the texts that the same weights
    give without speculation."""
    import trio

    want = trio.run(_spec_off, gpt_oss_dir, replies["calls"])
    for layout in LAYOUTS:
        got = [_joined(events[:-1], api) for (api, _), events in zip(replies["calls"],
                                                                     replies[layout])]
        assert got == want, layout
