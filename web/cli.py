"""`tailrace` command line: serve, bench serve, bench throughput.

`serve` flags are named as vLLM names them; each maps onto one EngineConfig
field. serve binds its socket first (a taken port fails at once, before the
model loads), then loads the model and starts the engine
(pipeline.engine.open_engine), then serves the app on that socket and prints
one machine-readable line on stdout:

    tailrace: listening on http://127.0.0.1:8000

(with the real port when --port 0 was given). SIGINT/SIGTERM shut down
gracefully; a second signal stops at once (a signal during the load stops it).
"""
from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
from collections.abc import Sequence
from functools import partial

from pipeline.config import add_engine_arguments, engine_config

log = logging.getLogger("tailrace")

LISTENING_PREFIX = "tailrace: listening on "
GRACEFUL_TIMEOUT_S = 5.0

def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="Address to bind (default: 127.0.0.1, loopback only; vLLM binds "
                        "0.0.0.0 - pass --host 0.0.0.0 to listen on every interface).")
    p.add_argument("--port", type=int, default=8000,
                   help="Port to bind; 0 picks a free one and prints it (default: 8000).")
    p.add_argument("--log-level", default="info",
                   choices=("debug", "info", "warning", "error", "critical"),
                   help="Log level of the server and Hypercorn (default: %(default)s).")


def build_parser(*, with_bench: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tailrace", description="An OpenAI-compatible LLM inference server on trio.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="Serve the OpenAI API over HTTP.",
                                description="Serve the OpenAI API over HTTP.")
    add_serve_arguments(serve)
    serve.set_defaults(func=partial(run_serve, serve))

    bench = commands.add_parser("bench", help="Benchmarks.", description="Benchmarks.")
    kinds = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    bench_serve = kinds.add_parser("serve", help="Load-test a running server over HTTP.")
    bench_throughput = kinds.add_parser("throughput",
                                        help="Offline throughput of the engine, no HTTP.")
    replay = commands.add_parser("replay", help="Re-run an --event-log and check every reply byte.",
                                 description="Re-run detokenize, parse, account and emit from an "
                                             "event log and compare with the bytes clients got.")
    replay.set_defaults(func=_run_replay, replay_parser=replay)
    from pipeline.replay import add_arguments as add_replay_arguments
    add_replay_arguments(replay)
    if with_bench:
        # Imported only when asked for: pipeline.bench pulls in torch.
        from web.bench import serve as bench_serve_module
        bench_serve_module.add_arguments(bench_serve)
        bench_serve.set_defaults(func=bench_serve_module.main)
        from pipeline import bench as bench_throughput_module
        bench_throughput_module.add_arguments(bench_throughput)
        bench_throughput.set_defaults(func=bench_throughput_module.main)
    return parser


def _run_replay(args: argparse.Namespace) -> int:
    from pipeline.replay import main as replay_main

    return replay_main(args)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(with_bench=bool(argv) and argv[0] == "bench")
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


# -- serve ---------------------------------------------------------------------

def run_serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    try:
        config = engine_config(args)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sock = listen_socket(args.host, args.port)
    except OSError as exc:
        log.error("tailrace serve: cannot listen on %s: %s", _bind(args.host, args.port),
                  exc.strerror or exc)
        return 1
    try:
        import trio

        from pipeline.engine import pick_device

        try:
            pick_device(config.device)
        except ValueError as exc:
            parser.error(str(exc))
        return trio.run(partial(serve_model, config, sock, log_level=args.log_level))
    except Exception as exc:  # start-up failures (model), or the engine crashed
        log.error("tailrace serve failed: %s", _describe(exc))
        log.debug("details", exc_info=True)
        return 1
    finally:
        sock.close()          # a no-op once Hypercorn has taken it


def _describe(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        return _describe(exc.exceptions[0])
    return f"{type(exc).__name__}: {exc}"


def _bind(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen_socket(host: str, port: int) -> socket.socket:
    """Bind and listen now, before the model loads: OSError when the port is taken.
    Port 0 gets a free port (serve reports the real one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # accepted sockets inherit it
    return sock


async def serve_model(config, sock: socket.socket, *, log_level: str = "info",
                      task_status=None) -> int:
    """Load the model and start the engine, then serve it on `sock` until SIGINT/SIGTERM.
    0 on a clean shutdown; an engine crash propagates (as an exception group)."""
    import trio

    from pipeline.engine import open_engine

    shutdown, serving = trio.Event(), trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(_watch_signals, shutdown, serving, nursery.cancel_scope)
        async with open_engine(config) as engine:
            async with trio.open_nursery() as server:
                binds = await server.start(partial(serve, engine, sock, log_level=log_level,
                                                   shutdown=shutdown))
                serving.set()
                if task_status is not None:
                    task_status.started(binds)
        nursery.cancel_scope.cancel()     # stops the signal watcher
    return 0


async def serve(engine, sock: socket.socket, *, log_level: str = "info", shutdown=None,
                task_status=None) -> None:
    """Serve the app of a running engine on a listening socket (listen_socket) until
    `shutdown` is set, then drain for GRACEFUL_TIMEOUT_S. Prints the listening line."""
    import hypercorn.trio
    import trio
    from hypercorn.config import Config

    from web.app import create_app

    config = Config()
    config.bind = [f"fd://{sock.detach()}"]   # Hypercorn owns the socket from here
    config.loglevel = log_level.upper()
    config.graceful_timeout = GRACEFUL_TIMEOUT_S
    shutdown = shutdown if shutdown is not None else trio.Event()
    app = create_app(engine)
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(hypercorn.trio.serve, app, config,
                                            shutdown_trigger=shutdown.wait))
        for bind in binds:
            print(f"{LISTENING_PREFIX}{bind}", flush=True)
        if task_status is not None:
            task_status.started(binds)


async def _watch_signals(shutdown, serving, scope, *, task_status) -> None:
    """First signal: a graceful shutdown (or, while the model loads, stop at once);
    a second: stop at once."""
    import trio

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for signum in signals:
            name = signal.Signals(signum).name
            if shutdown.is_set() or not serving.is_set():
                log.warning("%s: stopping now", name)
                scope.cancel()
                return
            log.info("%s: shutting down gracefully", name)
            shutdown.set()


if __name__ == "__main__":
    sys.exit(main())
