"""For tests/procs and tests/tp: real `tailrace serve --api-server-count N` servers (the bundled SmolLM2 on the CPU),
and what the tests read of their processes from /proc (no psutil)."""
from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs
import httpx
import pytest
from pipeline.layouts.process import death_hook  # test servers die with pytest

LISTENING = "tailrace: listening on "
START_TIMEOUT_S = 300
STOP_TIMEOUT_S = 60
FLAGS = ("--max-model-len", "512", "--dtype", "float32", "--log-level", "warning")


@attrs.frozen
class Server:
    url: str
    proc: subprocess.Popen
    err: Path

    @property
    def event_log(self) -> Path:
        return self.err.parent / "events.jsonl"

    def children(self) -> dict[str, list[int]]:
        """{'engine': [pid], 'frontend': [pid, ...]} among the server's child processes."""
        out: dict[str, list[int]] = {"engine": [], "frontend": []}
        for pid, ppid, cmd in processes():
            if ppid == self.proc.pid:
                for kind in out:
                    if f"web.child\0{kind}" in cmd:
                        out[kind].append(pid)
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def processes():
    """(pid, ppid, command line with NULs) of every process, from /proc."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        yield int(entry), int(fields[1]), cmd


def process_group(pgid: int) -> list[int]:
    """The live (not zombie) processes of a process group."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry))
    return out


def server_side_inode(server_port: int, client_port: int) -> str:
    """The socket inode of the server's end of one TCP connection (/proc/net/tcp)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local_port = int(fields[1].split(":")[1], 16)
        remote_port = int(fields[2].split(":")[1], 16)
        if local_port == server_port and remote_port == client_port:
            return fields[9]
    raise AssertionError("no such connection")


def holder(pids: list[int], inode: str) -> int:
    """Which of `pids` holds the socket `inode` (the frontend that accepted a connection)."""
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                    return pid
            except OSError:
                continue
    raise AssertionError("no frontend holds the connection")


def scrape_on_new_connection(server: Server) -> tuple[int, dict[str, float]]:
    """GET /metrics on a connection of its own: (the pid of the frontend that accepted
    it, read from /proc while the connection is still open; the samples, as `metrics`)."""
    pid, status, text = on_new_connection(server, "GET", "/metrics")
    assert status == 200, text
    return pid, _samples(text)


def on_new_connection(server: Server, method: str, path: str, body: bytes | None = None,
                      timeout: float = 30) -> tuple[int, int, str]:
    """One request on a connection of its own: (the pid of the frontend that accepted it,
    read from /proc while the connection is still open; the status; the body)."""
    host, port = server.url.rsplit("//", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request(method, path, body=body,
                     headers={"Content-Type": "application/json"} if body else {})
        reply = conn.getresponse()
        text = reply.read().decode()
        pid = holder(server.children()["frontend"],
                     server_side_inode(int(port), conn.sock.getsockname()[1]))
    finally:
        conn.close()
    return pid, reply.status, text


def json_on_new_connection(server: Server, method: str, path: str, body: dict | None = None,
                           timeout: float = 120) -> tuple[int, int, object]:
    """on_new_connection with a JSON body: (pid, status, the JSON reply, or its text when
    it is not JSON)."""
    pid, status, text = on_new_connection(server, method, path,
                                          None if body is None else json.dumps(body).encode(), timeout)
    try:
        return pid, status, json.loads(text)
    except ValueError:
        return pid, status, text


def wait_for(predicate, timeout: float = 30.0, what: str = "condition"):
    """Poll until `predicate()` is truthy; an HTTP error (a busy machine's timeout) counts
    as not yet."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        try:
            value = predicate()
        except httpx.HTTPError as exc:
            value, last = None, exc
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what} (last error: {last!r})")
        time.sleep(0.1)


def start(tmp: Path, *flags: str, env: dict[str, str] | None = None) -> Server:
    """A server with these flags (and `env` added to the environment), once it answers."""
    out, err = tmp / "stdout.txt", tmp / "stderr.txt"
    env = {**os.environ, "TQDM_DISABLE": "1", **(env or {})}
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen([sys.executable, "-m", "web.cli", "serve", "--port", "0",
                                 *FLAGS, *flags], stdout=o, stderr=e, env=env,
                                preexec_fn=death_hook())
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        text = out.read_text(errors="replace")
        lines = [ln for ln in text.splitlines() if ln.startswith(LISTENING)]
        if lines:
            url = lines[0][len(LISTENING):].strip()
            break
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the server did not start:\n{err.read_text()[-3000:]}")
        time.sleep(0.2)
    server = Server(url, proc, err)
    # every frontend answers once the engine is up: /health is 200 on any of them
    wait_for(lambda: httpx.get(f"{url}/health", timeout=30).status_code == 200, 120,
             "/health 200")
    return server


def metrics(url: str) -> dict[str, float]:
    """The unlabelled and model-labelled samples of /metrics, by name."""
    return _samples(httpx.get(f"{url}/metrics", timeout=30).text)


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.rsplit(" ", 1)
        out[name.split("{")[0] if "model_name" in name and "," not in name else name] = float(value)
    return out
