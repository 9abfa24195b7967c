"""`tailrace cluster` end to end: two SmolLM2 replicas behind vllm-router, on loopback.

Each test starts a real launcher (which starts two `tailrace serve` processes and the
router), talks to it with the official `openai` client and raw HTTP, reads each
replica's /metrics to see where a request went, and stops it with SIGTERM. Skipped only
where the vllm-router wheel is not installed (`pip install 'tailrace[cluster]'`).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs
import httpx
import pytest

pytest.importorskip("vllm_router", reason="vllm-router is not installed: pip install "
                                          "'tailrace[cluster]' (or vllm-router==0.1.17)")

import openai  # noqa: E402
from pipeline.layouts.process import death_hook  # test servers die with pytest

LISTENING = "tailrace: listening on "
START_TIMEOUT_S = 300        # two model loads on a busy 2-core box
STOP_TIMEOUT_S = 60
REPORT_TIMEOUT_S = 30
# usage.prompt_tokens_details (the cache-aware test reads cached_tokens) needs its flag
SERVE_FLAGS = ["--max-model-len", "512", "--max-num-seqs", "8", "--dtype", "float32",
               "--enable-prompt-tokens-details",
               "--log-level", "warning", "--served-model-name", "tiny", "tiny-alias"]


@attrs.frozen
class Launched:
    url: str                         # the router: what clients call
    proc: subprocess.Popen
    stderr: Path
    replicas: dict[int, tuple[int, str]]     # index -> (pid, url)
    router_pid: int

    def log(self) -> str:
        return self.stderr.read_text(errors="replace")

    def wait_for_log(self, pattern: str, timeout: float = REPORT_TIMEOUT_S) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            match = re.search(pattern, self.log())
            if match:
                return match
            assert time.monotonic() < deadline, f"no {pattern!r} in:\n{self.log()[-4000:]}"
            time.sleep(0.1)


def _launch(tmp: Path, policy: str, *flags: str) -> Launched:
    out, err = tmp / "stdout.txt", tmp / "stderr.txt"
    env = {**os.environ, "TQDM_DISABLE": "1"}
    with open(out, "wb") as out_f, open(err, "wb") as err_f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "web.cli", "cluster", "--port", "0", "--replicas", "2",
             "--policy", policy, "--threads-per-replica", "1", "--stop-timeout", "20",
             *flags, *SERVE_FLAGS], stdout=out_f, stderr=err_f, env=env,
            preexec_fn=death_hook())
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        lines = [ln for ln in out.read_text(errors="replace").splitlines()
                 if ln.startswith(LISTENING)]
        if lines:
            break
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"tailrace cluster did not start (exit {proc.poll()}):\n"
                        f"{err.read_text(errors='replace')[-4000:]}")
        time.sleep(0.2)
    text = err.read_text(errors="replace")
    replicas = {int(i): (int(pid), url) for i, pid, url in
                re.findall(r"replica (\d+): pid (\d+), (http://\S+), starting", text)}
    router_pid = int(re.search(r"router: pid (\d+)", text).group(1))
    assert len(replicas) == 2
    return Launched(lines[0][len(LISTENING):].strip(), proc, err, replicas, router_pid)


def _stop(launched: Launched) -> int:
    if launched.proc.poll() is None:
        launched.proc.send_signal(signal.SIGTERM)
    try:
        return launched.proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        launched.proc.kill()
        launched.proc.wait()
        raise


def _sessions_alive(leaders: set[int]) -> list[str]:
    """Processes still alive in the sessions the launcher's children led (each child is a
    session leader: pipeline/tools/cluster.py)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        pid = int(stat.parent.name)
        fields = text[text.rindex(")") + 2:].split()    # after "pid (comm) "
        state, session = fields[0], int(fields[3])
        if (pid in leaders or session in leaders) and state != "Z":
            alive.append(text[:120])
    return alive


def _served(replica_url: str) -> float:
    """Requests this replica has finished (every finish reason)."""
    text = httpx.get(f"{replica_url}/metrics", timeout=10).text
    return sum(float(m) for m in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$",
                                            text, re.M))


def _where(launched: Launched, fn) -> tuple[object, list[int]]:
    """Run fn(); which replicas' finished-request counters went up, and by how much."""
    before = {i: _served(url) for i, (_, url) in launched.replicas.items()}
    result = fn()
    after = {i: _served(url) for i, (_, url) in launched.replicas.items()}
    return result, [int(after[i] - before[i]) for i in sorted(before)]


def _assert_alternate(launched: Launched, client: openai.OpenAI, prompt: str) -> None:
    """Four requests through the router land on the two replicas in turn."""
    served = []
    for i in range(4):
        reply, delta = _where(launched, lambda: client.completions.create(
            model="tiny", prompt=f"{prompt} {i}:", max_tokens=2))
        assert reply.choices[0].finish_reason == "length"
        assert sorted(delta) == [0, 1], delta
        served.append(delta.index(1))
    assert served in ([0, 1, 0, 1], [1, 0, 1, 0]), served


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)


def _raw_stream(url: str, body: dict, request_id: str) -> bytes:
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{url}/v1/chat/completions", json=body,
                         headers={"x-request-id": request_id}) as r:
            assert r.status_code == 200, r.read()
            assert r.headers["x-request-id"] == request_id
            return r.read()


def _without_created(raw: bytes) -> tuple[bytes, set[int]]:
    """The stream with its `created` timestamps blanked (a second may tick between two
    requests), and those timestamps."""
    stamps = {int(m) for m in re.findall(rb'"created":(\d+)', raw)}
    return re.sub(rb'"created":\d+', b'"created":0', raw), stamps


def test_round_robin_alternates_streams_identically_and_survives_a_replica_death(tmp_path):
    launched = _launch(tmp_path, "round_robin", "--no-restart-replicas")
    try:
        client = _client(launched.url)
        assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]

        _assert_alternate(launched, client, "Count to")   # between the two replicas

        # x-request-id passes through the router, both ways, and names the reply
        r = httpx.post(f"{launched.url}/v1/completions", timeout=120,
                       json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
                       headers={"x-request-id": "through-the-router-1"})
        assert r.status_code == 200
        assert r.headers["x-request-id"] == "through-the-router-1"
        assert r.json()["id"] == "cmpl-through-the-router-1"

        # a seeded stream through the router is the same bytes as straight from a replica
        # (the other one: its prefix cache has not seen the prompt either, so even the
        # usage's cached_tokens match)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story."}],
                "max_tokens": 24, "temperature": 1.0, "seed": 1234, "stream": True,
                "stream_options": {"include_usage": True}}
        via_router, delta = _where(launched,
                                   lambda: _raw_stream(launched.url, body, "same-stream-1"))
        other = launched.replicas[delta.index(0)][1]
        direct = _raw_stream(other, body, "same-stream-1")
        (routed, t1), (straight, t2) = _without_created(via_router), _without_created(direct)
        assert routed == straight
        assert routed.endswith(b"data: [DONE]\n\n") and routed.count(b"data: ") > 10
        assert len(t1) == len(t2) == 1                       # one timestamp per stream

        # kill replica 1: the launcher reports it, later requests succeed on replica 0
        pid, url = launched.replicas[1]
        os.kill(pid, signal.SIGKILL)
        launched.wait_for_log(rf"replica 1 \(pid {pid}, {re.escape(url)}\) killed by SIGKILL")
        launched.wait_for_log(r"router: replica 1 taken out")
        assert launched.proc.poll() is None                  # the cluster serves on
        for i in range(4):
            reply = client.completions.create(model="tiny", prompt=f"After {i}:", max_tokens=2)
            assert reply.choices[0].finish_reason == "length"
        assert _served(launched.replicas[0][1]) >= 2 + 4 + 1
    finally:
        rc = _stop(launched)
    assert rc == 0, launched.log()[-4000:]
    log = launched.log()
    assert "SIGTERM: stopping the cluster" in log and "cluster stopped" in log
    assert "replica 0 exited with status 0" in log and "router exited" in log
    leaders = {pid for pid, _ in launched.replicas.values()} | {launched.router_pid}
    assert _sessions_alive(leaders) == []


def test_a_dead_replica_is_started_again_and_rejoins_the_router(tmp_path):
    """The default: a replica that dies is taken out, started again on its port after
    1 s, and put back into the router once healthy; requests alternate again."""
    launched = _launch(tmp_path, "round_robin")
    try:
        client = _client(launched.url)
        pid, url = launched.replicas[1]
        os.kill(pid, signal.SIGKILL)
        launched.wait_for_log(r"router: replica 1 taken out")
        launched.wait_for_log(r"replica 1: starting again in 1s")
        new_pid = int(launched.wait_for_log(
            rf"replica 1: pid (\d+), {re.escape(url)}, started again \(restart 1\)").group(1))
        assert new_pid != pid
        launched.wait_for_log(r"router: replica 1 back in", timeout=START_TIMEOUT_S)
        _assert_alternate(launched, client, "Again")       # both serve again
    finally:
        rc = _stop(launched)
    assert rc == 0, launched.log()[-4000:]
    assert "replica 1 exited with status 0" in launched.log()    # the new one drained
    leaders = {pid for pid, _ in launched.replicas.values()} | {launched.router_pid, new_pid}
    assert _sessions_alive(leaders) == []


def test_cache_aware_sends_a_shared_prefix_to_one_replica_which_reuses_its_cache(tmp_path):
    launched = _launch(tmp_path, "cache_aware")
    try:
        client = _client(launched.url)
        prefix = ("You are a careful assistant. Here is the document to answer from: "
                  + " ".join(f"Fact {i}: the value of item {i} is {i * 7}." for i in range(14)))
        answers, places = [], []
        for question in ("What is the value of item 3?", "What is the value of item 12?"):
            reply, delta = _where(launched, lambda: client.chat.completions.create(
                model="tiny", max_tokens=2,
                messages=[{"role": "system", "content": prefix},
                          {"role": "user", "content": question}]))
            assert sorted(delta) == [0, 1], delta
            answers.append(reply)
            places.append(delta.index(1))
        assert places[0] == places[1]                        # the same replica
        first, second = (a.usage.prompt_tokens_details.cached_tokens for a in answers)
        assert answers[0].usage.prompt_tokens > 150
        assert second > 150 and second > first               # it reused the shared prefix

        # SIGTERM while a stream runs through the router: the replicas drain first, so
        # the stream ends normally before anything stops
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 40,
                "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=120) as http:
            with http.stream("POST", f"{launched.url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                chunks = r.iter_bytes()
                raw = next(chunks)
                launched.proc.send_signal(signal.SIGTERM)
                raw += b"".join(chunks)
        events = [e for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]" and b'"error"' not in raw
        assert b'"finish_reason":"length"' in raw           # all 40 tokens
    finally:
        rc = _stop(launched)
    assert rc == 0, launched.log()[-4000:]
    assert "SIGTERM: stopping the cluster" in launched.log()
    leaders = {pid for pid, _ in launched.replicas.values()} | {launched.router_pid}
    assert _sessions_alive(leaders) == []
