"""Disaggregated prefill over NIXL on loopback (issue 36): `tailrace cluster --prefill 1
--decode 2`, one launcher for the module: a prefill instance, two decode instances (each
with the NIXL KV connector, DRAM to DRAM over UCX) and the P/D proxy, the bundled
SmolLM2 with a small KV cache and 16-token blocks.

The proxy's answers equal the prefill instance's own (a single instance) for a prompt of
13 blocks, streamed and not; the decode instances' counters show the prompt served from
the transfer; a refusal on the decode side frees the prefill side's blocks at once.
Decode instance 1 is killed with its read in flight (the prefill instance stopped for the
while, so the read cannot land): the prefill side frees the blocks at
VLLM_NIXL_ABORT_REQUEST_TIMEOUT (short here), serves on, and the proxy serves through
decode 0. The last test kills the prefill instance: decode 0 answers a clear error at
once, both when its NIXL read finds the agent gone and when the side channel is.
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

from pipeline.tools.cluster import free_port  # noqa: E402

LISTENING = "tailrace: listening on "
START_TIMEOUT_S = 300
ABORT_TIMEOUT_S = 8
SERVE = ["--max-model-len", "512", "--max-num-seqs", "4", "--dtype", "float32",
         "--kv-cache-memory-bytes", "16Mi", "--block-size", "16", "--log-level", "warning"]
MESSAGES = [{"role": "user", "content": "Count on: " + " ".join(map(str, range(60)))}]


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd")
    ports = [free_port(), free_port(), free_port()]
    env = {**os.environ, "TQDM_DISABLE": "1",
           "VLLM_NIXL_ABORT_REQUEST_TIMEOUT": str(ABORT_TIMEOUT_S)}
    out, err = tmp / "stdout.txt", tmp / "stderr.txt"
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(
            [sys.executable, "-m", "web.cli", "cluster", "--prefill", "1", "--decode", "2",
             "--port", "0", "--replica-ports", ",".join(map(str, ports)),
             "--threads-per-replica", "1", "--no-restart-replicas", "--stop-timeout", "20",
             *SERVE], stdout=o, stderr=e, env=env)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while LISTENING not in out.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the cluster did not start:\n{err.read_text()[-4000:]}")
            time.sleep(0.2)
        url = out.read_text().split(LISTENING)[1].split()[0]
        pids = {f"{role} {i}": int(pid) for role, i, pid in
                re.findall(r"(prefill|decode) (\d): pid (\d+)", err.read_text())}
        model = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
        yield {"url": url, "prefill": f"http://127.0.0.1:{ports[0]}", "model": model,
               "decode": f"http://127.0.0.1:{ports[1]}", "decode1": f"http://127.0.0.1:{ports[2]}",
               "prefill_pid": pids["prefill 0"], "decode1_pid": pids["decode 1"], "err": err}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=300)


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=60).text
    return float(re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M).group(1))


def _held_blocks(pd) -> float:
    return _metric(pd["prefill"], "tailrace:kv_blocks_used")


def _prefill(pd, **extra) -> dict:
    """A prefill leg sent by hand (as the proxy does): the params of the blocks held."""
    r = httpx.post(f"{pd['prefill']}/v1/chat/completions", timeout=300, json={
        "model": pd["model"], "messages": MESSAGES, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}, **extra})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def _wait_freed(pd, within: float) -> None:
    deadline = time.monotonic() + within
    while _held_blocks(pd) > 0:
        assert time.monotonic() < deadline, "the prefill instance still holds the blocks"
        time.sleep(0.2)


def test_pd_answers_equal_one_instances_streamed_and_not(pd):
    ask = dict(model=pd["model"], messages=MESSAGES, max_tokens=8, temperature=0,
               logprobs=True, top_logprobs=2)
    ref = _client(pd["prefill"]).chat.completions.create(**ask)
    assert ref.usage.prompt_tokens > 12 * 16          # the prompt spans 13 blocks
    decodes = (pd["decode"], pd["decode1"])
    prompt0 = sum(_metric(d, "vllm:prompt_tokens_total") for d in decodes)
    cached0 = sum(_metric(d, "tailrace:cached_tokens_total") for d in decodes)
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
    # the decode instances served both prompts from the transfer: of each they computed
    # the last token only, fed as a decode step is (its logits give the first token)
    prompts = sum(_metric(d, "vllm:prompt_tokens_total") for d in decodes) - prompt0
    cached = sum(_metric(d, "tailrace:cached_tokens_total") for d in decodes) - cached0
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


def _decode(pd, url: str, params: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=timeout, json={
        "model": pd["model"], "messages": MESSAGES, "max_tokens": 2, "temperature": 0,
        "kv_transfer_params": params})


def test_a_decode_instance_killed_mid_transfer_the_prefill_side_frees_at_the_timeout(pd):
    # decode 1 reads once, so that it knows the prefill engine's agent and layout (no
    # side-channel exchange in the read below, which the stopped prefill could not answer)
    r = _decode(pd, pd["decode1"], _prefill(pd))
    assert r.status_code == 200, r.text
    _wait_freed(pd, ABORT_TIMEOUT_S / 2)
    params = _prefill(pd)
    assert _held_blocks(pd) == 13
    os.kill(pd["prefill_pid"], signal.SIGSTOP)   # its UCX cannot serve the read now
    try:
        answered = []
        t = threading.Thread(target=lambda: answered.append(_try(_decode, pd, pd["decode1"], params)))
        t.start()
        deadline = time.monotonic() + 30         # decode 1 allocates the blocks and reads
        while _metric(pd["decode1"], "tailrace:kv_blocks_used") < 13:
            assert time.monotonic() < deadline, "decode 1 did not start the read"
            time.sleep(0.1)
        time.sleep(0.5)
        assert t.is_alive()                      # the read is in flight
        os.kill(pd["decode1_pid"], signal.SIGKILL)
        t.join(30)
        assert answered and isinstance(answered[0], httpx.TransportError)
    finally:
        os.kill(pd["prefill_pid"], signal.SIGCONT)
    t0 = time.monotonic()
    assert _held_blocks(pd) == 13              # the read never landed: no NIXL notification
    _wait_freed(pd, ABORT_TIMEOUT_S + 10)    # freed at the abort timeout, not before
    assert time.monotonic() - t0 > 1
    assert _metric(pd["prefill"], "tailrace:kv_blocks_used") == 0   # nothing leaked
    deadline = time.monotonic() + 30         # the launcher takes decode 1 out of the proxy
    while "decode 1 taken out" not in pd["err"].read_text():
        assert time.monotonic() < deadline
        time.sleep(0.2)
    got = _client(pd["url"]).chat.completions.create(model=pd["model"], messages=MESSAGES,
                                                     max_tokens=2, temperature=0)
    assert got.usage.prompt_tokens > 12 * 16   # prefill, then decode 0: both serve on
    _wait_freed(pd, ABORT_TIMEOUT_S / 2)


def _try(fn, *args):
    try:
        return fn(*args)
    except httpx.HTTPError as exc:
        return exc


def test_a_prefill_instance_that_is_gone_is_a_clear_error_on_the_decode_side(pd):
    r = _decode(pd, pd["decode"], _prefill(pd))   # decode 0 knows the prefill's agent
    assert r.status_code == 200, r.text
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
