"""`tailrace serve --api-server-count N [--data-parallel-size D]`: D engine processes and N
frontend processes, every frontend linked to every engine (a socketpair per pair).

The parent binds the listening socket once (web/cli.py, before anything loads), makes
one socketpair per frontend, and starts fresh interpreters (pipeline/layouts/process.py)
on the command lines it is given; web/cli.py gives these, to its children's entry point
(web/child.py):

    python -m web.child engine --dp-rank R --fds A0,A1.. -- SERVE_ARGS      (admit, schedule, GPU)
    python -m web.child frontend --index K --engine-fds B0,B1.. --listen-fd L ...  (HTTP, no torch)

Every frontend accepts on the inherited listening socket (the kernel hands each
connection to one of them) and serves 503 until the engine has loaded the model and sent
its setup: the flags a frontend applies (API keys, CORS, limits, parsers) come from the
one parse of SERVE_ARGS in the engine process, so each applies them alike.

The children share one process group (engine 0's), apart from the terminal's: the
parent forwards SIGINT/SIGTERM to the frontends, which drain as one server does (a
second signal ends the requests left, a third stops at once); an engine stops when
its last frontend has gone. An engine that dies closes its link to every frontend, and
each frontend then stops (as vLLM's API server does when an engine core dies), so the
other engines stop too. Each child dies with the parent (PR_SET_PDEATHSIG), so
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

# engine R's command line, given R and the fds of its ends of the socketpairs (one per frontend)
EngineCommand = Callable[[int, Sequence[int]], list[str]]
# frontend K's command line, given K, the fds of its ends (one per engine), the listening fd
FrontendCommand = Callable[[int, Sequence[int], int], list[str]]


def run(count: int, sock: socket.socket, engine_command: EngineCommand,
        frontend_command: FrontendCommand, engines: int = 1) -> int:
    """Serve `sock` with `engines` engine processes and `count` frontends until they have
    all exited; 0 when each exited 0, else 1."""
    return trio.run(supervise, count, sock, engine_command, frontend_command, engines)


async def supervise(count: int, sock: socket.socket, engine_command: EngineCommand,
                    frontend_command: FrontendCommand, engines: int = 1) -> int:
    # pairs[r][k]: engine r <-> frontend k
    pairs = [[socket.socketpair() for _ in range(count)] for _ in range(engines)]
    procs = []
    for r in range(engines):
        fds = [a.fileno() for a, _ in pairs[r]]
        procs.append(process.spawn(engine_command(r, fds), pass_fds=fds,
                                   process_group=0 if r == 0 else procs[0].pid))
    frontends = []
    for k in range(count):
        fds = [pairs[r][k][1].fileno() for r in range(engines)]
        frontends.append(process.spawn(
            frontend_command(k, fds, sock.fileno()),
            pass_fds=[*fds, sock.fileno()], process_group=procs[0].pid))
    for row in pairs:            # the children hold them now
        for a, b in row:
            a.close()
            b.close()
    sock.close()
    log.info("engine processes %s, frontend processes %s",
             ", ".join(str(p.pid) for p in procs), ", ".join(str(p.pid) for p in frontends))
    codes = await process.supervise([*procs, *frontends], forward_to=frontends)
    if any(codes):
        log.error("exit codes: engines %s, frontends %s", codes[:engines], codes[engines:])
    return 0 if not any(codes) else 1
