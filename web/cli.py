"""`tailrace` command line: serve, cluster, bench serve, bench throughput, replay.

The flags and the dispatch; what each command runs lives elsewhere (serve:
web/server.py, cluster: pipeline/tools/cluster.py, bench: web/bench/ and pipeline/tools/bench.py,
replay: pipeline/tools/replay.py, the children: web/child.py).

`serve` flags are named as vLLM names them; each maps onto one EngineConfig
field. serve binds its socket and serves it first (a taken port fails at once,
before the model loads; every request, /health included, gets 503 while it
loads), then loads the model and starts the engine (pipeline.core.engine.open_engine),
then serves the app on that socket and prints one machine-readable line on stdout:

    tailrace: listening on http://127.0.0.1:8000

(with the real port when --port 0 was given). Shutdown: web/server.py.
"""
from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from functools import partial

from pipeline.core.config import engine_config
from web.serve_args import add_log_format_argument, add_serve_arguments, app_config, string_list  # noqa: F401
from web.server import listen_socket, serve_model

log = logging.getLogger("tailrace")


def build_parser(*, with_bench: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tailrace", description="An OpenAI-compatible LLM inference server on trio.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="Serve the OpenAI API over HTTP.",
                                description="Serve the OpenAI API over HTTP.")
    add_serve_arguments(serve)
    serve.set_defaults(func=partial(run_serve, serve))

    cluster = commands.add_parser(
        "cluster", help="Serve N replicas on this machine behind vllm-router.",
        description="Start N `tailrace serve` replicas and vllm-router in front of them "
                    "(pip install 'tailrace[cluster]'). Every flag not listed here goes to "
                    "each replica's `tailrace serve` (model, --max-model-len, ...). "
                    "See docs/scaling.md.")
    from pipeline.tools import cluster_args
    cluster_args.add_arguments(cluster)
    cluster.set_defaults(func=partial(run_cluster, cluster))

    bench = commands.add_parser("bench", help="Benchmarks.", description="Benchmarks.")
    kinds = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    bench_serve = kinds.add_parser("serve", help="Load-test a running server over HTTP.")
    bench_throughput = kinds.add_parser("throughput",
                                        help="Offline throughput of the engine, no HTTP.")
    replay = commands.add_parser("replay", help="Re-run an --event-log and check every reply byte.",
                                 description="Re-run detokenize, parse, account and emit from an "
                                             "event log and compare with the bytes clients got.")
    replay.set_defaults(func=_run_replay, replay_parser=replay)
    from pipeline.tools.replay import add_arguments as add_replay_arguments
    add_replay_arguments(replay)
    if with_bench:
        # Imported only when asked for: pipeline.tools.bench pulls in torch.
        from web.bench import serve as bench_serve_module
        bench_serve_module.add_arguments(bench_serve)
        bench_serve.set_defaults(func=bench_serve_module.main)
        from pipeline.tools import bench as bench_throughput_module
        bench_throughput_module.add_arguments(bench_throughput)
        bench_throughput.set_defaults(func=bench_throughput_module.main)
        for p in (bench_serve, bench_throughput):
            add_log_format_argument(p)
    return parser


def _run_replay(args: argparse.Namespace) -> int:
    from pipeline.tools.replay import main as replay_main

    return replay_main(args)


def dashed(arg: str) -> str:
    """A flag spelled with underscores (`--max_model_len=8`) as its dashed name
    (`--max-model-len=8`): vLLM accepts both. Values are left alone."""
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value


def main(argv: Sequence[str] | None = None) -> int:
    argv = [dashed(a) for a in (sys.argv[1:] if argv is None else argv)]
    parser = build_parser(with_bench=bool(argv) and argv[0] == "bench")
    if argv and argv[0] == "cluster":
        # the launcher's flags; the rest is each replica's `tailrace serve` command line
        args, args.serve_args = parser.parse_known_args(argv)
    else:
        args = parser.parse_args(argv)
    args.argv = argv
    if args.command == "bench":
        from pipeline.core.logs import configure as configure_logs

        configure_logs("info", args.log_format)
    return int(args.func(args) or 0)


# -- cluster -------------------------------------------------------------------

def run_cluster(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from pipeline.tools import cluster

    from pipeline.core.logs import configure as configure_logs

    configure_logs("info", _peek_log_format(args.serve_args))
    logging.getLogger("httpx").setLevel(logging.WARNING)      # one line per /health poll
    if not (args.prefill or args.decode) and not cluster.router_installed():
        log.error(cluster.MISSING_ROUTER)      # (the P/D proxy is tailrace's own)
        return 2
    # the replicas' flags, checked here once rather than failing in every replica
    serve_parser = argparse.ArgumentParser(prog="tailrace cluster ... (serve flags)")
    add_serve_arguments(serve_parser)
    try:
        checked = serve_parser.parse_args([*args.serve_args, "--port", "0"])
        engine_config(checked)
        app_config(checked)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    except SystemExit:
        parser.error(f"bad `tailrace serve` flags for the replicas: {' '.join(args.serve_args)}")
    try:
        from pipeline.tools.cluster_args import config_from_args
        config = config_from_args(args, args.serve_args)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    return cluster.run(config)


# -- serve ---------------------------------------------------------------------

def run_serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    try:
        config = engine_config(args)
        web_config = app_config(args)
        if config.pooling and args.api_server_count is not None:
            raise ValueError("--api-server-count does not combine with a pooling model (--runner pooling) yet")
        if config.pooling and args.data_parallel_size > 1:
            raise ValueError("--data-parallel-size does not combine with a pooling model (--runner pooling) yet")
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    from pipeline.core.logs import configure as configure_logs

    configure_logs(args.log_level, args.log_format)
    try:
        sock = listen_socket(args.host, args.port)
    except OSError as exc:
        log.error("tailrace serve: cannot listen on %s: %s", _bind(args.host, args.port),
                  exc.strerror or exc)
        return 1
    if args.api_server_count is not None or args.data_parallel_size > 1:
        from pipeline.layouts import procs
        from web import child

        try:
            return procs.run(args.api_server_count or 1, sock,
                             engine_command=partial(child.engine_command, args.argv[1:]),
                             frontend_command=partial(child.frontend_command,
                                                      log_level=args.log_level,
                                                      log_format=args.log_format),
                             engines=args.data_parallel_size)
        finally:
            sock.close()
    try:
        import trio

        from pipeline.core.parts import pick_device
        from pipeline.core.startup import check_tensor_parallel

        try:
            check_tensor_parallel(config, pick_device(config.device))
        except ValueError as exc:
            parser.error(str(exc))
        return trio.run(partial(serve_model, config, sock, app_config=web_config,
                                log_level=args.log_level,
                                graceful_timeout=args.graceful_timeout))
    except Exception as exc:  # start-up failures (model), or the engine crashed
        from pipeline.core.reply import describe

        log.error("tailrace serve failed: %s", describe(exc))
        log.debug("details", exc_info=True)
        return 1
    finally:
        sock.close()          # a no-op once Hypercorn has taken it


def _peek_log_format(serve_args: Sequence[str]) -> str:
    """The replicas' --log-format, which the cluster launcher writes its own logs in too."""
    peek = argparse.ArgumentParser(add_help=False)
    add_log_format_argument(peek)
    known, _ = peek.parse_known_args(list(serve_args))
    return known.log_format


def _bind(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


if __name__ == "__main__":
    sys.exit(main())
