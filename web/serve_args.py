"""`tailrace serve`'s own flags (beside the engine's, pipeline/core/config.py) and the
server settings they make: shared by the command line (web/cli.py) and the children
a multi-process server starts (web/child.py)."""
from __future__ import annotations

import argparse
import json

from pipeline.core.config import add_engine_arguments, byte_size
from web.access import api_keys
from web.app import DEFAULT_MAX_REQUEST_BODY_BYTES, AppConfig
from web.responses_store import DEFAULT_MAX_ITEMS
from web.server import GRACEFUL_TIMEOUT_S


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
    from pipeline.core.logs import LOG_FORMATS

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
    p.add_argument("--root-path", default="", metavar="PATH",
                   help="Serve the API under this prefix too (behind a proxy that forwards "
                        "/PATH/v1/...): /PATH/v1/chat/completions is /v1/chat/completions.")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="Serve GET /tokenizer_info (the tokenizer's configuration, the chat "
                        "template included).")
    p.add_argument("--responses-store", default=None, metavar="PATH",
                   help="Keep stored Responses (store: true) in this SQLite file, which "
                        "survives restarts. Default: in memory, lost at exit.")
    p.add_argument("--responses-store-max-items", type=int, default=DEFAULT_MAX_ITEMS,
                   metavar="N",
                   help="Keep at most N stored Responses; one more evicts the least recently "
                        "used (default: %(default)s).")
    p.add_argument("--api-server-count", "-asc", type=int, default=None, metavar="N",
                   help="Run the engine (admit, schedule, GPU step) in a process of its own and "
                        "N HTTP frontend processes (render, detokenize, parse, account, emit) "
                        "sharing the listening socket (vLLM's flag; docs/architecture.md). "
                        "Default: one process does both.")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                   help="Run N engine processes (each its own scheduler, KV cache and model "
                        "runner; on CUDA engine R on the devices from R * TP, on the CPU each "
                        "with its share of the cores) behind the --api-server-count frontends, "
                        "which pick an engine per request by load or by the "
                        "X-data-parallel-rank header (vLLM's flag; docs/cli.md). Default: 1.")
    p.add_argument("--graceful-timeout", type=float, default=GRACEFUL_TIMEOUT_S,
                   metavar="SECONDS",
                   help="On SIGTERM/SIGINT, how long requests in flight may run on before "
                        "they are ended with an error (default: %(default)s).")


def app_config(args: argparse.Namespace) -> AppConfig:
    """The server's settings from its flags; ValueError for a bad value."""
    if args.api_server_count is not None and args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be at least 1, got {args.api_server_count}")
    if getattr(args, "data_parallel_size", 1) < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {args.data_parallel_size}")
    if args.graceful_timeout < 0:
        raise ValueError(f"--graceful-timeout must not be negative, got {args.graceful_timeout}")
    return AppConfig(api_keys=api_keys(args.api_key),
                     allowed_origins=args.allowed_origins or (),
                     allowed_methods=args.allowed_methods, allowed_headers=args.allowed_headers,
                     allow_credentials=args.allow_credentials,
                     max_request_body_bytes=args.max_request_body_bytes,
                     enable_log_requests=args.enable_log_requests, max_log_len=args.max_log_len,
                     root_path=args.root_path,
                     enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
                     responses_store=args.responses_store,
                     responses_store_max_items=args.responses_store_max_items)
