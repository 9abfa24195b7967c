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

import attrs

from pipeline.config import EngineConfig

log = logging.getLogger("tailrace")

LISTENING_PREFIX = "tailrace: listening on "
GRACEFUL_TIMEOUT_S = 5.0

_SIZE_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
                  "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def byte_size(text: str) -> int:
    """An int with an optional size suffix: 4000000000, 4G (10**9), 4GiB (2**30)."""
    s = text.strip().lower().removesuffix("b")
    for suffix in sorted(_SIZE_SUFFIXES, key=len, reverse=True):
        if s.endswith(suffix):
            number = s[: -len(suffix)]
            try:
                return int(float(number) * _SIZE_SUFFIXES[suffix])
            except ValueError:
                break
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r}") from None


def _default(name: str):
    return getattr(attrs.fields(EngineConfig), name).default


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="GGUF file or Hugging Face model directory "
                        "(default: the bundled SmolLM2-135M-Instruct).")
    p.add_argument("--host", default="127.0.0.1",
                   help="Address to bind (default: 127.0.0.1, loopback only; vLLM binds "
                        "0.0.0.0 - pass --host 0.0.0.0 to listen on every interface).")
    p.add_argument("--port", type=int, default=8000,
                   help="Port to bind; 0 picks a free one and prints it (default: 8000).")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="Model name(s) the API accepts and reports; the first is echoed back "
                        "(default: the model's own name).")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="Context length: prompt plus completion tokens "
                        "(default: the model's max_position_embeddings).")
    p.add_argument("--max-num-seqs", type=int, default=_default("max_num_seqs"),
                   help="Most sequences in one engine step (default: %(default)s).")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="Most tokens in one engine step (default: max(2048, --max-num-seqs)).")
    p.add_argument("--dtype", default=_default("dtype"),
                   choices=attrs.fields(EngineConfig).dtype.validator.options,
                   help="Weight and activation dtype; auto: the checkpoint's "
                        "(default: %(default)s).")
    p.add_argument("--seed", type=int, default=_default("seed"),
                   help="Random seed for sampling (default: %(default)s).")
    p.add_argument("--device", default=_default("device"),
                   help="auto, cpu or cuda[:N] (default: %(default)s: cuda when available).")
    p.add_argument("--load-format", default=_default("load_format"),
                   choices=attrs.fields(EngineConfig).load_format.validator.options,
                   help="Weight format; dummy: random weights of the model's shape "
                        "(default: %(default)s).")
    p.add_argument("--block-size", type=int, default=_default("block_size"),
                   help="Tokens per KV cache block (default: %(default)s).")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="Use exactly this many KV cache blocks, ignoring memory sizing.")
    p.add_argument("--kv-cache-memory-bytes", type=byte_size, default=None, metavar="BYTES",
                   help="KV cache size in bytes, e.g. 2GiB or 2000000000 (default on CPU: "
                        "2 GiB or what --max-num-seqs full-length sequences need).")
    p.add_argument("--gpu-memory-utilization", type=float,
                   default=_default("gpu_memory_utilization"),
                   help="Fraction of GPU memory the server may use, KV cache included "
                        "(default: %(default)s).")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=_default("enable_prefix_caching"),
                   help="Reuse the KV blocks of shared prompt prefixes (default: on).")
    p.add_argument("--enforce-eager", action="store_true",
                   help="Never capture CUDA graphs; run every step eagerly.")
    p.add_argument("--reasoning-parser", default=None, choices=("qwen3", "deepseek_r1"),
                   help="Split <think>...</think> into reasoning_content (default: off).")
    p.add_argument("--event-log", default=None, metavar="PATH",
                   help="Write every stage's events as JSON lines to PATH (for replay).")
    p.add_argument("--max-waiting", type=int, default=_default("max_waiting"),
                   help="Requests admitted but not yet running before new ones get 503 "
                        "(default: %(default)s).")
    p.add_argument("--log-level", default="info",
                   choices=("debug", "info", "warning", "error", "critical"),
                   help="Log level of the server and Hypercorn (default: %(default)s).")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """Raises ValueError (or TypeError) for a bad combination of flags."""
    return EngineConfig(
        model=args.model,
        served_model_name=tuple(args.served_model_name or ()),
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching,
        enforce_eager=args.enforce_eager,
        max_waiting=args.max_waiting,
        reasoning_parser=args.reasoning_parser,
        event_log=args.event_log,
    )


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
    if with_bench:
        # Imported only when asked for: pipeline.bench pulls in torch.
        from web.bench import serve as bench_serve_module
        bench_serve_module.add_arguments(bench_serve)
        bench_serve.set_defaults(func=bench_serve_module.main)
        from pipeline import bench as bench_throughput_module
        bench_throughput_module.add_arguments(bench_throughput)
        bench_throughput.set_defaults(func=bench_throughput_module.main)
    return parser


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
