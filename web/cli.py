"""`tailrace` command line: serve, bench serve, bench throughput.

`serve` flags are named as vLLM names them; each maps onto one EngineConfig
field. Once the model is loaded and the socket is bound, serve prints one
machine-readable line on stdout:

    tailrace: listening on http://127.0.0.1:8000

(with the real port when --port 0 was given). SIGINT/SIGTERM shut down
gracefully; a second signal stops at once.
"""
from __future__ import annotations

import argparse
import logging
import signal
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
    import trio

    from pipeline.engine import Engine   # imports torch: only when serving

    try:
        engine = Engine(config)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        return trio.run(partial(serve, engine, host=args.host, port=args.port,
                                log_level=args.log_level))
    except Exception as exc:  # start-up failures (model, port in use) end here
        log.error("tailrace serve failed: %s", _describe(exc))
        log.debug("details", exc_info=True)
        return 1


def _describe(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        return _describe(exc.exceptions[0])
    return f"{type(exc).__name__}: {exc}"


def _bind(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def serve(engine, *, host: str, port: int, log_level: str = "info",
                task_status=None) -> int:
    """Serve until SIGINT/SIGTERM (or the engine stops); 0 on a clean shutdown."""
    import hypercorn.trio
    import trio
    from hypercorn.config import Config

    from web.app import create_app

    config = Config()
    config.bind = [_bind(host, port)]
    config.loglevel = log_level.upper()
    config.startup_timeout = 24 * 3600       # loading a model may take a while
    config.graceful_timeout = GRACEFUL_TIMEOUT_S
    shutdown = trio.Event()
    engine_failed: list[BaseException] = []

    def on_engine_exit(error: BaseException | None) -> None:
        if error is not None:
            engine_failed.append(error)
        log.error("the engine stopped (%s); shutting down",
                  "no error" if error is None else _describe(error))
        shutdown.set()

    app = create_app(engine, on_engine_exit=on_engine_exit)

    async with trio.open_nursery() as nursery:
        await nursery.start(_watch_signals, shutdown, nursery.cancel_scope)

        async def run_server(task_status=trio.TASK_STATUS_IGNORED) -> None:
            try:
                await hypercorn.trio.serve(app, config, shutdown_trigger=shutdown.wait,
                                           task_status=task_status)
            finally:
                nursery.cancel_scope.cancel()     # stops the signal watcher

        binds = await nursery.start(run_server)
        for bind in binds:
            print(f"{LISTENING_PREFIX}{bind}", flush=True)
        if task_status is not None:
            task_status.started(binds)
    return 1 if engine_failed else 0


async def _watch_signals(shutdown, scope, *, task_status) -> None:
    import trio

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for signum in signals:
            if shutdown.is_set():
                log.warning("second signal: stopping now")
                scope.cancel()
                return
            log.info("%s: shutting down gracefully", signal.Signals(signum).name)
            shutdown.set()


if __name__ == "__main__":
    sys.exit(main())
