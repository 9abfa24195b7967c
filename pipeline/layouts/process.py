"""Process code of the layouts: starting fresh interpreters, waiting on them, tying their
lives to the parent's, forwarding signals; and the one process-wide setting of a process
that runs the GPU step.

Children are fresh interpreters (`python_command`), never a fork of a process that has
imported torch (a forked CUDA context, or OpenMP's threads, do not survive the fork).
They are started with `spawn` on the main thread and call `die_with_parent` first thing,
so that nothing outlives a parent that is killed. `wait` waits on one without a thread;
`supervise` waits on them all, forwards SIGINT/SIGTERM and kills what is left.

Torch-free: a frontend process imports it.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence

import trio

KILL_AFTER_S = 30.0      # after the first signal forwarded, before every child is killed

# The interpreter's switch interval while a GPU stage runs (CPython's default: 5 ms).
# The runner thread (stages/gpu_step.py) takes the GIL back after every wait on the device
# (and after each torch call that releases it); while the event loop runs Python code, a
# thread that wants the GIL gets it only when the holder is asked to drop it, one switch
# interval later. At 5 ms that can be more than a whole GPU step; at 0.1 ms the runner's
# wait is bounded by a few percent of a step, and the loop pays a few µs a switch only
# while the runner wants the GIL (docs/benchmarks.md, "switch interval"). It is the
# process's setting, so the runtime that starts the engine sets it, not the stage.
SWITCH_INTERVAL_S = 1e-4


def python_command(module: str, *args: str) -> list[str]:
    """The command line of a fresh interpreter running `python -m module args`."""
    return [sys.executable, "-m", module, *args]


def spawn(command: Sequence[str], **options) -> subprocess.Popen:
    """Start a child (subprocess.Popen's options). Call it on the main thread: a child's
    PR_SET_PDEATHSIG fires when the *thread* that forked it exits, and trio retires its
    idle worker threads (which is why this is not trio's open_process, which forks from
    one)."""
    return subprocess.Popen(list(command), **options)


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent exits (no orphans). A child calls
    it before anything else; if the parent has already gone, it exits at once."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)           # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:                       # the parent died before the prctl
        os._exit(1)


def death_hook():
    """subprocess.Popen's preexec_fn that makes the child die with this process: die_with_parent
    when called on the main thread, else None (PR_SET_PDEATHSIG fires when the forking
    *thread* exits, so a child forked from a pool thread would die with that thread)."""
    return die_with_parent if threading.current_thread() is threading.main_thread() else None


async def wait(proc: subprocess.Popen) -> int:
    """Until `proc` exits, without a thread: its pidfd becomes readable. Its exit code."""
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


def kill_all(procs: Sequence[subprocess.Popen]) -> None:
    """SIGKILL to each of `procs` still running."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()


async def supervise(everyone: Sequence[subprocess.Popen],
                    forward_to: Sequence[subprocess.Popen]) -> list[int]:
    """Until every process of `everyone` has exited, forward each SIGINT/SIGTERM this
    process gets to `forward_to` (see forward_signals). Cancelled, or on leaving by any
    road, kill the ones left: none outlives the supervision. Their exit codes, in order."""
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(forward_signals, forward_to, everyone)
            async with trio.open_nursery() as waiting:
                for proc in everyone:
                    waiting.start_soon(wait, proc)
            nursery.cancel_scope.cancel()
    finally:
        kill_all(everyone)
        with trio.CancelScope(shield=True):
            for proc in everyone:
                await wait(proc)
    return [proc.returncode for proc in everyone]


async def forward_signals(targets: Sequence[subprocess.Popen],
                          everyone: Sequence[subprocess.Popen], *,
                          kill_after_s: float = KILL_AFTER_S) -> None:
    """Each SIGINT/SIGTERM to every process of `targets` (a second one too: a server
    drains on the first and ends its requests on the second); after the third, or
    `kill_after_s` past the first, kill every process of `everyone`."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        seen = 0
        async for signum in signals:
            seen += 1
            if seen >= 3:
                break
            for proc in targets:
                if proc.poll() is None:
                    proc.send_signal(signum)
            if seen == 1:
                trio.lowlevel.spawn_system_task(_kill_later, everyone, kill_after_s)
    kill_all(everyone)


async def _kill_later(everyone: Sequence[subprocess.Popen], delay_s: float) -> None:
    await trio.sleep(delay_s)
    kill_all(everyone)


@contextlib.contextmanager
def runner_switch_interval(seconds: float = SWITCH_INTERVAL_S) -> Iterator[None]:
    """For the block, the interpreter's switch interval is at most `seconds` (see
    SWITCH_INTERVAL_S); the previous one after. Around the life of an engine whose GPU
    stage runs in this process."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(min(previous, seconds))
    try:
        yield
    finally:
        sys.setswitchinterval(previous)
