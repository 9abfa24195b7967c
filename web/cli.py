"""`tailrace` command line: serve, cluster, bench serve, bench throughput, replay.

`serve` flags are named as vLLM names them; each maps onto one EngineConfig
field. serve binds its socket and serves it first (a taken port fails at once,
before the model loads; every request, /health included, gets 503 while it
loads), then loads the model and starts the engine (pipeline.engine.open_engine),
then serves the app on that socket and prints one machine-readable line on stdout:

    tailrace: listening on http://127.0.0.1:8000

(with the real port when --port 0 was given).

Shutdown (docs/reliability.md): the first SIGINT/SIGTERM drains: new requests and
/health get 503 while the requests in flight run on, for up to --graceful-timeout
seconds; a second signal, or the timeout, ends those left with an in-band error (an
error chunk and [DONE], or a 500 body) and frees their KV blocks; then the server stops
and exits 0. A third signal, or one while the model loads, stops at once.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import socket
import sys
import weakref
from collections.abc import Sequence
from functools import partial

from pipeline.config import add_engine_arguments, byte_size, engine_config
from web.access import api_keys
from web.app import DEFAULT_MAX_REQUEST_BODY_BYTES, AppConfig

log = logging.getLogger("tailrace")

LISTENING_PREFIX = "tailrace: listening on "
GRACEFUL_TIMEOUT_S = 20.0   # leaves room under Kubernetes' default 30 s before SIGKILL
ABORT_TIMEOUT_S = 5.0       # for aborted requests to reach their readers (one engine step)
FLUSH_TIMEOUT_S = 2.0       # for Hypercorn to write the last bytes once every reply has ended
SHUTDOWN_MESSAGE = "The server is shutting down: this request was stopped before it finished."


def string_list(text: str) -> list[str]:
    """vLLM's JSON list (``'["https://a.example", "https://b.example"]'``), or a plain
    comma-separated list."""
    if text.lstrip().startswith("["):
        value = json.loads(text)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r}")
        return value
    return [part.strip() for part in text.split(",") if part.strip()]


def add_log_format_argument(p: argparse.ArgumentParser) -> None:
    from web.logs import LOG_FORMATS

    p.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                   help="How the server's own logs are written to stderr (structlog): text, "
                        "one readable line with key=value fields, or json, one JSON object "
                        "per line with the traceback in 'exception' (default: %(default)s).")


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
    add_log_format_argument(p)
    p.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="Require 'Authorization: Bearer KEY' (one of these keys) on every route "
                        "but /health, /metrics and /version. Default: the TAILRACE_API_KEY or "
                        "VLLM_API_KEY environment variable, which keeps the key out of the "
                        "process list; none: no key needed.")
    p.add_argument("--allowed-origins", type=string_list, default=None, metavar="JSON",
                   help="CORS: origins allowed to call the API, a JSON list as vLLM takes it "
                        "('[\"*\"]' for any) or comma-separated. Default: no CORS headers at all.")
    p.add_argument("--allowed-methods", type=string_list, default=["*"], metavar="JSON",
                   help="CORS: methods allowed (default: any), with --allowed-origins.")
    p.add_argument("--allowed-headers", type=string_list, default=["*"], metavar="JSON",
                   help="CORS: request headers allowed (default: any), with --allowed-origins.")
    p.add_argument("--allow-credentials", action="store_true",
                   help="CORS: allow credentials (cookies, Authorization), with --allowed-origins.")
    p.add_argument("--max-request-body-bytes", type=byte_size,
                   default=DEFAULT_MAX_REQUEST_BODY_BYTES, metavar="BYTES",
                   help="Refuse a larger request body with 413 before reading it whole "
                        "(default: 32MiB).")
    p.add_argument("--enable-log-requests", action="store_true",
                   help="Log one line per request with its prompt (see --max-log-len).")
    p.add_argument("--max-log-len", type=int, default=None, metavar="N",
                   help="Show at most N characters of a prompt in a log line (default: all).")
    p.add_argument("--graceful-timeout", type=float, default=GRACEFUL_TIMEOUT_S,
                   metavar="SECONDS",
                   help="On SIGTERM/SIGINT, how long requests in flight may run on before "
                        "they are ended with an error (default: %(default)s).")


def app_config(args: argparse.Namespace) -> AppConfig:
    """The server's settings from its flags; ValueError for a bad value."""
    if args.graceful_timeout < 0:
        raise ValueError(f"--graceful-timeout must not be negative, got {args.graceful_timeout}")
    return AppConfig(api_keys=api_keys(args.api_key),
                     allowed_origins=args.allowed_origins or (),
                     allowed_methods=args.allowed_methods, allowed_headers=args.allowed_headers,
                     allow_credentials=args.allow_credentials,
                     max_request_body_bytes=args.max_request_body_bytes,
                     enable_log_requests=args.enable_log_requests, max_log_len=args.max_log_len)


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
    from pipeline import cluster as cluster_module
    cluster_module.add_arguments(cluster)
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
        for p in (bench_serve, bench_throughput):
            add_log_format_argument(p)
    return parser


def _run_replay(args: argparse.Namespace) -> int:
    from pipeline.replay import main as replay_main

    return replay_main(args)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(with_bench=bool(argv) and argv[0] == "bench")
    if argv and argv[0] == "cluster":
        # the launcher's flags; the rest is each replica's `tailrace serve` command line
        args, args.serve_args = parser.parse_known_args(argv)
    else:
        args = parser.parse_args(argv)
    if args.command == "bench":
        from web.logs import configure as configure_logs

        configure_logs("info", args.log_format)
    return int(args.func(args) or 0)


# -- cluster -------------------------------------------------------------------

def run_cluster(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from pipeline import cluster

    from web.logs import configure as configure_logs

    configure_logs("info", _peek_log_format(args.serve_args))
    logging.getLogger("httpx").setLevel(logging.WARNING)      # one line per /health poll
    if not cluster.router_installed():
        log.error(cluster.MISSING_ROUTER)
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
        config = cluster.config_from_args(args, args.serve_args)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    return cluster.run(config)


# -- serve ---------------------------------------------------------------------

def run_serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    try:
        config = engine_config(args)
        web_config = app_config(args)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    from web.logs import configure as configure_logs

    configure_logs(args.log_level, args.log_format)
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
        return trio.run(partial(serve_model, config, sock, app_config=web_config,
                                log_level=args.log_level,
                                graceful_timeout=args.graceful_timeout))
    except Exception as exc:  # start-up failures (model), or the engine crashed
        from pipeline.engine import describe

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


def listen_socket(host: str, port: int) -> socket.socket:
    """Bind and listen now, before the model loads: OSError when the port is taken.
    Port 0 gets a free port (serve reports the real one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # accepted sockets inherit it
    return sock


async def serve_model(config, sock: socket.socket, *, app_config: AppConfig = AppConfig(),
                      log_level: str = "info", graceful_timeout: float = GRACEFUL_TIMEOUT_S,
                      task_status=None) -> int:
    """Serve `sock` at once (503 on every route while the model loads: web.app.LoadingGate),
    load the model and start the engine, then serve it until SIGINT/SIGTERM.
    0 on a clean shutdown; an engine crash propagates (as an exception group)."""
    import trio

    from pipeline.engine import open_engine
    from web.app import LoadingGate

    shutdown, abort, serving = trio.Event(), trio.Event(), trio.Event()
    gate = LoadingGate()
    async with trio.open_nursery() as nursery:
        await nursery.start(_watch_signals, shutdown, abort, serving, nursery.cancel_scope)
        async with open_http(gate, sock, log_level=log_level):
            async with open_engine(config) as engine:
                async with trio.open_nursery() as server:
                    binds = await server.start(partial(
                        serve, engine, None, app_config=app_config,
                        graceful_timeout=graceful_timeout, shutdown=shutdown, abort=abort,
                        gate=gate))
                    serving.set()
                    if task_status is not None:
                        task_status.started(binds)
        nursery.cancel_scope.cancel()     # stops the signal watcher
    return 0


async def serve(engine, sock: socket.socket | None, *, app_config: AppConfig = AppConfig(),
                log_level: str = "info", graceful_timeout: float = GRACEFUL_TIMEOUT_S,
                shutdown=None, abort=None, gate=None, task_status=None) -> None:
    """Serve the app of a running engine on a listening socket (listen_socket) until
    `shutdown` is set, then drain (see drain) and stop. Prints the listening line.

    With `gate` (a web.app.LoadingGate already served by open_http; `sock` None), open
    that gate to the app instead of starting a server of its own."""
    import trio

    from web.app import LoadingGate, create_app

    shutdown = shutdown if shutdown is not None else trio.Event()
    abort = abort if abort is not None else trio.Event()
    async with contextlib.AsyncExitStack() as stack:
        if gate is None:
            gate = LoadingGate()
            await stack.enter_async_context(open_http(gate, sock, log_level=log_level))
        event_log = getattr(engine, "event_log", None)
        if event_log is not None:   # an API key sent anywhere in a body is never logged
            event_log.secrets = frozenset(app_config.api_keys)
        gate.open(create_app(engine, app_config))
        for bind in gate.binds:
            print(f"{LISTENING_PREFIX}{bind}", flush=True)
        if task_status is not None:
            task_status.started(gate.binds)
        await shutdown.wait()
        await drain(engine, graceful_timeout, abort)
        gate.stop_serving()    # Hypercorn stops listening and closes the connections


@contextlib.asynccontextmanager
async def open_http(gate, sock: socket.socket, *, log_level: str = "info"):
    """Serve the ASGI app `gate` with Hypercorn on a listening socket for the block (its
    addresses in ``gate.binds``); at the end, or at ``gate.stop_serving()``, stop
    listening, give the connections FLUSH_TIMEOUT_S to write their last bytes, and close
    those still open after that."""
    import hypercorn.trio
    import trio
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"fd://{sock.detach()}"]   # Hypercorn owns the socket from here
    config.loglevel = log_level.upper()
    # Hypercorn's errors through the root handler (web/logs.py), not a handler of its own
    config.errorlog = logging.getLogger("hypercorn.error")
    config.errorlog.setLevel(log_level.upper())
    config.graceful_timeout = FLUSH_TIMEOUT_S
    connections = _track_connections(config)
    stop = trio.Event()
    hypercorn_done = trio.Event()

    async def run_hypercorn(task_status) -> None:
        try:
            await hypercorn.trio.serve(gate, config, shutdown_trigger=stop.wait,
                                       task_status=task_status)
        finally:
            hypercorn_done.set()

    async def close_stragglers() -> None:
        # Hypercorn gives its connections FLUSH_TIMEOUT_S once it stops (or is cancelled),
        # but a write to a client that stopped reading (its buffers full) is shielded from
        # that cancellation and would never end: close the sockets still open after it.
        try:
            await stop.wait()
        finally:
            with trio.CancelScope(shield=True):
                with trio.move_on_after(FLUSH_TIMEOUT_S + 1):
                    await hypercorn_done.wait()
                if not hypercorn_done.is_set():
                    log.warning("closing %d connections whose clients stopped reading",
                                len(connections))
                    for stream in list(connections):
                        stream.socket.close()

    gate.stop_serving = stop.set
    async with trio.open_nursery() as nursery:
        gate.binds = await nursery.start(run_hypercorn)
        nursery.start_soon(close_stragglers)
        try:
            yield gate.binds
        finally:
            stop.set()       # Hypercorn stops listening and closes the connections


def _track_connections(config) -> weakref.WeakSet:
    """The client streams of the Hypercorn server run with `config`, so that shutdown can
    close the ones left (see serve). Hypercorn's trio worker makes a TCPServer per
    connection; ours also files its stream here, and writes directly when it can
    (web/sse.py)."""
    from hypercorn.trio import run

    from web.sse import FastWriteTCPServer

    class TrackedTCPServer(FastWriteTCPServer):
        def __init__(self, app, config, context, state, stream) -> None:
            super().__init__(app, config, context, state, stream)
            tracked = getattr(config, "tailrace_connections", None)
            if tracked is not None:
                tracked.add(stream)

    if not getattr(run.TCPServer, "tailrace_tracked", False):
        TrackedTCPServer.tailrace_tracked = True
        run.TCPServer = TrackedTCPServer
    config.tailrace_connections = weakref.WeakSet()
    return config.tailrace_connections


async def drain(engine, timeout: float, abort) -> None:
    """Refuse new requests (503, /health 503) but keep the socket open, and let those in
    flight finish, for up to `timeout` seconds or until `abort` is set; then end the rest
    with an in-band error, which frees their KV blocks."""
    import trio

    engine.begin_drain()
    in_flight = len(engine.replies)
    log.info("draining %d requests in flight, for up to %gs", in_flight, timeout)
    with trio.move_on_after(timeout):
        async with trio.open_nursery() as waiting:
            async def on_abort() -> None:
                await abort.wait()
                waiting.cancel_scope.cancel()

            waiting.start_soon(on_abort)
            await engine.wait_idle()
            waiting.cancel_scope.cancel()
    if len(engine.replies):
        log.warning("ending the %d requests still in flight", len(engine.replies))
        engine.abort_all(SHUTDOWN_MESSAGE)
        with trio.move_on_after(ABORT_TIMEOUT_S):
            await engine.wait_idle()


async def _watch_signals(shutdown, abort, serving, scope, *, task_status) -> None:
    """First signal: a graceful shutdown (while the model loads: stop at once); a second:
    end the requests still in flight; a third: stop at once."""
    import trio

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for signum in signals:
            name = signal.Signals(signum).name
            if abort.is_set() or not serving.is_set():
                log.warning("%s: stopping now", name)
                scope.cancel()
                return
            if shutdown.is_set():
                log.warning("%s: ending the requests still in flight", name)
                abort.set()
            else:
                log.info("%s: shutting down gracefully", name)
                shutdown.set()


if __name__ == "__main__":
    sys.exit(main())
