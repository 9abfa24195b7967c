"""`tailrace serve --data-parallel-size 2` (issue 36): two engine processes behind one
frontend, on the CPU (one thread each), with the bundled SmolLM2.

One server for the module; the last test kills one of its engines, which (as in vLLM)
stops the whole server: every stream ends with an error event and [DONE], and no
process is left."""
from __future__ import annotations

import concurrent.futures as cf
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

PROMPTS = ["The capital of France is", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def dp2(serve_with_flags, tmp_path_factory):
    gen = serve_with_flags(tmp_path_factory.mktemp("dp2"), "--data-parallel-size", "2",
                           "--kv-cache-memory-bytes", "64Mi")
    yield next(gen)
    gen.close()


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _per_engine(url: str, series: str = r"tailrace:engine_steps_total\{") -> dict[str, float]:
    """A series' value by its engine label, summed over its other labels (the series' name
    and labels before `engine`, as a regex)."""
    text = httpx.get(f"{url}/metrics", timeout=60).text
    out: dict[str, float] = {}
    for m in re.finditer(rf'^{series}engine="(\d+)"[^}}]*\}} (\S+)$', text, re.M):
        out[m[1]] = out.get(m[1], 0.0) + float(m[2])
    return out


def _engine_steps(url: str) -> dict[str, float]:
    return _per_engine(url)


# the request side's series, labelled by the engine that served the request (as vLLM)
_SERVED = {"success": r'vllm:request_success_total\{', "generated": r"vllm:generation_tokens_total\{",
           "e2e": r"vllm:e2e_request_latency_seconds_count\{"}


_MODELS: dict[str, str] = {}


def _model(base_url: str) -> str:
    if base_url not in _MODELS:
        _MODELS[base_url] = httpx.get(f"{base_url}/models", timeout=60).json()["data"][0]["id"]
    return _MODELS[base_url]


def _complete(base_url: str, prompt: str, rank: int | None = None, max_tokens: int = 8):
    client = openai.OpenAI(base_url=base_url, api_key="x", timeout=300, max_retries=0)
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    return client.completions.create(model=_model(base_url), prompt=prompt,
                                      max_tokens=max_tokens, temperature=0,
                                      extra_headers=headers)


def test_greedy_output_equals_one_engine(dp2, server):
    for prompt in PROMPTS:
        want = _complete(server.base_url, prompt).choices[0].text
        for rank in (0, 1):
            got = _complete(dp2.base_url, prompt, rank)
            assert got.choices[0].text == want, (prompt, rank)
            assert got.usage.completion_tokens == 8


def test_the_header_pins_a_rank_and_out_of_range_is_a_400(dp2):
    before = _engine_steps(dp2.url)
    served = {k: _per_engine(dp2.url, v) for k, v in _SERVED.items()}
    assert set(before) == {"0", "1"}
    for prompt in PROMPTS:
        _complete(dp2.base_url, prompt, rank=1, max_tokens=3)
    after = _engine_steps(dp2.url)
    assert after["1"] > before["1"] and after["0"] == before["0"]
    # every metric carries the engine label; the pinned requests count on engine 1 only
    now = {k: _per_engine(dp2.url, v) for k, v in _SERVED.items()}
    for k, want in (("success", 2), ("generated", 6), ("e2e", 2)):
        assert now[k].get("1", 0) - served[k].get("1", 0) == want, k
        assert now[k].get("0", 0) == served[k].get("0", 0), k
    for bad in ("2", "-1", "one"):
        with pytest.raises(openai.BadRequestError) as exc:
            _complete(dp2.base_url, "hi", rank=bad)
        err = exc.value.body
        assert err["param"] == "X-data-parallel-rank" and "X-data-parallel-rank" in err["message"]


def test_concurrent_requests_spread_over_both_engines(dp2):
    before = _engine_steps(dp2.url)
    with cf.ThreadPoolExecutor(64) as pool:
        outs = list(pool.map(lambda i: _complete(dp2.base_url, f"Item {i}:", max_tokens=2),
                             range(64)))
    assert all(o.usage.completion_tokens == 2 for o in outs)
    after = _engine_steps(dp2.url)
    assert after["0"] > before["0"] and after["1"] > before["1"], (before, after)
    metrics = httpx.get(f"{dp2.url}/metrics", timeout=60).text
    assert 'vllm:num_requests_running{engine="1",model_name=' in metrics


def test_a_killed_engine_ends_the_streams_and_stops_the_server(dp2):
    parent = dp2.proc.pid
    kids = _children(parent)
    engines = {int(re.search(r"--dp-rank (\d+)", _cmdline(p))[1]): p for p in kids
               if " web.child engine " in _cmdline(p)}
    assert set(engines) == {0, 1}
    lines: dict[int, list[str]] = {0: [], 1: []}
    started = {0: threading.Event(), 1: threading.Event()}

    def stream(rank: int) -> None:
        body = {"model": _model(dp2.base_url), "prompt": "Once upon a time", "max_tokens": 500,
                "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{dp2.url}/v1/completions", json=body, timeout=120,
                          headers={"X-data-parallel-rank": str(rank)}) as r:
            for line in r.iter_lines():
                if line:
                    lines[rank].append(line)
                    started[rank].set()

    threads = [threading.Thread(target=stream, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    assert started[0].wait(120) and started[1].wait(120)
    os.kill(engines[1], signal.SIGKILL)
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    for rank in (0, 1):
        assert lines[rank][-1] == "data: [DONE]", lines[rank][-3:]
        assert '"error"' in lines[rank][-2] and "engine 1" in lines[rank][-2]
    assert dp2.proc.wait(60) == 1          # the server exits, as vLLM's does
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in kids):
        time.sleep(0.2)
    assert not [p for p in kids if os.path.exists(f"/proc/{p}")]     # no orphans
