"""`tailrace serve --tensor-parallel-size N` on the CPU (gloo), over real HTTP with the
official openai client, against one rank (the engine in this process, same sizes):

- SmolLM2 (9 heads, 3 KV heads: TP = 3, not 2) greedy, with logprobs, over ranks on two
  "hosts" (rank 2 started by hand from MASTER_ADDR/MASTER_PORT/RANK, as another host would);
- the tiny dummy gpt-oss at TP = 2 (sinks, a sliding window, MoE, the hybrid KV cache's
  remaps): prefix caching, chunked prefill, preemption, n > 1, a JSON schema;
- SIGTERM stops every worker; a killed worker fails the stream in flight, exit 1, no orphans.

TAILRACE_TP_DEVICE=cuda runs the same on GPUs (NCCL; scripts/gpu_check.sh, with two or more).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import openai
import orjson
import pytest
import trio

from pipeline.core.config import EngineConfig
from pipeline.core.engine import open_engine
from tests.support.serve_processes import metrics, processes, start, wait_for
from pipeline.layouts.process import death_hook  # test servers die with pytest

DEVICE = os.environ.get("TAILRACE_TP_DEVICE", "cpu")
# a small step budget (chunked prefill) and KV cache (preemption), at every size alike
SIZES = {"max_model_len": 256, "max_num_seqs": 4, "max_num_batched_tokens": 64,
         "num_gpu_blocks_override": 10, "device": DEVICE}
FLAGS = tuple(x for k, v in SIZES.items() for x in (f"--{k.replace('_', '-')}", str(v)))


def _devices() -> int:
    import torch

    return torch.cuda.device_count() if DEVICE == "cuda" else 3


def needs(n: int):
    return pytest.mark.skipif(_devices() < n, reason=f"TP {n} on {DEVICE} needs {n} devices, "
                                                     f"torch sees {_devices()}")


pytestmark = needs(2)
CHAT = [[{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Name three colours."}]]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
LONG = "The history of the city of Paris begins " * 12          # ~100 tokens: chunked
COUNT = [f"Count slowly from {i} upwards:" for i in range(4)]    # together: preempted
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"},
                                           "population": {"type": "integer"}},
          "required": ["city", "population"]}


GPT_OSS_CONFIG = Path(__file__).parents[2] / "gpu" / "configs" / "gpt-oss-tiny"


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory) -> str:
    """The tiny gpt-oss (gpu/configs/gpt-oss-tiny) with random weights saved as safetensors:
    every rank then loads its shard of the same weights (a dummy load draws each shard on its
    own). No tokenizer.json: Harmony's o200k is implied."""
    import torch
    import transformers

    out = tmp_path_factory.mktemp("gpt-oss-tiny")
    config = transformers.AutoConfig.from_pretrained(GPT_OSS_CONFIG)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.save_pretrained(out, safe_serialization=True)
    return str(out)


@pytest.fixture(scope="module")
def gpt_oss(gpt_oss_dir):
    from gpu.loader.decoder import load_model

    return load_model(gpt_oss_dir, dtype="float32", device=DEVICE, progress=False)


@pytest.fixture(scope="module")
def smollm_ref(request):
    """SmolLM2 on DEVICE for the one-rank reference (the session's CPU copy on the CPU)."""
    if DEVICE == "cpu":
        return request.getfixturevalue("smollm")
    from gpu.loader.decoder import load_model

    return load_model(None, dtype="float32", device=DEVICE, progress=False)


def reference(loaded, calls: list[tuple[str, dict]], together: bool = False) -> list[dict]:
    """The replies of one rank (the engine in this process, same sizes) to `calls`."""
    async def main():
        out: list[dict] = [{}] * len(calls)
        async with open_engine(EngineConfig(**SIZES), loaded=loaded) as engine:
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


EXTRA = ("prompt_logprobs", "ignore_eos", "structured_outputs")     # vLLM's fields, beyond OpenAI's


def ask(client: openai.OpenAI, api: str, body: dict) -> dict:
    create = client.chat.completions.create if api == "chat" else client.completions.create
    extra = {k: body[k] for k in EXTRA if k in body}
    plain = {k: v for k, v in body.items() if k not in EXTRA}
    return create(model="m", **plain, extra_body=extra or None).model_dump()


def texts(reply: dict) -> list[str]:
    return [c["message"]["content"] if "message" in c else c["text"] for c in reply["choices"]]


def workers_of(pid: int) -> list[int]:
    return [p for p, ppid, cmd in processes() if ppid == pid and "pipeline.layouts.tp_worker" in cmd]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                         timeout=120)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def smollm_tp3(tmp_path):
    """SmolLM2 at TP = 3: rank 0 starts rank 1 (LOCAL_WORLD_SIZE=2); rank 2 is started by
    hand, as on another host (docs/scaling.md). Yields (server, rank 2's process). A server
    per test: the test stops it."""
    port = str(_free_port())
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    with open(tmp_path / "rank2.txt", "wb") as err:
        other = subprocess.Popen(
            [sys.executable, "-m", "pipeline.layouts.tp_worker", "--log-level", "warning", "--",
             "--dtype", "float32", "--tensor-parallel-size", "3", *FLAGS],
            env={**env, "RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "2"}, stderr=err,
            preexec_fn=death_hook())
    mp = pytest.MonkeyPatch()
    try:
        for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", port), ("LOCAL_WORLD_SIZE", "2")):
            mp.setenv(k, v)
        server = start(tmp_path, "--served-model-name", "m", "-tp", "3", *FLAGS)
        mp.undo()
        yield server, other
        server.stop()
        other.wait(timeout=30)
    finally:
        mp.undo()
        if other.poll() is None:
            other.kill()
            other.wait()


@pytest.fixture(scope="module")
def gpt_oss_tp2(tmp_path_factory, gpt_oss_dir):
    server = start(tmp_path_factory.mktemp("tp2"), gpt_oss_dir, "--served-model-name", "m",
                   "--tensor-parallel-size", "2", *FLAGS,
                   "--enable-prompt-tokens-details")   # cached_tokens is read below
    yield server
    server.stop()


@needs(3)
def test_smollm2_greedy_at_tp3_over_two_hosts_is_one_ranks_then_sigterm_stops_every_rank(
        smollm_tp3, smollm_ref):
    """One server for both (a TP 3 start-up is the costly part): greedy token for token,
    then SIGTERM stops rank 1 and the other "host"'s rank 2 too. Few tokens: three ranks on
    two cores wait out a time slice at many of a step's 60 all-reduces (~0.4 s a token);
    tests/gpu/test_tp_smollm2.py holds TP 3's logits to TP 1's on more prompts."""
    calls = ([("chat", {"messages": CHAT[0], "max_tokens": 8, "temperature": 0, "logprobs": True})]
             + [("completions", {"prompt": p, "max_tokens": 8, "temperature": 0, "logprobs": 1})
                for p in PROMPTS[:2]])
    want = reference(smollm_ref, calls)
    server, _ = smollm_tp3
    got = [ask(client_of(server), api, body) for api, body in calls]
    assert len(workers_of(server.proc.pid)) == 1          # rank 1; rank 2 is the "other host"
    for g, w in zip(got, want):
        assert texts(g) == texts(w)
        assert g["usage"]["completion_tokens"] == w["usage"]["completion_tokens"] == 8 or \
            g["choices"][0]["finish_reason"] == w["choices"][0]["finish_reason"] == "stop"
        glp, wlp = g["choices"][0]["logprobs"], w["choices"][0]["logprobs"]
        if "content" in wlp:     # chat
            gl, wl = [t["logprob"] for t in glp["content"]], [t["logprob"] for t in wlp["content"]]
        else:
            gl, wl = glp["token_logprobs"], wlp["token_logprobs"]
        assert gl == pytest.approx(wl, abs=1e-4)
    _stops_cleanly(server)
    assert smollm_tp3[1].wait(timeout=30) == 0   # the other "host"'s rank got its stop message


def _stops_cleanly(server) -> None:
    workers = workers_of(server.proc.pid)
    assert len(workers) == 1
    assert server.stop() == 0
    wait_for(lambda: not any(alive(p) for p in workers), 30, "the workers to exit")


def test_prefix_cache_chunked_prefill_n_and_json_schema_at_tp2(gpt_oss_tp2, gpt_oss):
    calls = [("completions", {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
                              "logprobs": 1}),
             ("completions", {"prompt": LONG, "max_tokens": 8, "temperature": 0,
                              "prompt_logprobs": 1}),                       # chunked
             ("completions", {"prompt": LONG, "max_tokens": 8, "temperature": 0}),  # cached
             ("completions", {"prompt": PROMPTS[2], "max_tokens": 12, "n": 2, "seed": 7,
                              "temperature": 0.8}),
             ("completions", {"prompt": "A French city as JSON: ", "max_tokens": 24,
                              "temperature": 0, "structured_outputs": {"json": SCHEMA}})]
    want = reference(gpt_oss, calls)
    got = [ask(client_of(gpt_oss_tp2), api, body) for api, body in calls]
    for g, w in zip(got, want):
        assert texts(g) == texts(w)
    assert got[0]["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        want[0]["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4)
    assert got[1]["usage"]["prompt_tokens"] > SIZES["max_num_batched_tokens"]
    gp, wp = got[1]["choices"][0]["prompt_logprobs"], want[1]["choices"][0]["prompt_logprobs"]
    assert len(gp) == len(wp) == got[1]["usage"]["prompt_tokens"] and gp[0] is None
    for g, w in zip(gp[1:], wp[1:]):
        assert g.keys() == w.keys()
        assert [x["logprob"] for x in g.values()] == pytest.approx(
            [x["logprob"] for x in w.values()], abs=1e-4)
    assert got[2]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert len(got[3]["choices"]) == 2
    assert texts(got[4])[0].startswith("{")


def test_preemption_at_tp2_keeps_the_outputs(gpt_oss_tp2, gpt_oss):
    calls = [("completions", {"prompt": p, "max_tokens": 40, "temperature": 0, "ignore_eos": True})
             for p in COUNT]
    want = reference(gpt_oss, calls, together=True)
    before = metrics(gpt_oss_tp2.url)["vllm:num_preemptions_total"]
    got: list[dict] = [{}] * len(calls)

    def one(i):
        got[i] = ask(client_of(gpt_oss_tp2), *calls[i])
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [texts(g) for g in got] == [texts(w) for w in want]
    assert metrics(gpt_oss_tp2.url)["vllm:num_preemptions_total"] > before


def test_sigterm_drains_then_stops_every_worker(tmp_path, gpt_oss_dir):
    """A server of its own (stopping the module's would make the tests after it depend
    on the order)."""
    server = start(tmp_path, gpt_oss_dir, "--served-model-name", "m", "--tensor-parallel-size",
                   "2", *FLAGS)
    try:
        _stops_cleanly(server)
    finally:
        server.stop()


def test_a_dead_worker_fails_in_flight_requests_and_the_server_exits_1(tmp_path, gpt_oss_dir):
    """With --api-server-count 1 (the engine in its own process): rank 1 is stopped
    (SIGSTOP) so that a request is surely in flight, inside a collective, when it is killed;
    the request fails, the server exits 1, nothing is left behind."""
    server = start(tmp_path, gpt_oss_dir, "--served-model-name", "m", "-tp", "2",
                   "--api-server-count", "1", *FLAGS)
    try:
        engine = server.children()["engine"][0]
        frontends = server.children()["frontend"]
        workers = workers_of(engine)
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGSTOP)
        outcome: list = []

        def stream():
            try:
                for _ in client_of(server).completions.create(
                        model="m", prompt=PROMPTS[0], max_tokens=50, temperature=0, stream=True):
                    pass
                outcome.append("finished")
            except Exception as exc:      # what the client sees of the failed request
                outcome.append(exc)
        thread = threading.Thread(target=stream)
        thread.start()
        wait_for(lambda: metrics(server.url)["vllm:num_requests_running"] == 1, 30,
                 "the request to run")
        os.kill(workers[0], signal.SIGKILL)
        thread.join(60)
        assert outcome and isinstance(outcome[0], Exception), outcome
        assert server.proc.wait(timeout=60) == 1
        everyone = [engine, *frontends, *workers]
        wait_for(lambda: not any(alive(p) for p in everyone), 30, "no process left behind")
    finally:
        server.stop()
    assert "TPLost" in server.err.read_text()


def test_a_size_that_does_not_divide_fails_start_up_naming_the_flag(smollm_ref):
    """SmolLM2's 9 heads at TP 2: start-up fails with the loader's own message (not only
    "a worker exited"), and the worker started for it is gone."""
    before = {p for p, _, cmd in processes() if "pipeline.layouts.tp_worker" in cmd}

    async def main():
        async with open_engine(EngineConfig(**{**SIZES, "tensor_parallel_size": 2})):
            pass
    import torch

    threads = torch.get_num_threads()     # rank 0 here takes its share of the cores
    try:
        with pytest.raises(ValueError, match="not divisible by --tensor-parallel-size 2"):
            trio.run(main)
    finally:
        torch.set_num_threads(threads)
    assert not [p for p, _, cmd in processes()
                if "pipeline.layouts.tp_worker" in cmd and p not in before and alive(p)]
