"""`tailrace cluster`: N `tailrace serve` replicas on one machine behind vllm-router.

tailrace has no balancer of its own: the router (vLLM's, a Rust binary in the
`vllm-router` wheel, `pip install 'tailrace[cluster]'`) speaks OpenAI HTTP to the
replicas and needs only their `GET /health` and `POST /v1/...`. This module starts
and watches the processes; docs/scaling.md says when to use it.

    start N replicas        each `python -m web.cli serve ... --host H --port P_i`, in a
                            session of its own, with CUDA_VISIBLE_DEVICES / OMP_NUM_THREADS
    wait for their /health  503 while a model loads, 200 once it serves
    start the router        `python -m vllm_router.launch_router --worker-urls ...
                            --policy POLICY`; wait for its /health
    print                   `tailrace: listening on http://HOST:PORT` (as serve does)
    supervise               until SIGTERM/SIGINT, or a death that ends the cluster

A replica that dies is reported (which one, its exit status) and taken out of the
router (`POST /remove_worker`): the others keep serving, and the router retries the
requests that found it gone. It is started again on its port after a backoff (1 s,
doubling to 30 s) and put back into the router (`POST /add_worker`) once its /health
says 200 (`--no-restart-replicas`: it stays out). The cluster stops, exit status 1, when the router dies,
when the last replica dies, when a replica dies before the router is up, or with
--stop-on-replica-death at the first death (for a supervisor such as systemd or
Kubernetes that restarts the whole).

Shutdown (first SIGTERM/SIGINT): SIGTERM to every replica, which drains (503 to new
requests, requests in flight run on; `tailrace serve --graceful-timeout`) while the
router still carries their replies; then SIGTERM to the router. A second signal is
passed on to the replicas (they end what is left with an error); a third, or
--stop-timeout, kills every process group with SIGKILL. Every child runs in a session
of its own (a terminal's Ctrl-C reaches the launcher only, which stops them in order);
on any way out of the launcher but SIGKILL, whatever is left of a child's process group
is killed, so none is left behind. (PR_SET_PDEATHSIG cannot help: trio starts processes
from a worker thread, and the signal follows that thread, not the launcher.)

With --prefill N --decode M (disaggregated prefill, issue 36) the router is tailrace's P/D
proxy (pipeline/tools/pd_proxy.py), or with --pd-router vllm-router vllm-router's own
P/D mode (`--vllm-pd-disaggregation --kv-connector nixl`), which runs the same two legs.
vllm-router 0.1.17's P/D mode takes a worker out (`POST /remove_worker`) but cannot put
one back (`POST /add_worker` and `POST /workers` answer 400 "PD router requires specific
add_prefill_server or add_decode_server methods"), so there the launcher leaves its
instances in the router and the router's own health checks (every second) take a dead
one out of the rotation and a restarted one back in, on the same URL.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import attrs
import trio

log = logging.getLogger("tailrace.cluster")

LISTENING_PREFIX = "tailrace: listening on "
# vllm-router's policies that need nothing but HTTP workers (kv_aware needs KV events,
# sticky_least_loaded program metadata).
ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "consistent_hash", "random")
MISSING_ROUTER = ("tailrace cluster needs vllm-router, which is not installed: "
                  "pip install 'tailrace[cluster]' (or pip install vllm-router==0.1.17)")
HEALTH_POLL_S = 0.25
RESTART_BACKOFF_MAX_S = 30.0     # a replica that keeps dying is started again this often
ROUTER_STOP_TIMEOUT_S = 5.0
# what runs the two legs of --prefill N --decode M: tailrace's P/D proxy or vllm-router's
# P/D mode (docs/scaling.md)
PD_ROUTERS = ("tailrace", "vllm-router")
# vllm-router's health checks in P/D mode (its default interval is 60 s): how soon a dead
# instance leaves the rotation and a restarted one comes back (--router-args overrides)
PD_ROUTER_HEALTH_INTERVAL_S = 1


class ClusterError(Exception):
    """A cluster that cannot start: a clear message, no traceback."""


@attrs.frozen
class ClusterConfig:
    replicas: int = attrs.field(default=2)
    host: str = "127.0.0.1"                 # the router's address: what clients call
    port: int = 8000                        # 0: a free port
    replica_host: str = "127.0.0.1"
    replica_ports: tuple[int, ...] = attrs.field(default=(), converter=tuple)   # (): port+1...
    devices: tuple[str, ...] = attrs.field(default=(), converter=tuple)  # CUDA_VISIBLE_DEVICES
    threads_per_replica: int | None = None  # OMP_NUM_THREADS
    policy: str = "cache_aware"
    serve_args: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    router_args: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    router_metrics_port: int | None = None  # None: a free port
    router_log_level: str = "warning"
    start_timeout: float = 600.0
    stop_timeout: float = 30.0
    stop_on_replica_death: bool = False
    restart_replicas: bool = True           # start a dead replica again, with backoff
    # disaggregated prefill (issue 36): this many prefill and decode instances behind
    # pd_router (pipeline/tools/pd_proxy.py, or vllm-router's P/D mode); 0 and 0: plain
    # replicas behind vllm-router
    prefill: int = 0
    decode: int = 0
    pd_router: str = "tailrace"

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill or self.decode)

    @property
    def needs_vllm_router(self) -> bool:
        return not self.disaggregated or self.pd_router == "vllm-router"

    @property
    def router_manages_workers(self) -> bool:
        """Whether the launcher takes dead replicas out of the router and puts them back
        (`POST /remove_worker`, `/add_worker`): not with vllm-router's P/D mode, which
        cannot add one back; its health checks do both there."""
        return not (self.disaggregated and self.pd_router == "vllm-router")

    @replicas.validator
    def _replicas(self, attribute, value) -> None:
        if value < 1:
            raise ValueError(f"--replicas must be at least 1, got {value}")

    def __attrs_post_init__(self) -> None:
        if self.pd_router != "tailrace" and not self.disaggregated:
            raise ValueError("--pd-router goes with --prefill N --decode M")
        if self.disaggregated:
            if self.prefill < 1 or self.decode < 1:
                raise ValueError("--prefill and --decode go together, each at least 1, got "
                                 f"--prefill {self.prefill} --decode {self.decode}")
            object.__setattr__(self, "replicas", self.prefill + self.decode)
        if self.pd_router not in PD_ROUTERS:
            raise ValueError(f"--pd-router must be one of {', '.join(PD_ROUTERS)}, "
                             f"got {self.pd_router!r}")
        if self.policy not in ROUTER_POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(ROUTER_POLICIES)}, "
                             f"got {self.policy!r}")
        if self.replica_ports and len(self.replica_ports) != self.replicas:
            raise ValueError(f"--replica-ports lists {len(self.replica_ports)} ports for "
                             f"{self.replicas} replicas")
        if self.devices and len(self.devices) != self.replicas:
            raise ValueError(f"--devices lists {len(self.devices)} devices for "
                             f"{self.replicas} replicas")
        if self.threads_per_replica is not None and self.threads_per_replica < 1:
            raise ValueError("--threads-per-replica must be at least 1")
        for flag in ("--host", "--port"):
            if any(a == flag or a.startswith(flag + "=") for a in self.serve_args):
                raise ValueError(f"{flag} of the replicas is the cluster's to set: use "
                                 f"--replica-host / --replica-ports")


def router_installed() -> bool:
    return importlib.util.find_spec("vllm_router") is not None


def free_port(host: str = "127.0.0.1") -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port(host: str, port: int, what: str) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise ClusterError(f"cannot listen on {_url(host, port)} for {what}: "
                               f"{exc.strerror or exc}") from None


def _url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
    return f"http://[{shown}]:{port}" if ":" in shown else f"http://{shown}:{port}"


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


@attrs.define
class Child:
    name: str                       # "replica 0", "router"
    url: str
    command: list[str]
    env: dict[str, str]
    proc: trio.Process | None = None
    exited: trio.Event = attrs.field(factory=trio.Event)
    returncode: int | None = None
    restarts: int = 0               # how many times it was started again

    @property
    def alive(self) -> bool:
        return self.proc is not None and not self.exited.is_set()

    def signal(self, signum: int) -> None:
        if self.alive:
            try:
                self.proc.send_signal(signum)
            except ProcessLookupError:
                pass

    def kill_group(self) -> None:
        """SIGKILL the child's whole session (it leads its own process group). Only while
        it is unreaped, so the group id cannot belong to anyone else."""
        if self.alive:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


class Cluster:
    def __init__(self, config: ClusterConfig, *, python: str = sys.executable) -> None:
        self.config = config
        self.python = python
        self.port = config.port or free_port(config.host)
        ports = list(config.replica_ports) or (
            [free_port(config.replica_host) for _ in range(config.replicas)] if config.port == 0
            else [config.port + 1 + i for i in range(config.replicas)])
        self.replicas = [self._replica(i, port) for i, port in enumerate(ports)]
        self.router: Child | None = None
        self.stop = trio.Event()          # set: shut everything down
        self.router_up = False
        self.exit_code = 0
        self.signals = 0
        self._nursery: trio.Nursery | None = None

    # -- the commands --------------------------------------------------------------------

    def _replica(self, i: int, port: int) -> Child:
        cfg = self.config
        env = {**os.environ}
        if cfg.devices:
            env["CUDA_VISIBLE_DEVICES"] = cfg.devices[i]
        if cfg.threads_per_replica is not None:
            env["OMP_NUM_THREADS"] = str(cfg.threads_per_replica)
        command = [self.python, "-m", "web.cli", "serve", *cfg.serve_args,
                   "--host", cfg.replica_host, "--port", str(port)]
        name = f"replica {i}"
        if cfg.disaggregated:
            # every instance a KV connector (kv_both, as vLLM's examples), its side channel
            # on a port of its own choosing (the prefill side's params name it)
            name = f"prefill {i}" if i < cfg.prefill else f"decode {i - cfg.prefill}"
            if not any(a == "--kv-transfer-config" or a.startswith("--kv-transfer-config=")
                       for a in cfg.serve_args):
                device = "cuda" if cfg.devices else "cpu"
                command += ["--kv-transfer-config",
                            '{"kv_connector": "NixlConnector", "kv_role": "kv_both", '
                            f'"kv_buffer_device": "{device}"}}']
            env.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", cfg.replica_host)
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = "0"
        return Child(name, _url(cfg.replica_host, port), command, env)

    def router_command(self) -> list[str]:
        cfg = self.config
        prefill = [r.url for r in self.replicas[:cfg.prefill]]
        decode = [r.url for r in self.replicas[cfg.prefill:]]
        if cfg.disaggregated and cfg.pd_router == "tailrace":   # pipeline/tools/pd_proxy.py
            return [self.python, "-m", "pipeline.tools.pd_proxy", "--host", cfg.host,
                    "--port", str(self.port), "--prefill", *prefill, "--decode", *decode]
        if cfg.disaggregated:
            # vllm-router's P/D mode: the same two legs (the prefill leg with max_tokens 1
            # and kv_transfer_params {"do_remote_decode": true}, then the decode leg with
            # the params returned); each --prefill URL with no bootstrap port (SGLang's)
            workers = [*[a for u in prefill for a in ("--prefill", u)],
                       *[a for u in decode for a in ("--decode", u)],
                       "--vllm-pd-disaggregation", "--kv-connector", "nixl",
                       "--health-check-interval-secs", str(PD_ROUTER_HEALTH_INTERVAL_S)]
        else:
            workers = ["--worker-urls", *[r.url for r in self.replicas]]
        metrics_port = cfg.router_metrics_port or free_port(cfg.host)
        return [self.python, "-m", "vllm_router.launch_router",
                "--host", cfg.host, "--port", str(self.port),
                *workers,
                "--policy", cfg.policy,
                # the launcher has already waited for every replica's /health
                "--worker-startup-check-interval", "1",
                "--prometheus-host", cfg.host, "--prometheus-port", str(metrics_port),
                "--log-level", cfg.router_log_level,
                *cfg.router_args]

    # -- running -------------------------------------------------------------------------

    async def run(self) -> int:
        """Start, serve until a signal (or a death that ends the cluster), stop. The exit
        status: 0 after a signal, 1 when a death ended the cluster."""
        cfg = self.config
        check_port(cfg.host, self.port, "the router")
        for r in self.replicas:
            check_port(cfg.replica_host, int(r.url.rsplit(":", 1)[1]), r.name)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._watch_signals)
                with trio.CancelScope() as starting:
                    nursery.start_soon(self._cancel_on_stop, starting)
                    await self._start(nursery)
                if not self.stop.is_set():
                    print(f"{LISTENING_PREFIX}{_url(cfg.host, self.port)}", flush=True)
                    if cfg.disaggregated:
                        log.info("cluster ready: %d prefill and %d decode instances behind "
                                 "%s at %s", cfg.prefill, cfg.decode,
                                 "vllm-router (P/D mode)" if cfg.pd_router == "vllm-router"
                                 else "the P/D proxy", _url(cfg.host, self.port))
                    else:
                        log.info("cluster ready: %d replicas behind vllm-router (policy %s) "
                                 "at %s", len(self.replicas), cfg.policy,
                                 _url(cfg.host, self.port))
                await self.stop.wait()
                await self._shutdown()
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                for child in self._children():   # whatever is left, on any way out
                    child.kill_group()
                    if child.proc is not None:
                        await child.proc.wait()
        return self.exit_code

    def _children(self) -> list[Child]:
        return [*self.replicas, *([self.router] if self.router else [])]

    async def _cancel_on_stop(self, scope: trio.CancelScope) -> None:
        await self.stop.wait()
        scope.cancel()

    async def _start(self, nursery: trio.Nursery) -> None:
        started = time.monotonic()
        for r in self.replicas:
            await self._spawn(nursery, r)
            log.info("%s: pid %d, %s, starting", r.name, r.proc.pid, r.url)
        async with trio.open_nursery() as waiting:
            for r in self.replicas:
                waiting.start_soon(self._wait_healthy, r, started)
        if self.stop.is_set():          # a replica died meanwhile: no router
            return
        self.router = Child("router", _url(self.config.host, self.port), self.router_command(),
                            {**os.environ})
        await self._spawn(nursery, self.router)
        if self.config.disaggregated and self.config.pd_router == "vllm-router":
            log.info("router: pid %d, vllm-router (P/D mode) at %s, policy %s",
                     self.router.proc.pid, self.router.url, self.config.policy)
        elif self.config.disaggregated:
            log.info("router: pid %d, the P/D proxy at %s", self.router.proc.pid,
                     self.router.url)
        else:
            log.info("router: pid %d, vllm-router at %s, policy %s", self.router.proc.pid,
                     self.router.url, self.config.policy)
        await self._wait_healthy(self.router, started)
        self.router_up = True

    async def _spawn(self, nursery: trio.Nursery, child: Child) -> None:
        child.proc = await trio.lowlevel.open_process(
            child.command, env=child.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True)
        nursery.start_soon(self._forward_output, child)
        nursery.start_soon(self._watch_exit, child)

    async def _forward_output(self, child: Child) -> None:
        """The child's output, line by line, on the launcher's stderr, prefixed by its name
        (stdout stays the launcher's own: its listening line)."""
        prefix = f"[{child.name}] ".encode()
        pending = b""
        stdout = child.proc.stdout       # this process's, though the child may be restarted
        async with stdout:
            while True:
                try:
                    data = await stdout.receive_some(65536)
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    data = b""
                if not data:
                    break
                *lines, pending = (pending + data).split(b"\n")
                if lines:
                    sys.stderr.buffer.write(b"".join(prefix + ln + b"\n" for ln in lines))
                    sys.stderr.flush()
        if pending:
            sys.stderr.buffer.write(prefix + pending + b"\n")
            sys.stderr.flush()

    async def _wait_healthy(self, child: Child, started: float) -> None:
        import httpx

        loading_seen = False
        deadline = started + self.config.start_timeout
        async with httpx.AsyncClient(timeout=5.0) as http:
            while True:
                if child.exited.is_set():
                    return                   # _watch_exit reports it and stops the cluster
                if time.monotonic() > deadline:
                    log.error("%s did not become healthy in %gs", child.name,
                              self.config.start_timeout)
                    self.exit_code = 1
                    self.stop.set()
                    return
                try:
                    status = (await http.get(child.url + "/health")).status_code
                except httpx.TransportError:
                    status = None
                if status == 200:
                    log.info("%s: healthy after %.1fs", child.name, time.monotonic() - started)
                    return
                if status == 503 and not loading_seen:
                    loading_seen = True
                    log.info("%s: /health 503 (loading)", child.name)
                await trio.sleep(HEALTH_POLL_S)

    async def _watch_exit(self, child: Child) -> None:
        child.returncode = await child.proc.wait()
        child.exited.set()
        if self.stop.is_set():
            log.info("%s %s", child.name, describe_exit(child.returncode))
            return
        alive = [r for r in self.replicas if r.alive]
        log.error("%s (pid %d, %s) %s", child.name, child.proc.pid, child.url,
                  describe_exit(child.returncode))
        if child is self.router:
            log.error("the router is gone: stopping the cluster")
        elif not self.router_up:
            log.error("a replica died while the cluster was starting: stopping the cluster")
        elif not alive:
            log.error("no replica is left: stopping the cluster")
        elif self.config.stop_on_replica_death:
            log.error("--stop-on-replica-death: stopping the cluster")
        else:
            log.warning("serving on with %d of %d replicas: %s", len(alive), len(self.replicas),
                        ", ".join(r.name for r in alive))
            if self.config.router_manages_workers:
                await self._remove_from_router(child)
            else:
                log.info("router: vllm-router's health checks take %s out of the rotation "
                         "(its P/D mode cannot put a removed worker back)", child.name)
            if self.config.restart_replicas:
                self._nursery.start_soon(self._restart, child)
            return
        self.exit_code = 1
        self.stop.set()

    async def _restart(self, child: Child) -> None:
        """Start a dead replica again, on its port, after a backoff (1 s, doubling to
        RESTART_BACKOFF_MAX_S); once healthy, back into the router. One that does not
        become healthy within --start-timeout is killed, which starts the next try."""
        import httpx

        delay = min(RESTART_BACKOFF_MAX_S, 2.0 ** child.restarts)
        log.info("%s: starting again in %gs", child.name, delay)
        await trio.sleep(delay)
        if self.stop.is_set():
            return
        child.restarts += 1
        child.proc, child.returncode, child.exited = None, None, trio.Event()
        await self._spawn(self._nursery, child)
        log.info("%s: pid %d, %s, started again (restart %d)", child.name, child.proc.pid,
                 child.url, child.restarts)
        deadline = time.monotonic() + self.config.start_timeout
        async with httpx.AsyncClient(timeout=5.0) as http:
            while True:
                if child.exited.is_set() or self.stop.is_set():
                    return                   # _watch_exit reports it (and restarts it)
                if time.monotonic() > deadline:
                    log.error("%s did not become healthy in %gs: killing it", child.name,
                              self.config.start_timeout)
                    child.kill_group()
                    return
                try:
                    healthy = (await http.get(child.url + "/health")).status_code == 200
                except httpx.TransportError:
                    healthy = False
                if healthy:
                    break
                await trio.sleep(HEALTH_POLL_S)
            if not self.config.router_manages_workers:
                log.info("router: %s healthy again (%s); vllm-router's health checks put it "
                         "back", child.name, child.url)
                return
            try:
                r = await http.post(self.router.url + "/add_worker", params={"url": child.url})
                ok, why = r.status_code == 200, f"{r.status_code} {r.text[:200]}"
            except httpx.TransportError as exc:
                ok, why = False, str(exc)
        if ok:
            log.info("router: %s back in (%s)", child.name, child.url)
        else:
            log.warning("router: could not put %s back: %s", child.name, why)

    async def _remove_from_router(self, child: Child) -> None:
        import httpx

        try:
            async with httpx.AsyncClient(timeout=5.0) as http:
                r = await http.post(self.router.url + "/remove_worker", params={"url": child.url})
            if r.status_code == 200:
                log.info("router: %s taken out (%s)", child.name, child.url)
            else:
                log.warning("router: could not take out %s: %d %s", child.name, r.status_code,
                            r.text[:200])
        except httpx.TransportError as exc:
            log.warning("router: could not take out %s: %s", child.name, exc)

    async def _watch_signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                self.signals += 1
                name = signal.Signals(signum).name
                if self.signals == 1:
                    log.info("%s: stopping the cluster", name)
                    self.stop.set()
                elif self.signals == 2:
                    log.warning("%s: passing it on: the replicas end what is left", name)
                    for r in self.replicas:
                        r.signal(signal.SIGTERM)
                else:
                    log.warning("%s: killing every process now", name)
                    for child in self._children():
                        child.kill_group()

    async def _shutdown(self) -> None:
        """Replicas first (they drain while the router carries their last replies), then
        the router; SIGKILL whatever is left after --stop-timeout."""
        with trio.move_on_after(self.config.stop_timeout) as timer:
            for r in self.replicas:
                r.signal(signal.SIGTERM)
            for r in self.replicas:
                if r.proc is not None:
                    await r.exited.wait()
        if timer.cancelled_caught:
            log.warning("replicas still running after %gs: killing them",
                        self.config.stop_timeout)
            for r in self.replicas:
                r.kill_group()
        if self.router is not None:
            self.router.signal(signal.SIGTERM)
            with trio.move_on_after(ROUTER_STOP_TIMEOUT_S):
                await self.router.exited.wait()
            self.router.kill_group()
        log.info("cluster stopped")


def run(config: ClusterConfig) -> int:
    if config.needs_vllm_router and not router_installed():
        log.error(MISSING_ROUTER)
        return 2
    try:
        cluster = Cluster(config)
        return trio.run(cluster.run)
    except ClusterError as exc:
        log.error("tailrace cluster: %s", exc)
        return 1
