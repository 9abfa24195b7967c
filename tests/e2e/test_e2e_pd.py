"""Disaggregated prefill over NIXL on loopback (issue 36): `tailrace cluster --prefill 1
--decode 1` (a prefill instance, a decode instance, each with the NIXL KV connector, DRAM
to DRAM over UCX, and the P/D proxy) and beside it one `tailrace serve --api-server-count
2 -dp 2` instance with the connector; the bundled SmolLM2, a small KV cache, 16-token
blocks.

The proxy's answers equal the prefill instance's own (a single instance) for a prompt of
13 blocks, streamed and not; the decode instance's counters show the prompt served from
the transfer; a refusal on the decode side frees the prefill side's blocks at once. Each
engine of the frontends instance serves as the prefill side and as the decode side. That
instance is then killed with its read in flight (the prefill instance stopped for the
while, so the read cannot land): the prefill side frees the blocks at
VLLM_NIXL_ABORT_REQUEST_TIMEOUT (short here) and serves on. The last test kills the
prefill instance: the decode side answers a clear error at once, both when its NIXL read
finds the agent gone and when the side channel is.

The same cluster with `--pd-router vllm-router` (vllm-router 0.1.17's P/D mode runs the
two legs instead of tailrace's proxy): its answers equal one instance's too, the decode
instance computes the last prompt token only; a decode instance killed is taken out of the
rotation by the router's health checks (a 503, no prefill leg sent) and, restarted by the
launcher on its port, put back by them.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

pytest.importorskip("nixl")

from pipeline.tools.cluster import free_port, router_installed  # noqa: E402
from pipeline.layouts.process import death_hook  # test servers die with pytest

LISTENING = "tailrace: listening on "
START_TIMEOUT_S = 300
ABORT_TIMEOUT_S = 8
SERVE = ["--max-model-len", "512", "--max-num-seqs", "4", "--dtype", "float32",
         "--kv-cache-memory-bytes", "16Mi", "--block-size", "16", "--log-level", "warning"]
MESSAGES = [{"role": "user", "content": "Count on: " + " ".join(map(str, range(60)))}]


KV_BOTH = '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'


def _frontends(tmp, env) -> tuple[subprocess.Popen, str]:
    """The other instance: `tailrace serve --api-server-count 2 --data-parallel-size 2`
    (two engine processes, each with its connector, side channel and engine id, and two
    frontends), prefill and decode both (kv_both), in a session of its own to kill."""
    port, side = free_port(), free_port()
    log = open(tmp / "frontends.txt", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "web.cli", "serve", "--port", str(port), "--api-server-count",
         "2", "-dp", "2", "--kv-transfer-config", KV_BOTH, *SERVE], stdout=log, stderr=log,
        # its holds wait long (its tests never wait for them to expire): on a crowded
        # machine a scrape may come seconds after the reply
        env={**env, "OMP_NUM_THREADS": "1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side),
             "VLLM_NIXL_ABORT_REQUEST_TIMEOUT": "120"},
        start_new_session=True, preexec_fn=death_hook())
    return proc, f"http://127.0.0.1:{port}"


def _wait_healthy(proc, url: str, deadline: float, log) -> None:
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{url} did not start:\n{log.read_text()[-4000:]}")
        time.sleep(0.3)


def _cluster(tmp, env, *flags) -> tuple[subprocess.Popen, list[int]]:
    """`tailrace cluster --prefill 1 --decode 1` with `flags`, the instances on the ports
    returned (prefill, decode); its stdout and stderr in tmp."""
    ports = [free_port(), free_port()]
    with open(tmp / "stdout.txt", "wb") as o, open(tmp / "stderr.txt", "wb") as e:
        proc = subprocess.Popen(
            [sys.executable, "-m", "web.cli", "cluster", "--prefill", "1", "--decode", "1",
             "--port", "0", "--replica-ports", f"{ports[0]},{ports[1]}",
             "--threads-per-replica", "1", "--stop-timeout", "20", *flags, *SERVE],
            stdout=o, stderr=e, env=env, preexec_fn=death_hook())
    return proc, ports


def _cluster_ready(proc, tmp, ports, deadline: float) -> dict:
    out, err = tmp / "stdout.txt", tmp / "stderr.txt"
    while LISTENING not in out.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the cluster did not start:\n{err.read_text()[-4000:]}")
        time.sleep(0.2)
    url = out.read_text().split(LISTENING)[1].split()[0]
    pids = dict(re.findall(r"(prefill|decode) 0: pid (\d+)", err.read_text()))
    model = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
    return {"url": url, "prefill": f"http://127.0.0.1:{ports[0]}", "model": model,
            "decode": f"http://127.0.0.1:{ports[1]}", "prefill_pid": int(pids["prefill"]),
            "decode_pid": int(pids["decode"]), "err": err}


def _stop(*procs) -> None:
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _env() -> dict:
    return {**os.environ, "TQDM_DISABLE": "1",
            "VLLM_NIXL_ABORT_REQUEST_TIMEOUT": str(ABORT_TIMEOUT_S)}


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd")
    env = _env()
    proc, ports = _cluster(tmp, env, "--no-restart-replicas")
    fe, fe_url = _frontends(tmp, env)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        info = _cluster_ready(proc, tmp, ports, deadline)
        _wait_healthy(fe, fe_url, deadline, tmp / "frontends.txt")
        yield {**info, "frontends": fe_url, "frontends_proc": fe}
    finally:
        proc.send_signal(signal.SIGTERM)
        if fe.poll() is None:
            os.killpg(fe.pid, signal.SIGTERM)
        _stop(proc, fe)


@pytest.fixture(scope="module")
def pd_vllm_router(tmp_path_factory):
    """The cluster with vllm-router's P/D mode in front (restarts on)."""
    if not router_installed():
        pytest.skip("vllm-router is not installed")
    tmp = tmp_path_factory.mktemp("pd_vllm_router")
    proc, ports = _cluster(tmp, _env(), "--pd-router", "vllm-router", "--policy",
                           "round_robin")
    try:
        yield _cluster_ready(proc, tmp, ports, time.monotonic() + START_TIMEOUT_S)
    finally:
        proc.send_signal(signal.SIGTERM)
        _stop(proc)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=300)


def _metric(url: str, name: str, engine: int | None = None) -> float:
    """The first series of `name`; with `engine`, that engine's (data parallel)."""
    text = httpx.get(f"{url}/metrics", timeout=60).text
    labels = r"(?:{[^}]*})?" if engine is None else rf'{{engine="{engine}"}}'
    return float(re.search(rf"^{re.escape(name)}{labels} (\S+)$", text, re.M).group(1))


def _held_blocks(pd, url: str | None = None) -> float:
    if url is None:
        return _metric(pd["prefill"], "tailrace:kv_blocks_used")
    return sum(_metric(url, "tailrace:kv_blocks_used", e) for e in (0, 1))    # -dp 2


def _prefill(pd, url: str | None = None, rank: int | None = None, **extra) -> dict:
    """A prefill leg sent by hand (as the proxy does): the params of the blocks held."""
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    r = httpx.post(f"{url or pd['prefill']}/v1/chat/completions", timeout=300, headers=headers, json={
        "model": pd["model"], "messages": MESSAGES, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}, **extra})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def _wait_freed(pd, within: float, url: str | None = None) -> None:
    deadline = time.monotonic() + within
    while _held_blocks(pd, url) > 0:
        assert time.monotonic() < deadline, "the prefill instance still holds the blocks"
        time.sleep(0.2)


def test_pd_answers_equal_one_instances_streamed_and_not(pd):
    _answers_equal_one_instances(pd)


def _answers_equal_one_instances(pd) -> None:
    ask = dict(model=pd["model"], messages=MESSAGES, max_tokens=8, temperature=0,
               logprobs=True, top_logprobs=2)
    ref = _client(pd["prefill"]).chat.completions.create(**ask)
    assert ref.usage.prompt_tokens > 12 * 16          # the prompt spans 13 blocks
    prompt0 = _metric(pd["decode"], "vllm:prompt_tokens_total")
    cached0 = _metric(pd["decode"], "tailrace:cached_tokens_total")
    got = _client(pd["url"]).chat.completions.create(**ask)
    assert got.choices[0].message.content == ref.choices[0].message.content
    assert got.usage == ref.usage
    for a, b in zip(got.choices[0].logprobs.content, ref.choices[0].logprobs.content,
                    strict=True):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]
    chunks = list(_client(pd["url"]).chat.completions.create(
        **ask, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.choices[0].message.content and chunks[-1].usage == ref.usage
    # the decode instance served both prompts from the transfer: of each it computed the
    # last token only, fed as a decode step is (its logits give the first token)
    prompts = _metric(pd["decode"], "vllm:prompt_tokens_total") - prompt0
    cached = _metric(pd["decode"], "tailrace:cached_tokens_total") - cached0
    assert prompts == 2 * ref.usage.prompt_tokens and cached == prompts - 2
    _wait_freed(pd, ABORT_TIMEOUT_S / 2)              # read, then freed on NIXL's note


def test_a_decode_side_refusal_frees_the_prefill_side_at_once(pd):
    params = _prefill(pd)
    assert _held_blocks(pd) == len(params["remote_block_ids"]) == 13
    r = httpx.post(f"{pd['decode']}/v1/chat/completions", timeout=60, json={
        "model": pd["model"], "messages": MESSAGES, "max_tokens": 4,
        "kv_transfer_params": {**params, "prompt_token_ids": [1, 2, 10**7]}})
    assert r.status_code == 400
    assert "Token id 10000000 is out of vocabulary" in r.json()["error"]["message"]
    _wait_freed(pd, ABORT_TIMEOUT_S / 2)     # well before the abort timeout


def _decode(pd, url: str, params: dict | None, timeout: float = 60,
            rank: int | None = None) -> httpx.Response:
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    return httpx.post(f"{url}/v1/chat/completions", timeout=timeout, headers=headers, json={
        "model": pd["model"], "messages": MESSAGES, "max_tokens": 8, "temperature": 0,
        "kv_transfer_params": params})


def test_an_instance_with_frontends_and_two_engines_is_both_sides(pd):
    ref = _decode(pd, pd["prefill"], None).json()["choices"][0]["message"]["content"]
    for rank in (0, 1):
        # each engine's prefill leg (its own engine id and side channel): the params cross
        # the frontend wire, and the cluster's decode instance reads that engine's KV
        params = _prefill(pd, pd["frontends"], rank)
        assert params["remote_engine_id"].endswith(f"_dp{rank}")
        assert len(params["remote_block_ids"]) == 13
        assert _metric(pd["frontends"], "tailrace:kv_blocks_used", rank) == 13
        r = _decode(pd, pd["decode"], params)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == ref
        _wait_freed(pd, ABORT_TIMEOUT_S / 2, pd["frontends"])
        # as the decode side: that engine reads the cluster prefill's KV
        r = _decode(pd, pd["frontends"], _prefill(pd), rank=rank)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == ref
        _wait_freed(pd, ABORT_TIMEOUT_S / 2)
    # a refusal in a frontend (render's 400) frees its prefill side at once too
    params = _prefill(pd, pd["frontends"])
    r = _decode(pd, pd["frontends"], {**params, "prompt_token_ids": [1, 2, 10**7]})
    assert r.status_code == 400
    _wait_freed(pd, ABORT_TIMEOUT_S / 2, pd["frontends"])


def test_a_decode_instance_killed_mid_transfer_the_prefill_side_frees_at_the_timeout(pd):
    params = _prefill(pd)
    assert _held_blocks(pd) == 13
    os.kill(pd["prefill_pid"], signal.SIGSTOP)   # its UCX cannot serve the read now
    try:
        answered = []
        t = threading.Thread(
            target=lambda: answered.append(_try(_decode, pd, pd["frontends"], params)))
        t.start()
        deadline = time.monotonic() + 30         # the decode side allocates and reads
        while _held_blocks(pd, pd["frontends"]) < 13:
            assert time.monotonic() < deadline, "the decode side did not start the read"
            time.sleep(0.1)
        time.sleep(0.5)
        assert t.is_alive()                      # the read is in flight
        os.killpg(pd["frontends_proc"].pid, signal.SIGKILL)   # engine and frontends
        t.join(30)
        assert answered and isinstance(answered[0], httpx.TransportError)
    finally:
        os.kill(pd["prefill_pid"], signal.SIGCONT)
    t0 = time.monotonic()
    assert _held_blocks(pd) == 13              # the read never landed: no NIXL notification
    _wait_freed(pd, ABORT_TIMEOUT_S + 10)    # freed at the abort timeout, not before
    assert time.monotonic() - t0 > 1
    got = _client(pd["url"]).chat.completions.create(model=pd["model"], messages=MESSAGES,
                                                     max_tokens=2, temperature=0)
    assert got.usage.prompt_tokens > 12 * 16   # the prefill instance serves on
    _wait_freed(pd, ABORT_TIMEOUT_S / 2)     # nothing leaked


def _try(fn, *args):
    try:
        return fn(*args)
    except httpx.HTTPError as exc:
        return exc


def test_a_prefill_instance_that_is_gone_is_a_clear_error_on_the_decode_side(pd):
    # decode 0 knows the prefill's agent (test 1)
    params = _prefill(pd)
    os.kill(pd["prefill_pid"], signal.SIGKILL)
    # decode 0's NIXL read finds the agent disconnected; the next request asks the side
    # channel again, which is gone too. Both are a clear error at once.
    for expect in ("failed", "side channel"):
        t0 = time.monotonic()
        r = _decode(pd, pd["decode"], params)
        assert time.monotonic() - t0 < 10
        assert r.status_code == 500
        message = r.json()["error"]["message"]
        assert "prefill instance" in message and expect in message, message
    deadline = time.monotonic() + 30        # the launcher takes it out of the proxy
    while "prefill 0 taken out" not in pd["err"].read_text():
        assert time.monotonic() < deadline
        time.sleep(0.2)
    with pytest.raises(openai.APIStatusError) as info:
        _client(pd["url"]).chat.completions.create(model=pd["model"], messages=MESSAGES,
                                                   max_tokens=2)
    assert info.value.status_code == 503


def test_vllm_routers_pd_mode_answers_equal_one_instances_streamed_and_not(pd_vllm_router):
    _answers_equal_one_instances(pd_vllm_router)
    err = pd_vllm_router["err"].read_text()
    assert "behind vllm-router (P/D mode)" in err
    # vllm-router ran the legs: its X-Request-Id, the reply's id, names both instances
    got = _client(pd_vllm_router["url"]).chat.completions.create(
        model=pd_vllm_router["model"], messages=MESSAGES, max_tokens=1)
    hosts = [u.removeprefix("http://") for u in (pd_vllm_router["prefill"],
                                                 pd_vllm_router["decode"])]
    assert got.id.startswith(f"chatcmpl-___prefill_addr_{hosts[0]}___decode_addr_{hosts[1]}_")
    _wait_freed(pd_vllm_router, ABORT_TIMEOUT_S / 2)


def _router_health(pd) -> int:
    try:
        return httpx.get(f"{pd['url']}/health", timeout=10).status_code
    except httpx.TransportError:
        return 0


def test_vllm_routers_health_checks_take_a_dead_decode_instance_out_and_back(pd_vllm_router):
    pd = pd_vllm_router
    ask = dict(model=pd["model"], messages=MESSAGES, max_tokens=4, temperature=0)
    ref = _client(pd["prefill"]).chat.completions.create(**ask).choices[0].message.content
    _wait_freed(pd, ABORT_TIMEOUT_S / 2)
    os.kill(pd["decode_pid"], signal.SIGKILL)
    deadline = time.monotonic() + 30          # 3 failed checks, one a second
    while _router_health(pd) == 200:
        assert time.monotonic() < deadline, "the router still calls the decode instance healthy"
        time.sleep(0.2)
    with pytest.raises(openai.APIStatusError) as info:
        _client(pd["url"]).chat.completions.create(**ask)
    assert info.value.status_code == 503
    assert _held_blocks(pd) == 0               # no prefill leg was sent
    # the launcher starts it again on its port; the router's checks put it back
    deadline = time.monotonic() + START_TIMEOUT_S
    while "decode 0 healthy again" not in pd["err"].read_text() or _router_health(pd) != 200:
        assert time.monotonic() < deadline, pd["err"].read_text()[-3000:]
        time.sleep(0.2)
    got = _client(pd["url"]).chat.completions.create(**ask)
    assert got.choices[0].message.content == ref
    _wait_freed(pd, ABORT_TIMEOUT_S / 2)
