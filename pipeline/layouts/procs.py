"""`tailrace serve --api-server-count N`: one engine process and N frontend processes.

The parent binds the listening socket once (web/cli.py, before anything loads), makes
one socketpair per frontend, and starts fresh interpreters (never a fork of a process
that has imported torch):

    python -m pipeline.layouts.procs engine --fds A0,A1.. -- SERVE_ARGS    (admit, schedule, GPU)
    python -m pipeline.layouts.procs frontend --index K --engine-fd BK --listen-fd L  (HTTP, no torch)

Every frontend accepts on the inherited listening socket (the kernel hands each
connection to one of them) and serves 503 until the engine has loaded the model and sent
its setup: the flags a frontend applies (API keys, CORS, limits, parsers) come from the
one parse of SERVE_ARGS in the engine process, so each applies them alike.

The children share one process group (the engine's), apart from the terminal's: the
parent forwards SIGINT/SIGTERM to the frontends, which drain as one server does (a
second signal ends the requests left, a third stops at once); the engine stops when
its last frontend has gone. Each child dies with the parent (PR_SET_PDEATHSIG), so
nothing is left behind whatever kills the parent. Exit status: 0 when every process
exited 0, else 1 (the engine died, or a frontend did).
"""
from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence

import trio

log = logging.getLogger("tailrace")

KILL_AFTER_S = 30.0      # after the signals a frontend got, before it is killed


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent exits (no orphans)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)           # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:                       # the parent died before the prctl
        os._exit(1)


def child_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.layouts.procs", *args]


# -- the parent ------------------------------------------------------------------------------
def run(serve_args: Sequence[str], count: int, sock: socket.socket, *,
        log_level: str = "info", log_format: str = "text") -> int:
    return trio.run(supervise, list(serve_args), count, sock, log_level, log_format)


async def supervise(serve_args: list[str], count: int, sock: socket.socket, log_level: str,
                    log_format: str) -> int:
    pairs = [socket.socketpair() for _ in range(count)]
    engine_fds = [a.fileno() for a, _ in pairs]
    engine = _spawn(
        child_command("engine", "--fds", ",".join(map(str, engine_fds)), "--", *serve_args),
        pass_fds=engine_fds, process_group=0)
    frontends = []
    for k, (_, b) in enumerate(pairs):
        frontends.append(_spawn(
            child_command("frontend", "--index", str(k), "--engine-fd", str(b.fileno()),
                          "--listen-fd", str(sock.fileno()), "--log-level", log_level,
                          "--log-format", log_format),
            pass_fds=[b.fileno(), sock.fileno()], process_group=engine.pid))
    for a, b in pairs:           # the children hold them now
        a.close()
        b.close()
    sock.close()
    log.info("engine process %d, frontend processes %s", engine.pid,
             ", ".join(str(p.pid) for p in frontends))
    everyone = [engine, *frontends]
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_forward_signals, frontends, everyone)
            async with trio.open_nursery() as waiting:
                for proc in everyone:
                    waiting.start_soon(_wait, proc)
            nursery.cancel_scope.cancel()
    finally:
        for proc in everyone:      # cancelled (a third signal): nothing is left behind
            if proc.poll() is None:
                proc.kill()
        with trio.CancelScope(shield=True):
            for proc in everyone:
                await _wait(proc)
    codes = [p.returncode for p in everyone]
    if any(codes):
        log.error("exit codes: engine %s, frontends %s", codes[0], codes[1:])
    return 0 if not any(codes) else 1


def _spawn(command: list[str], **options) -> subprocess.Popen:
    # Popen here, on the main thread, not trio's open_process: that runs Popen in a worker
    # thread, and PR_SET_PDEATHSIG fires when the *thread* that forked exits, which would
    # kill the children when trio retires the idle worker thread.
    return subprocess.Popen(command, **options)


async def _wait(proc: subprocess.Popen) -> int:
    """Until `proc` exits, without a thread: its pidfd becomes readable."""
    if proc.poll() is not None:
        return proc.returncode
    try:
        fd = os.pidfd_open(proc.pid)
    except ProcessLookupError:     # reaped meanwhile
        return proc.wait()
    try:
        await trio.lowlevel.wait_readable(fd)
    finally:
        os.close(fd)
    return proc.wait()


async def _forward_signals(frontends, everyone) -> None:
    """Each SIGINT/SIGTERM to every frontend; after the third (or KILL_AFTER_S past the
    first), kill every child."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        seen = 0
        async for signum in signals:
            seen += 1
            if seen >= 3:
                break
            for proc in frontends:
                if proc.poll() is None:
                    proc.send_signal(signum)
            if seen == 1:
                trio.lowlevel.spawn_system_task(_kill_later, everyone)
    for proc in everyone:
        if proc.poll() is None:
            proc.kill()


async def _kill_later(everyone) -> None:
    await trio.sleep(KILL_AFTER_S)
    for proc in everyone:
        if proc.poll() is None:
            proc.kill()


# -- the children -------------------------------------------------------------------------
def _engine_main(fds: str, serve_args: list[str]) -> int:
    from functools import partial

    from pipeline.core.config import engine_config
    from pipeline.layouts.engine_proc import run_engine
    from pipeline.core.reply import describe
    from pipeline.layouts.wire import FrontendSetup
    from web.cli import app_config, build_parser
    from web.logs import configure

    args = build_parser(with_bench=False).parse_args(["serve", *serve_args])
    configure(args.log_level, args.log_format)
    cfg = engine_config(args)
    setup = FrontendSetup(index=0, side=None, app_config=app_config(args), graceful_timeout=args.graceful_timeout,
                          event_log_max_bytes=cfg.event_log_max_bytes,
                          event_log_backup_count=cfg.event_log_backup_count)
    socks = [socket.socket(fileno=int(fd)) for fd in fds.split(",")]
    # Ctrl-C reaches the parent, which drains the frontends: the engine stops with them
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return trio.run(partial(run_engine, cfg, socks, setup))
    except Exception as exc:
        log.error("tailrace engine process failed: %s", describe(exc))
        log.debug("details", exc_info=True)
        return 1


def _frontend_main(index: int, engine_fd: int, listen_fd: int, log_level: str,
                   log_format: str) -> int:
    from functools import partial

    from pipeline.core.reply import describe
    from web.logs import configure
    from web.server import serve_frontend

    configure(log_level, log_format)
    engine_sock = socket.socket(fileno=engine_fd)
    sock = socket.socket(fileno=listen_fd)
    try:
        return trio.run(partial(serve_frontend, engine_sock, sock, index=index,
                                log_level=log_level))
    except Exception as exc:
        log.error("tailrace frontend %d stopped: %s", index, describe(exc))
        log.debug("details", exc_info=True)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    _die_with_parent()
    p = argparse.ArgumentParser(prog="python -m pipeline.layouts.procs")
    kinds = p.add_subparsers(dest="kind", required=True)
    e = kinds.add_parser("engine")
    e.add_argument("--fds", required=True)
    e.add_argument("serve_args", nargs=argparse.REMAINDER)
    f = kinds.add_parser("frontend")
    f.add_argument("--index", type=int, required=True)
    f.add_argument("--engine-fd", type=int, required=True)
    f.add_argument("--listen-fd", type=int, required=True)
    f.add_argument("--log-level", default="info")
    f.add_argument("--log-format", default="text")
    args = p.parse_args(argv)
    if args.kind == "engine":
        serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
        return _engine_main(args.fds, serve_args)
    return _frontend_main(args.index, args.engine_fd, args.listen_fd, args.log_level,
                          args.log_format)


if __name__ == "__main__":
    sys.exit(main())
