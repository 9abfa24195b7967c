"""The child processes of `tailrace serve --api-server-count N`: their entry point and
command lines, which web/cli.py hands to pipeline/layouts/procs.py to start:

    python -m web.child engine --dp-rank R --fds A0,A1.. -- SERVE_ARGS  (admit, schedule, GPU step)
    python -m web.child frontend --index K --engine-fds B0,B1.. --listen-fd L --log-level LEVEL
                                 --log-format FORMAT            (HTTP, no torch)

With --data-parallel-size D there are D engine processes (ranks 0..D-1) and each
frontend holds one link to each of them.

Here in web/ because a frontend runs the HTTP server (web/server.py) and the engine
parses the `serve` flags (web/cli.py's parser) once for every frontend; pipeline/ only
spawns and supervises the children by command line. A child's own flags (the fds it
inherits) are parsed here rather than in web/cli.py, which imports the engine's config and
so torch: a frontend never loads it. Each child dies with its parent, first thing.
"""
from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
from collections.abc import Sequence
from functools import partial

import trio

from pipeline.layouts.process import die_with_parent, python_command, runner_switch_interval

log = logging.getLogger("tailrace")

MODULE = "web.child"


def engine_command(serve_args: Sequence[str], rank: int, fds: Sequence[int]) -> list[str]:
    """Engine `rank` (data parallel): the fds of its ends of the socketpairs, and the whole
    `serve` command line (less `serve`), which it parses once for every frontend."""
    return python_command(MODULE, "engine", "--dp-rank", str(rank), "--fds",
                          ",".join(map(str, fds)), "--", *serve_args)


def frontend_command(index: int, engine_fds: Sequence[int], listen_fd: int, *, log_level: str,
                     log_format: str) -> list[str]:
    """Frontend `index`: its ends of its socketpairs with the engines, the listening socket;
    its other settings come from the engines (FrontendSetup) once the model has loaded."""
    return python_command(MODULE, "frontend", "--index", str(index), "--engine-fds",
                          ",".join(map(str, engine_fds)), "--listen-fd", str(listen_fd),
                          "--log-level", log_level, "--log-format", log_format)


def build_parser() -> argparse.ArgumentParser:
    """The flags of the command lines above."""
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    kinds = p.add_subparsers(dest="kind", required=True)
    e = kinds.add_parser("engine")
    e.add_argument("--fds", required=True)
    e.add_argument("--dp-rank", type=int, default=0)
    e.add_argument("serve_args", nargs=argparse.REMAINDER)
    f = kinds.add_parser("frontend")
    f.add_argument("--index", type=int, required=True)
    f.add_argument("--engine-fds", required=True)
    f.add_argument("--listen-fd", type=int, required=True)
    f.add_argument("--log-level", default="info")
    f.add_argument("--log-format", default="text")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    die_with_parent()
    args = build_parser().parse_args(argv)
    if args.kind == "engine":
        serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
        return engine_main(args.fds, serve_args, args.dp_rank)
    return frontend_main(args.index, [int(fd) for fd in args.engine_fds.split(",")],
                         args.listen_fd, args.log_level, args.log_format)


def engine_main(fds: str, serve_args: list[str], dp_rank: int = 0) -> int:
    """Engine `dp_rank`: parse the `serve` flags once, for every frontend (their
    FrontendSetup), then run the engine over the socketpairs `fds` until its last
    frontend has gone. With data parallel on the CPU each engine takes its share of the
    cores (unless OMP_NUM_THREADS says); on CUDA engine R takes the devices from R * TP."""
    from pipeline.core.config import engine_config
    from pipeline.core.logs import configure
    from pipeline.core.reply import describe
    from pipeline.layouts.engine_proc import run_engine
    from pipeline.layouts.wire import FrontendSetup
    from web.serve_args import add_serve_arguments, app_config

    parser = argparse.ArgumentParser(prog="tailrace serve")
    add_serve_arguments(parser)
    serve = parser.parse_args(list(serve_args))
    configure(serve.log_level, serve.log_format)
    cfg = data_parallel_config(engine_config(serve), serve.data_parallel_size, dp_rank)
    setup = FrontendSetup(index=0, side=None, app_config=app_config(serve), graceful_timeout=serve.graceful_timeout,
                          event_log_max_bytes=cfg.event_log_max_bytes,
                          event_log_backup_count=cfg.event_log_backup_count)
    socks = [socket.socket(fileno=int(fd)) for fd in fds.split(",")]
    # Ctrl-C reaches the parent, which drains the frontends: the engine stops with them
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with runner_switch_interval():      # this process runs the GPU step
            return trio.run(partial(run_engine, cfg, socks, setup, dp_rank=dp_rank,
                                    data_parallel=serve.data_parallel_size > 1))
    except Exception as exc:
        log.error("tailrace engine process failed: %s", describe(exc))
        log.debug("details", exc_info=True)
        return 1


def data_parallel_config(cfg, size: int, rank: int):
    """Engine `rank` of `size`'s config: its device (cuda:R*TP on CUDA; on the CPU a share
    of the threads), its event log's path (PATH.engine-R past rank 0), and with the KV
    connector its own engine id (ID_dpR, as vLLM names them) and side channel port (the
    given one + R; 0 stays any)."""
    import os

    import attrs
    import torch

    if size <= 1:
        return cfg
    changes = {}
    if cfg.event_log is not None and rank > 0:
        changes["event_log"] = f"{cfg.event_log}.engine-{rank}"
    kv = cfg.kv_transfer_config
    if kv is not None:
        port = kv.side_channel_port + rank if kv.side_channel_port else 0
        changes["kv_transfer_config"] = attrs.evolve(
            kv, engine_id=f"{kv.engine_id}_dp{rank}", side_channel_port=port)
    cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
    if cuda:
        first = int(cfg.device.split(":")[1]) if ":" in cfg.device else 0
        changes["device"] = f"cuda:{first + rank * cfg.tensor_parallel_size}"
    elif "OMP_NUM_THREADS" not in os.environ:
        share = (os.cpu_count() or 1) // (size * cfg.tensor_parallel_size)
        torch.set_num_threads(max(1, share))
    return attrs.evolve(cfg, **changes)


def frontend_main(index: int, engine_fds: list[int], listen_fd: int, log_level: str,
                  log_format: str) -> int:
    """Frontend `index`: serve the inherited listening socket over the engines' links."""
    from pipeline.core.logs import configure
    from pipeline.core.reply import describe
    from web.server import serve_frontend

    configure(log_level, log_format)
    engine_socks = [socket.socket(fileno=fd) for fd in engine_fds]
    sock = socket.socket(fileno=listen_fd)
    try:
        return trio.run(partial(serve_frontend, engine_socks, sock, index=index,
                                log_level=log_level))
    except Exception as exc:
        log.error("tailrace frontend %d stopped: %s", index, describe(exc))
        log.debug("details", exc_info=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
