"""A tensor-parallel worker rank (1..N-1): load this rank's shard, size its KV cache with the
other ranks, then run every step rank 0 broadcasts (gpu/worker/tp.py follow) until the stop
message. Rank 0 starts it (pipeline/layouts/tp_procs.py); on another host, start it by hand or
with torchrun (docs/scaling.md):

    python -m pipeline.layouts.tp_worker [--rank R] [--init-method URL] [-- SERVE_FLAGS]

--rank defaults to $RANK, --init-method to tcp://$MASTER_ADDR:$MASTER_PORT; the device is
cuda:$LOCAL_RANK (default: the rank) on CUDA. SERVE_FLAGS are rank 0's model and engine
flags (those that load and size the model; the rest are ignored). Exit status 0 after the
stop message, 1 on any error (rank 0 sees a collective fail, or its watcher sees the exit).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence

log = logging.getLogger("tailrace")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--die-with-parent" in argv:     # started by rank 0 (not by hand on another host)
        from pipeline.layouts.process import die_with_parent

        argv.remove("--die-with-parent")
        die_with_parent()
    # a signal to the process group is rank 0's to act on: it drains, then stops us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from pipeline.core.config import add_engine_arguments, engine_config
    from pipeline.core.logs import configure

    p = argparse.ArgumentParser(prog="python -m pipeline.layouts.tp_worker")
    p.add_argument("--rank", type=int, default=int(os.environ.get("RANK", -1)))
    p.add_argument("--init-method", default=None)
    p.add_argument("--log-level", default="info")
    add_engine_arguments(p)
    args = p.parse_args([a for a in argv if a != "--"])
    configure(args.log_level, "text")
    if args.init_method is None:
        if not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
            p.error("--init-method or MASTER_ADDR and MASTER_PORT are needed")
        args.init_method = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    cfg = engine_config(args)
    if not 1 <= args.rank < cfg.tensor_parallel_size:
        p.error(f"--rank {args.rank} is not a worker rank of --tensor-parallel-size "
                f"{cfg.tensor_parallel_size}")
    try:
        return serve(cfg, args.rank, args.init_method,
                     int(os.environ.get("LOCAL_RANK", args.rank)))
    except Exception as exc:
        log.error("tensor-parallel worker rank %d failed: %s: %s", args.rank,
                  type(exc).__name__, exc)
        log.debug("details", exc_info=True)
        return 1


def serve(cfg, rank: int, init_method: str, local_rank: int) -> int:
    from gpu.parallel import destroy_group
    from gpu.worker.tp import follow
    from pipeline.core.parts import pick_device
    from pipeline.core.startup import (build_runner, join_ranks, load_weights, rank_device,
                                       resolve_max_model_len)
    from pipeline.layouts.tp_procs import collective_timeout_s

    device = rank_device(pick_device(cfg.device), local_rank)
    ranks = join_ranks(cfg, device, rank, init_method, collective_timeout_s(),
                       int(os.environ.get("LOCAL_WORLD_SIZE") or cfg.tensor_parallel_size))
    loaded = load_weights(cfg, device, ranks.tp)
    # with --kv-transfer-config, this rank's KV shard registered with its connector
    runner = build_runner(cfg, loaded, device, resolve_max_model_len(cfg, loaded), ranks).runner
    log.info("tensor-parallel worker rank %d of %d on %s: ready", rank, ranks.tp.size, device)
    steps = follow(runner, ranks.plan)
    log.info("tensor-parallel worker rank %d: stopped after %d steps", rank, steps)
    destroy_group(ranks.tp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
