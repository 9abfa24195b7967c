"""What the reliability tests (and a few e2e ones) share: a real server (engine + Hypercorn on 127.0.0.1, port
0) in this trio run, in a thread of its own, or as a `tailrace serve` subprocess; and the
figures they measure (trio tasks, reply channels, KV blocks, RSS).

Every case runs on loopback only and is bounded in time (trio.fail_after / timeouts).
Set TAILRACE_RELIABILITY_REPORT=PATH to collect each case's figures as JSON lines
(docs/reliability.md lists them).
"""
from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from functools import partial
from pathlib import Path

import attrs
import orjson
import trio

from pipeline.core.config import EngineConfig
from pipeline.core.engine import Engine, open_engine
from web.app import AppConfig
from web.server import LISTENING_PREFIX, listen_socket, serve
from pipeline.layouts.process import death_hook  # test servers die with pytest

REPORT_ENV = "TAILRACE_RELIABILITY_REPORT"
START_TIMEOUT_S = 300        # a model load on a busy 2-core CI box
SMALL = dict(max_model_len=128, max_num_seqs=16)   # short requests only: fast steps


def engine_config(**overrides) -> EngineConfig:
    return EngineConfig(**{**SMALL, **overrides})


@contextlib.asynccontextmanager
async def served(smollm, app_config: AppConfig = AppConfig(), *, graceful_timeout: float = 5.0,
                 shutdown: trio.Event | None = None, abort: trio.Event | None = None,
                 **engine_overrides) -> AsyncIterator[tuple[Engine, str]]:
    """The shared SmolLM2 behind a running engine and a real HTTP server in this trio run:
    ``async with served(smollm, max_num_seqs=4) as (engine, url)``. The server stops when the
    block ends (or drains, when the caller sets `shutdown`)."""
    async with open_engine(engine_config(**engine_overrides), loaded=smollm) as engine:
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(partial(
                serve, engine, listen_socket("127.0.0.1", 0), app_config=app_config,
                log_level="warning", graceful_timeout=graceful_timeout, shutdown=shutdown,
                abort=abort))
            yield engine, binds[0]
            nursery.cancel_scope.cancel()


@attrs.define
class ThreadedServer:
    """A server in its own trio run, in a thread: for synchronous tests (hypothesis)."""
    url: str
    engine: Engine
    token: trio.lowlevel.TrioToken

    def call(self, fn, *args):
        """Run a synchronous function in the server's trio thread."""
        return trio.from_thread.run_sync(fn, *args, trio_token=self.token)


@contextlib.contextmanager
def threaded_server(smollm, app_config: AppConfig = AppConfig(), *, patch=None,
                    **engine_overrides) -> Iterator[ThreadedServer]:
    """`patch(engine)` runs in the server's thread once the engine is up."""
    ready: dict = {}
    started = threading.Event()
    stop = threading.Event()

    async def main() -> None:
        async with served(smollm, app_config, **engine_overrides) as (engine, url):
            if patch is not None:
                patch(engine)
            ready["server"] = ThreadedServer(url, engine, trio.lowlevel.current_trio_token())
            started.set()
            while not stop.is_set():
                await trio.sleep(0.05)

    def run() -> None:
        try:
            trio.run(main)
        except BaseException as exc:   # reported to the test below
            ready["error"] = exc
            started.set()

    thread = threading.Thread(target=run, name="tailrace-test-server", daemon=True)
    thread.start()
    started.wait(START_TIMEOUT_S)
    if "error" in ready:
        raise ready["error"]
    try:
        yield ready["server"]
    finally:
        stop.set()
        thread.join(30)
    if "error" in ready:
        raise ready["error"]


# -- a `tailrace serve` subprocess ------------------------------------------------------------

@attrs.frozen
class Process:
    url: str
    proc: subprocess.Popen
    stdout: Path
    stderr: Path

    def signal(self, signum: int = signal.SIGTERM) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def logs(self) -> str:
        return self.stdout.read_text(errors="replace") + self.stderr.read_text(errors="replace")


def _command() -> list[str]:
    exe = Path(sys.executable).with_name("tailrace")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "web.cli"]


@contextlib.contextmanager
def tailrace_serve(tmp: Path, *flags: str, env: dict | None = None) -> Iterator[Process]:
    """`tailrace serve --port 0 --max-model-len 128 ...FLAGS` until its listening line; killed
    at the end if still running."""
    out, err = tmp / "stdout.txt", tmp / "stderr.txt"
    environ = {**os.environ, "TQDM_DISABLE": "1", **(env or {})}
    with open(out, "wb") as out_f, open(err, "wb") as err_f:
        proc = subprocess.Popen(_command() + ["serve", "--port", "0", "--max-model-len", "128",
                                              "--dtype", "float32", *flags],
                                stdout=out_f, stderr=err_f, env=environ,
                                preexec_fn=death_hook())
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            lines = [ln for ln in out.read_text(errors="replace").splitlines()
                     if ln.startswith(LISTENING_PREFIX)]
            if lines:
                break
            if proc.poll() is not None:
                raise RuntimeError(f"tailrace serve exited with {proc.returncode}:\n"
                                   f"{err.read_text(errors='replace')[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError("tailrace serve did not start in time")
            time.sleep(0.1)
        yield Process(lines[0][len(LISTENING_PREFIX):].strip(), proc, out, err)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- SSE ----------------------------------------------------------------------------------------

def sse_events(raw: bytes) -> list[bytes]:
    """The data payloads of an SSE body, in order (b"[DONE]" included)."""
    return [block[len(b"data: "):] for block in raw.split(b"\n\n") if block.startswith(b"data: ")]


# -- figures ----------------------------------------------------------------------------------

def trio_task_count() -> int:
    """Every task alive in the current trio run."""
    def count(task) -> int:
        return 1 + sum(count(child) for nursery in task.child_nurseries
                       for child in nursery.child_tasks)

    return count(trio.lowlevel.current_root_task())


def memory_channel_count() -> int:
    """Memory channel ends alive in this process (reply channels included)."""
    gc.collect()
    kinds = (trio.MemorySendChannel, trio.MemoryReceiveChannel)
    return sum(1 for obj in gc.get_objects() if type(obj) in kinds)


def rss_bytes(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def engine_figures(engine: Engine) -> dict:
    stats = engine.stats()
    return {"running": stats.num_running, "waiting": stats.num_waiting,
            "kv_blocks_used": stats.kv_blocks_used, "in_flight": len(engine.replies),
            "admitted": engine.replies.num_admitted}


async def settled(engine: Engine, timeout: float = 30.0) -> dict:
    """Wait until nothing is in flight and every KV block is free; the engine's figures."""
    with trio.fail_after(timeout):
        while True:
            figures = engine_figures(engine)
            if not any(figures.values()):
                return figures
            await trio.sleep(0.02)


def record(case: str, **figures) -> None:
    """One line of figures for docs/reliability.md (when TAILRACE_RELIABILITY_REPORT is set)."""
    print(f"\n[reliability] {case}: {figures}")
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "ab") as f:
            f.write(orjson.dumps({"case": case, **figures}) + b"\n")
