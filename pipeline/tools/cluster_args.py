"""`tailrace cluster`'s own flags and the ClusterConfig they make (pipeline/tools/cluster.py
runs it); every other flag goes to each replica's `tailrace serve`. Flags: docs/cli.md."""
from __future__ import annotations

import argparse
from collections.abc import Sequence

from pipeline.tools.cluster import PD_ROUTERS, RESTART_BACKOFF_MAX_S, ROUTER_POLICIES, ClusterConfig


def parse_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def add_arguments(p) -> None:
    """The launcher's own flags; every other flag goes to each replica's `tailrace serve`."""
    p.add_argument("--replicas", type=int, default=2,
                   help="How many `tailrace serve` replicas to start (default: %(default)s).")
    p.add_argument("--prefill", type=int, default=0, metavar="N",
                   help="Disaggregated prefill (issue 36): N prefill instances and --decode M "
                        "decode instances, each with the NIXL KV connector, behind tailrace's "
                        "P/D proxy or vllm-router's P/D mode (--pd-router; --replicas does not "
                        "apply, --policy only to vllm-router; docs/scaling.md).")
    p.add_argument("--decode", type=int, default=0, metavar="M",
                   help="With --prefill: the decode instances.")
    p.add_argument("--pd-router", default=None, choices=PD_ROUTERS,
                   help="With --prefill: what runs the two legs: tailrace's P/D proxy "
                        "(tailrace, the default) or vllm-router's P/D mode (vllm-router; "
                        "--policy applies to both roles).")
    p.add_argument("--host", default="127.0.0.1",
                   help="Address the router binds: what clients call (default: %(default)s).")
    p.add_argument("--port", type=int, default=8000,
                   help="Port the router binds; 0 picks a free one (default: %(default)s).")
    p.add_argument("--replica-host", default="127.0.0.1",
                   help="Address the replicas bind (default: %(default)s: only the router "
                        "on this machine reaches them).")
    p.add_argument("--replica-ports", type=lambda t: [int(x) for x in parse_list(t)],
                   default=None, metavar="P1,P2,...",
                   help="The replicas' ports (default: --port + 1, + 2, ...; free ports when "
                        "--port is 0).")
    p.add_argument("--devices", type=parse_list, default=None, metavar="D1,D2,...",
                   help="One CUDA_VISIBLE_DEVICES value per replica, ';' inside one for "
                        "several (default: every replica sees what the launcher sees).")
    p.add_argument("--threads-per-replica", type=int, default=None, metavar="N",
                   help="OMP_NUM_THREADS of each replica: CPU threads for its torch ops "
                        "(default: torch's own choice, every core).")
    p.add_argument("--policy", default="cache_aware", choices=ROUTER_POLICIES,
                   help="vllm-router's load-balancing policy (default: %(default)s).")
    p.add_argument("--router-args", action="append", default=[], metavar="ARGS",
                   help="More vllm-router flags, one shell-quoted string, e.g. "
                        "--router-args '--cache-threshold 0.5' (repeatable).")
    p.add_argument("--router-metrics-port", type=int, default=None, metavar="PORT",
                   help="Port of the router's own Prometheus metrics (default: a free one).")
    p.add_argument("--router-log-level", default="warning",
                   choices=("debug", "info", "warning", "error", "critical"),
                   help="vllm-router's log level (default: %(default)s).")
    p.add_argument("--start-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="How long the replicas and the router may take to become healthy "
                        "(default: %(default)s).")
    p.add_argument("--stop-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="On SIGTERM, how long the replicas may drain before they are killed "
                        "(default: %(default)s; keep it above serve's --graceful-timeout).")
    p.add_argument("--stop-on-replica-death", action="store_true",
                   help="Stop the whole cluster (exit 1) when any replica dies (default: "
                        "report it, take it out of the router and serve on).")
    p.add_argument("--restart-replicas", action=argparse.BooleanOptionalAction, default=True,
                   help="Start a replica that died again, on its port, after a backoff of "
                        "1 s doubling to %g s, and put it back into the router once healthy "
                        "(default: on)." % RESTART_BACKOFF_MAX_S)


def config_from_args(args, serve_args: Sequence[str]) -> ClusterConfig:
    import shlex

    router_args = [a for text in args.router_args for a in shlex.split(text)]
    devices = [d.replace(";", ",") for d in args.devices] if args.devices else ()
    return ClusterConfig(replicas=args.replicas, host=args.host, port=args.port,
                         replica_host=args.replica_host, replica_ports=args.replica_ports or (),
                         devices=devices, threads_per_replica=args.threads_per_replica,
                         policy=args.policy, serve_args=serve_args, router_args=router_args,
                         router_metrics_port=args.router_metrics_port,
                         router_log_level=args.router_log_level,
                         start_timeout=args.start_timeout, stop_timeout=args.stop_timeout,
                         stop_on_replica_death=args.stop_on_replica_death,
                         restart_replicas=args.restart_replicas,
                         prefill=args.prefill, decode=args.decode,
                         pd_router=args.pd_router or "tailrace")
