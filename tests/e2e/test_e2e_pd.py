"""Disaggregated prefill over NIXL on loopback (issue 36): `tailrace cluster --prefill 1
--decode 1`, one launcher for the module: a prefill instance, a decode instance (each
with the NIXL KV connector, DRAM to DRAM over UCX) and the P/D proxy, the bundled
SmolLM2 with a small KV cache and 16-token blocks.

The proxy's answers equal the prefill instance's own (a single instance) for a prompt of
13 blocks, streamed and not; the decode instance's counters show the prompt served from
the transfer; a refusal on the decode side frees the prefill side's blocks at once, and
blocks never read go at VLLM_NIXL_ABORT_REQUEST_TIMEOUT (short here: a decode instance
killed mid-transfer never reads them either). The last test kills the prefill instance:
the decode side answers a clear error at once."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

pytest.importorskip("nixl")

from pipeline.tools.cluster import free_port  # noqa: E402
from pipeline.layouts.process import die_with_parent  # test servers die with pytest

LISTENING = "tailrace: listening on "
START_TIMEOUT_S = 300
ABORT_TIMEOUT_S = 8
SERVE = ["--max-model-len", "512", "--max-num-seqs", "4", "--dtype", "float32",
         "--kv-cache-memory-bytes", "16Mi", "--block-size", "16", "--log-level", "warning"]
MESSAGES = [{"role": "user", "content": "Count on: " + " ".join(map(str, range(60)))}]


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd")
    ports = [free_port(), free_port()]
    env = {**os.environ, "TQDM_DISABLE": "1",
           "VLLM_NIXL_ABORT_REQUEST_TIMEOUT": str(ABORT_TIMEOUT_S)}
    out, err = tmp / "stdout.txt", tmp / "stderr.txt"
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(
            [sys.executable, "-m", "web.cli", "cluster", "--prefill", "1", "--decode", "1",
             "--port", "0", "--replica-ports", f"{ports[0]},{ports[1]}",
             "--threads-per-replica", "1", "--no-restart-replicas", "--stop-timeout", "20",
             *SERVE], stdout=o, stderr=e, env=env, preexec_fn=die_with_parent)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while LISTENING not in out.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the cluster did not start:\n{err.read_text()[-4000:]}")
            time.sleep(0.2)
        url = out.read_text().split(LISTENING)[1].split()[0]
        pids = dict(re.findall(r"(prefill|decode) 0: pid (\d+)", err.read_text()))
        model = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
        yield {"url": url, "prefill": f"http://127.0.0.1:{ports[0]}", "model": model,
               "decode": f"http://127.0.0.1:{ports[1]}", "prefill_pid": int(pids["prefill"]),
               "err": err}
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


def test_blocks_never_read_are_freed_at_the_abort_timeout(pd):
    _prefill(pd)
    assert _held_blocks(pd) == 13           # nobody reads them (a decode side that died)
    _wait_freed(pd, ABORT_TIMEOUT_S + 10)


def test_a_prefill_instance_that_is_gone_is_a_clear_error_on_the_decode_side(pd):
    params = _prefill(pd)
    os.kill(pd["prefill_pid"], signal.SIGKILL)
    r = httpx.post(f"{pd['decode']}/v1/chat/completions", timeout=60, json={
        "model": pd["model"], "messages": MESSAGES, "max_tokens": 4,
        "kv_transfer_params": params})
    assert r.status_code == 500
    assert "side channel" in r.json()["error"]["message"]
    deadline = time.monotonic() + 30        # the launcher takes it out of the proxy
    while "prefill 0 taken out" not in pd["err"].read_text():
        assert time.monotonic() < deadline
        time.sleep(0.2)
    with pytest.raises(openai.APIStatusError) as info:
        _client(pd["url"]).chat.completions.create(model=pd["model"], messages=MESSAGES,
                                                   max_tokens=2)
    assert info.value.status_code == 503
