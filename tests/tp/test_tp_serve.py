"""`tailrace serve --tensor-parallel-size N` on the CPU (gloo), over real HTTP with the
official openai client: the same output as one rank (greedy, prefix caching, chunked
prefill, preemption, n > 1, a JSON schema), across hosts (a worker started by hand as
another host would), and the failure and shutdown of the worker ranks."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import orjson
import pytest
import trio

from pipeline.config import EngineConfig
from pipeline.engine import open_engine
from procs_util import metrics, processes, start, wait_for

# a small step budget (chunked prefill) and KV cache (preemption), at every size alike
SIZES = {"max_model_len": 256, "max_num_seqs": 4, "max_num_batched_tokens": 64,
         "num_gpu_blocks_override": 10}
FLAGS = tuple(x for k, v in SIZES.items() for x in (f"--{k.replace('_', '-')}", str(v)))
CHAT = [[{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Name three colours."}]]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
LONG = "The history of the city of Paris begins " * 12          # ~100 tokens: chunked
COUNT = [f"Count slowly from {i} upwards:" for i in range(4)]    # together: preempted
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"},
                                           "population": {"type": "integer"}},
          "required": ["city", "population"]}


def reference(smollm, calls: list[tuple[str, dict]], together: bool = False) -> list[dict]:
    """The replies of one rank (the engine in this process, same sizes) to `calls`."""
    async def main():
        out: list[dict] = [{}] * len(calls)
        async with open_engine(EngineConfig(**SIZES), loaded=smollm) as engine:
            async def one(i, api, body):
                reply = await engine.submit(api, {"model": engine.model_names[0], **body})
                out[i] = orjson.loads(await reply.read())
            if together:
                async with trio.open_nursery() as n:
                    for i, (api, body) in enumerate(calls):
                        n.start_soon(one, i, api, body)
            else:
                for i, (api, body) in enumerate(calls):
                    await one(i, api, body)
        return out
    return trio.run(main)


EXTRA = ("prompt_logprobs", "ignore_eos")     # vLLM's fields, beyond OpenAI's


def ask(client: openai.OpenAI, api: str, body: dict) -> dict:
    create = client.chat.completions.create if api == "chat" else client.completions.create
    extra = {k: body[k] for k in EXTRA if k in body}
    plain = {k: v for k, v in body.items() if k not in EXTRA}
    return create(model="m", **plain, extra_body=extra or None).model_dump()


def texts(reply: dict) -> list[str]:
    return [c["message"]["content"] if "message" in c else c["text"] for c in reply["choices"]]


def workers_of(pid: int) -> list[int]:
    return [p for p, ppid, cmd in processes() if ppid == pid and "pipeline.tp_worker" in cmd]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    server = start(tmp_path_factory.mktemp("tp2"), "--served-model-name", "m",
                   "--tensor-parallel-size", "2", *FLAGS)
    yield server
    server.stop()


def test_greedy_at_tp2_is_one_ranks_token_for_token(tp2, smollm):
    calls = ([("chat", {"messages": m, "max_tokens": 16, "temperature": 0, "logprobs": True})
              for m in CHAT]
             + [("completions", {"prompt": p, "max_tokens": 16, "temperature": 0, "logprobs": 1})
                for p in PROMPTS])
    want = reference(smollm, calls)
    got = [ask(client_of(tp2), api, body) for api, body in calls]
    for g, w in zip(got, want):
        assert texts(g) == texts(w)
        assert g["usage"]["completion_tokens"] == w["usage"]["completion_tokens"] == 16 or \
            g["choices"][0]["finish_reason"] == w["choices"][0]["finish_reason"] == "stop"
        glp, wlp = g["choices"][0]["logprobs"], w["choices"][0]["logprobs"]
        if "content" in wlp:     # chat
            gl, wl = [t["logprob"] for t in glp["content"]], [t["logprob"] for t in wlp["content"]]
        else:
            gl, wl = glp["token_logprobs"], wlp["token_logprobs"]
        assert gl == pytest.approx(wl, abs=1e-4)


def test_prefix_cache_chunked_prefill_n_and_json_schema_at_tp2(tp2, smollm):
    calls = [("chat", {"messages": CHAT[0], "max_tokens": 8, "temperature": 0}),
             ("chat", {"messages": CHAT[0], "max_tokens": 8, "temperature": 0}),   # cached
             ("completions", {"prompt": LONG, "max_tokens": 8, "temperature": 0,
                              "prompt_logprobs": 1}),
             ("completions", {"prompt": PROMPTS[2], "max_tokens": 12, "n": 2, "seed": 7,
                              "temperature": 0.8}),
             ("chat", {"messages": [{"role": "user", "content": "A French city as JSON."}],
                       "max_tokens": 40, "temperature": 0,
                       "response_format": {"type": "json_schema",
                                           "json_schema": {"name": "c", "schema": SCHEMA}}})]
    want = reference(smollm, calls)
    got = [ask(client_of(tp2), api, body) for api, body in calls]
    for g, w in zip(got, want):
        assert texts(g) == texts(w)
    assert got[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert got[2]["usage"]["prompt_tokens"] > SIZES["max_num_batched_tokens"]
    gp, wp = got[2]["choices"][0]["prompt_logprobs"], want[2]["choices"][0]["prompt_logprobs"]
    assert len(gp) == len(wp) == got[2]["usage"]["prompt_tokens"] and gp[0] is None
    for g, w in zip(gp[1:], wp[1:]):
        assert g.keys() == w.keys()
        assert [x["logprob"] for x in g.values()] == pytest.approx(
            [x["logprob"] for x in w.values()], abs=1e-4)
    assert len(got[3]["choices"]) == 2
    assert set(json.loads(texts(got[4])[0])) >= {"city", "population"}


def test_preemption_at_tp2_keeps_the_outputs(tp2, smollm):
    calls = [("completions", {"prompt": p, "max_tokens": 40, "temperature": 0, "ignore_eos": True})
             for p in COUNT]
    want = reference(smollm, calls, together=True)
    before = metrics(tp2.url)["vllm:num_preemptions_total"]
    got: list[dict] = [{}] * len(calls)

    def one(i):
        got[i] = ask(client_of(tp2), *calls[i])
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [texts(g) for g in got] == [texts(w) for w in want]
    assert metrics(tp2.url)["vllm:num_preemptions_total"] > before


def test_sigterm_drains_then_stops_every_worker(tp2):
    workers = workers_of(tp2.proc.pid)
    assert len(workers) == 1
    assert tp2.stop() == 0
    wait_for(lambda: not any(alive(p) for p in workers), 30, "the workers to exit")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tp3_across_two_hosts_on_loopback(tmp_path, smollm, monkeypatch):
    """Rank 0 starts rank 1 (LOCAL_WORLD_SIZE=2); rank 2 is started by hand, as on another
    host, from MASTER_ADDR/MASTER_PORT and RANK (docs/scaling.md)."""
    port = str(_free_port())
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    other = subprocess.Popen(
        [sys.executable, "-m", "pipeline.tp_worker", "--log-level", "warning", "--",
         "--dtype", "float32", "--tensor-parallel-size", "3", *FLAGS],
        env={**env, "RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "0"},
        stderr=open(tmp_path / "rank2.txt", "wb"))
    try:
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", port)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        server = start(tmp_path, "--served-model-name", "m", "-tp", "3", *FLAGS)
        try:
            calls = [("completions", {"prompt": p, "max_tokens": 12, "temperature": 0})
                     for p in PROMPTS[:2]]
            want = reference(smollm, calls)
            got = [ask(client_of(server), api, body) for api, body in calls]
            assert [texts(g) for g in got] == [texts(w) for w in want]
            assert len(workers_of(server.proc.pid)) == 1          # rank 1 only
        finally:
            assert server.stop() == 0
        assert other.wait(timeout=30) == 0, (tmp_path / "rank2.txt").read_text()[-2000:]
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()


def test_a_dead_worker_fails_in_flight_requests_and_the_server_exits_1(tmp_path):
    """With --api-server-count 1 (the engine in its own process): SIGKILL rank 1 in the
    middle of a stream; the stream ends in an error, the server exits 1, nothing is left."""
    server = start(tmp_path, "--served-model-name", "m", "-tp", "2", "--api-server-count", "1",
                   *FLAGS)
    try:
        engine = server.children()["engine"][0]
        frontends = server.children()["frontend"]
        workers = workers_of(engine)
        assert len(workers) == 1
        stream = client_of(server).completions.create(
            model="m", prompt=PROMPTS[0], max_tokens=120, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        first = next(iter(stream))
        assert first.choices[0].text is not None
        os.kill(workers[0], signal.SIGKILL)
        with pytest.raises(Exception) as failed:
            for _ in stream:
                pass
        assert not isinstance(failed.value, AssertionError)
        assert server.proc.wait(timeout=60) == 1
        everyone = [engine, *frontends, *workers]
        wait_for(lambda: not any(alive(p) for p in everyone), 30, "no process left behind")
    finally:
        server.stop()
    assert "tensor-parallel worker rank 1" in server.err.read_text()
