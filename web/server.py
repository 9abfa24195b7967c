"""The HTTP server runtime under `tailrace serve`: Hypercorn's trio worker on a socket bound
before the model loads, the loading gate, the engine, and the shutdown sequence.

Shutdown (docs/reliability.md): the first SIGINT/SIGTERM drains: new requests and
/health get 503 while the requests in flight run on, for up to --graceful-timeout
seconds; a second signal, or the timeout, ends those left with an in-band error (an
error chunk and [DONE], or a 500 body) and frees their KV blocks; then the server stops
and exits 0. A third signal, or one while the model loads, stops at once.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import socket
import weakref
from functools import partial

from typing import TYPE_CHECKING

import trio

from pipeline.layouts.process import runner_switch_interval
from web.app import AppConfig, LoadingGate, create_app

if TYPE_CHECKING:     # the engine (torch) is imported when a model is served, not before
    from pipeline.core.config import EngineConfig
    from pipeline.core.engine import Engine

log = logging.getLogger("tailrace")

LISTENING_PREFIX = "tailrace: listening on "
GRACEFUL_TIMEOUT_S = 20.0   # leaves room under Kubernetes' default 30 s before SIGKILL
ABORT_TIMEOUT_S = 5.0       # for aborted requests to reach their readers (one engine step)
FLUSH_TIMEOUT_S = 2.0       # for Hypercorn to write the last bytes once every reply has ended
DRAIN_BODY_BYTES = 1 << 20  # of a request body left unread when its reply ends (see read_body_first)
DRAIN_BODY_TIMEOUT_S = 1.0
SHUTDOWN_MESSAGE = "The server is shutting down: this request was stopped before it finished."


def listen_socket(host: str, port: int) -> socket.socket:
    """Bind and listen now, before the model loads: OSError when the port is taken.
    Port 0 gets a free port (serve reports the real one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # accepted sockets inherit it
    return sock


async def serve_model(config: EngineConfig, sock: socket.socket, *,
                      app_config: AppConfig = AppConfig(), log_level: str = "info",
                      graceful_timeout: float = GRACEFUL_TIMEOUT_S, task_status=None) -> int:
    """Serve `sock` at once (503 on every route while the model loads: web.app.LoadingGate),
    load the model and start the engine, then serve it until SIGINT/SIGTERM.
    0 on a clean shutdown; an engine crash propagates (as an exception group)."""
    from pipeline.core.engine import open_engine   # here: the engine brings torch

    shutdown, abort, serving = trio.Event(), trio.Event(), trio.Event()
    gate = LoadingGate()
    async with trio.open_nursery() as nursery:
        await nursery.start(_watch_signals, shutdown, abort, serving, nursery.cancel_scope)
        async with open_http(gate, sock, log_level=log_level):
            # the process's setting for the GPU step's runner thread, for the engine's life
            with runner_switch_interval():
                async with open_engine(config, secrets=frozenset(app_config.api_keys)) as engine:
                    async with trio.open_nursery() as server:
                        binds = await server.start(partial(
                            serve, engine, None, app_config=app_config,
                            graceful_timeout=graceful_timeout, shutdown=shutdown,
                            abort=abort, gate=gate))
                        serving.set()
                        if task_status is not None:
                            task_status.started(binds)
        nursery.cancel_scope.cancel()     # stops the signal watcher
    return 0


async def serve_frontend(engine_socks: list[socket.socket], sock: socket.socket, *, index: int,
                         log_level: str = "info") -> int:
    """One frontend process of --api-server-count (web/child.py runs it): serve the
    listening socket it inherited at once (503 while the engine processes load the model),
    take its setup from the engines over `engine_socks` (one per data-parallel rank; the
    first's is used, once every engine has sent its own), then serve the app over a
    pipeline.layouts.frontend.RemoteEngine, as serve_model does over an Engine; shutdown is the
    same. An engine going away comes out as pipeline.layouts.frontend.EngineGone."""
    from pipeline.layouts.frontend import EngineGone, open_frontend
    from pipeline.layouts.wire import Link

    shutdown, abort, serving = trio.Event(), trio.Event(), trio.Event()
    gate = LoadingGate()
    links = [Link(trio.socket.from_stdlib_socket(s)) for s in engine_socks]
    async with trio.open_nursery() as nursery:
        await nursery.start(_watch_signals, shutdown, abort, serving, nursery.cancel_scope)
        async with open_http(gate, sock, log_level=log_level):
            setups = []
            for rank, link in enumerate(links):
                try:
                    setups.append(await link.receive())
                except trio.EndOfChannel:
                    raise EngineGone(f"engine {rank} exited before it was ready") from None
            setup = setups[0]
            async with open_frontend(setup, links) as engine:
                async with trio.open_nursery() as server:
                    await server.start(partial(
                        serve, engine, None, app_config=setup.app_config,
                        graceful_timeout=setup.graceful_timeout, shutdown=shutdown,
                        abort=abort, gate=gate, announce=index == 0))
                    serving.set()
        nursery.cancel_scope.cancel()     # stops the signal watcher
    return 0


async def serve(engine: Engine, sock: socket.socket | None, *,
                app_config: AppConfig = AppConfig(), log_level: str = "info",
                graceful_timeout: float = GRACEFUL_TIMEOUT_S, shutdown: trio.Event | None = None,
                abort: trio.Event | None = None, gate: LoadingGate | None = None,
                announce: bool = True, task_status=None) -> None:
    """Serve the app of a running engine on a listening socket (listen_socket) until
    `shutdown` is set, then drain (see drain) and stop. Prints the listening line.

    With `gate` (a web.app.LoadingGate already served by open_http; `sock` None), open
    that gate to the app instead of starting a server of its own. `announce` False: no
    listening line (the frontends of --api-server-count but the first)."""
    shutdown = shutdown if shutdown is not None else trio.Event()
    abort = abort if abort is not None else trio.Event()
    async with contextlib.AsyncExitStack() as stack:
        if gate is None:
            gate = LoadingGate()
            await stack.enter_async_context(open_http(gate, sock, log_level=log_level))
        gate.open(create_app(engine, app_config))
        for bind in gate.binds if announce else ():
            print(f"{LISTENING_PREFIX}{bind}", flush=True)
        if task_status is not None:
            task_status.started(gate.binds)
        await shutdown.wait()
        await drain(engine, graceful_timeout, abort)
        gate.stop_serving()    # Hypercorn stops listening and closes the connections


@contextlib.asynccontextmanager
async def open_http(gate: LoadingGate, sock: socket.socket, *, log_level: str = "info",
                    tcp_server_base: type | None = None):
    """Serve the ASGI app `gate` with Hypercorn on a listening socket for the block (its
    addresses in ``gate.binds``); at the end, or at ``gate.stop_serving()``, stop
    listening, give the connections FLUSH_TIMEOUT_S to write their last bytes, and close
    those still open after that.

    `tcp_server_base`: the class each connection's TCPServer builds on; None (what serve
    uses) is web/sse.py's FastWriteTCPServer. scripts/bench_sse_write.py passes
    Hypercorn's own to compare the two."""
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"fd://{sock.detach()}"]   # Hypercorn owns the socket from here
    config.loglevel = log_level.upper()
    # Hypercorn's errors through the root handler (pipeline/core/logs.py), not one of its own
    config.errorlog = logging.getLogger("hypercorn.error")
    config.errorlog.setLevel(log_level.upper())
    config.graceful_timeout = FLUSH_TIMEOUT_S
    connections: weakref.WeakSet = weakref.WeakSet()
    stop = trio.Event()
    hypercorn_done = trio.Event()

    async def run_hypercorn(task_status) -> None:
        try:
            await _serve_hypercorn(gate, config, connections, stop, tcp_server_base,
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


async def _serve_hypercorn(app, config, connections: weakref.WeakSet, stop: trio.Event,
                           tcp_server_base: type | None, *, task_status) -> None:
    """hypercorn.trio.serve for plain-HTTP sockets, whose connections go through our
    TCPServer subclass, which files each client stream in `connections` (so shutdown can
    close those left). hypercorn.trio.serve hard-wires its TCPServer; this is its worker
    loop (hypercorn/trio/run.py, worker_serve) less TLS, QUIC and max_requests, which
    tailrace does not use, rather than a patch of hypercorn's class for the whole process."""
    from hypercorn.trio.lifespan import Lifespan
    from hypercorn.trio.statsd import StatsdLogger
    from hypercorn.trio.worker_context import WorkerContext
    from hypercorn.typing import ConnectionState
    from hypercorn.utils import repr_socket_addr, wrap_app

    from web.sse import FastWriteTCPServer

    class TrackedTCPServer(tcp_server_base or FastWriteTCPServer):
        def __init__(self, app, config, context, state, stream) -> None:
            super().__init__(app, config, context, state, stream)
            connections.add(stream)

    config.set_statsd_logger_class(StatsdLogger)
    app = wrap_app(read_body_first(app), config.wsgi_max_body_size, None)
    lifespan_state: dict = {}
    lifespan = Lifespan(app, config, lifespan_state)
    context = WorkerContext(None)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as server_nursery:
            listeners, binds = [], []
            for sock in config.create_sockets().insecure_sockets:
                sock.listen(config.backlog)
                listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
                binds.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
                await config.log.info(f"Running on {binds[-1]} (CTRL + C to quit)")
            task_status.started(binds)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(partial(
                        trio.serve_listeners,
                        partial(TrackedTCPServer, app, config, context,
                                ConnectionState(lifespan_state.copy())),
                        listeners, handler_nursery=server_nursery))
                    await stop.wait()
                    nursery.cancel_scope.cancel()    # stop listening
            finally:
                await context.terminated.set()
                server_nursery.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()


def read_body_first(app):
    """ASGI middleware: a response does not end before its request has been read to the end.

    Hypercorn keeps an HTTP/1.1 connection alive only if, when the response ends, h11 has
    parsed the whole request; otherwise it closes the connection, with no ``Connection:
    close`` header, and a client that reuses it (a keep-alive pool) gets "Server
    disconnected without sending a response". An app that answers without reading the
    body (LoadingGate's 503, require_api_key's 401) races Hypercorn's reader task, which
    parses the end of a request (even a GET's) only after the app has started; with
    web/sse.py's direct writes the app's whole response goes out without yielding and
    often wins. So, before the last body message, read what is left of the request (at
    most DRAIN_BODY_BYTES, for DRAIN_BODY_TIMEOUT_S: past that Hypercorn closes the
    connection, as HTTP allows). Where the app reads the request itself in another task
    (Quart does, concurrently), wait for that task to see the end rather than take its
    messages."""

    async def wrapped(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        ended = trio.Event()       # the request's last message, or the client gone, received
        received = trio.Event()    # replaced at each message received
        receiving = 0              # receive calls under way (the app's own)

        async def tracked_receive():
            nonlocal receiving, received
            receiving += 1
            try:
                message = await receive()
            finally:
                receiving -= 1
            if message["type"] != "http.request" or not message.get("more_body", False):
                ended.set()
            received.set()
            received = trio.Event()
            return message

        async def read_rest() -> None:
            left = DRAIN_BODY_BYTES
            with trio.move_on_after(DRAIN_BODY_TIMEOUT_S):
                while not ended.is_set() and left > 0:
                    if receiving:      # the app's reader takes the next message: wait for it
                        await received.wait()
                    else:
                        left -= len((await tracked_receive()).get("body", b""))

        async def finishing_send(message):
            if (not ended.is_set() and message["type"] == "http.response.body"
                    and not message.get("more_body", False)):
                await read_rest()
            await send(message)

        return await app(scope, tracked_receive, finishing_send)

    return wrapped


async def drain(engine: Engine, timeout: float, abort: trio.Event) -> None:
    """Refuse new requests (503, /health 503) but keep the socket open, and let those in
    flight finish, for up to `timeout` seconds or until `abort` is set; then end the rest
    with an in-band error, which frees their KV blocks."""
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


async def _watch_signals(shutdown: trio.Event, abort: trio.Event, serving: trio.Event,
                         scope: trio.CancelScope, *, task_status) -> None:
    """First signal: a graceful shutdown (while the model loads: stop at once); a second:
    end the requests still in flight; a third: stop at once."""
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
