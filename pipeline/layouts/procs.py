"""`tailrace serve --api-server-count N`: one engine process and N frontend processes.

The parent binds the listening socket once (web/cli.py, before anything loads), makes
one socketpair per frontend, and starts fresh interpreters (pipeline/layouts/process.py)
on the command lines it is given; web/cli.py gives these, to its children's entry point
(web/child.py):

    python -m web.child engine --fds A0,A1.. -- SERVE_ARGS                   (admit, schedule, GPU)
    python -m web.child frontend --index K --engine-fd BK --listen-fd L ...  (HTTP, no torch)

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

import logging
import socket
from collections.abc import Callable, Sequence

import trio

from pipeline.layouts import process

log = logging.getLogger("tailrace")

# the engine process's command line, given the fds of its ends of the socketpairs
EngineCommand = Callable[[Sequence[int]], list[str]]
# frontend K's command line, given K, the fd of its end of its socketpair, the listening fd
FrontendCommand = Callable[[int, int, int], list[str]]


def run(count: int, sock: socket.socket, engine_command: EngineCommand,
        frontend_command: FrontendCommand) -> int:
    """Serve `sock` with one engine process and `count` frontends until they have all
    exited; 0 when each exited 0, else 1."""
    return trio.run(supervise, count, sock, engine_command, frontend_command)


async def supervise(count: int, sock: socket.socket, engine_command: EngineCommand,
                    frontend_command: FrontendCommand) -> int:
    pairs = [socket.socketpair() for _ in range(count)]
    engine_fds = [a.fileno() for a, _ in pairs]
    engine = process.spawn(engine_command(engine_fds), pass_fds=engine_fds, process_group=0)
    frontends = []
    for k, (_, b) in enumerate(pairs):
        frontends.append(process.spawn(
            frontend_command(k, b.fileno(), sock.fileno()),
            pass_fds=[b.fileno(), sock.fileno()], process_group=engine.pid))
    for a, b in pairs:           # the children hold them now
        a.close()
        b.close()
    sock.close()
    log.info("engine process %d, frontend processes %s", engine.pid,
             ", ".join(str(p.pid) for p in frontends))
    codes = await process.supervise([engine, *frontends], forward_to=frontends)
    if any(codes):
        log.error("exit codes: engine %s, frontends %s", codes[0], codes[1:])
    return 0 if not any(codes) else 1
