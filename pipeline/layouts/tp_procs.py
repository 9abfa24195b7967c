"""`--tensor-parallel-size N`: the worker ranks' processes, as rank 0 (the engine process)
sees them.

Rank 0 starts ranks 1..N-1 on its own host as fresh interpreters (never a fork of a process
that has imported torch), each pinned to its device and dying with it (PR_SET_PDEATHSIG),
in its process group; each ignores SIGINT/SIGTERM, so that a signal to the group reaches
rank 0 alone, which drains and then stops them:

    python -m pipeline.layouts.tp_worker --rank R --init-method tcp://127.0.0.1:PORT -- SERVE_FLAGS

Every rank joins the group at the init method (rank 0 listens there): a free port on
127.0.0.1, or MASTER_ADDR/MASTER_PORT when set. With LOCAL_WORLD_SIZE=L (torchrun's name)
rank 0 starts only ranks 1..L-1; the others are started on their own hosts with RANK (and
LOCAL_RANK, their GPU) set (docs/scaling.md).

`Workers.watch` ends the engine the moment a worker exits (TPLost: the GPU stage's
"cannot recover" path, then exit 1); `Workers.stop` broadcasts the stop message once the
GPU stage has ended, and kills whatever has not exited STOP_TIMEOUT_S later.
"""
from __future__ import annotations

import contextlib
from functools import partial
import logging
import os
import socket
import subprocess
from collections.abc import AsyncIterator, Mapping

import attrs
import outcome
import trio

from gpu.interface import TPLost
from pipeline.core.config import EngineConfig
from pipeline.layouts import process

log = logging.getLogger("tailrace")

TP_TIMEOUT_ENV = "TAILRACE_TP_TIMEOUT_S"
DEFAULT_TP_TIMEOUT_S = 120.0   # one collective, or the rendezvous (loading included)
STOP_TIMEOUT_S = 10.0
LOST_GRACE_S = 3.0       # at start-up, after a worker exits: for rank 0's own error

# The EngineConfig fields a worker rank needs: what loads its shard and sizes its KV cache
# and CUDA graphs as rank 0 does. (Sampling, parsers and templates are rank 0's alone.)
WORKER_FIELDS = ("load_format", "dtype", "residual_dtype", "device", "seed", "max_model_len",
                 "max_num_seqs", "max_num_batched_tokens", "block_size", "num_gpu_blocks_override",
                 "kv_cache_memory_bytes", "gpu_memory_utilization",
                 # a hybrid linear-attention model's state pool keeps snapshots with it
                 # (pipeline/core/kv_layout.py state_snapshots): every rank's pool alike
                 "enable_prefix_caching",
                 "disable_hybrid_kv_cache_manager", "enforce_eager", "tensor_parallel_size",
                 # LoRA: a worker hooks its shard's linears and loads each adapter's shard
                 # itself when a step first names it (the refs come with the step)
                 "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "lora_dtype",
                 # the KV connector: each rank registers its own cache shard with NIXL
                 # (rank 0's engine id, so that its agents are named alike)
                 "kv_transfer_config")


def collective_timeout_s(env: Mapping[str, str] = os.environ) -> float:
    return float(env.get(TP_TIMEOUT_ENV, DEFAULT_TP_TIMEOUT_S))


@attrs.frozen
class Rendezvous:
    init_method: str
    size: int
    local_ranks: tuple[int, ...]    # the worker ranks rank 0 starts on this host


def rendezvous(size: int, env: Mapping[str, str] = os.environ) -> Rendezvous:
    """Where the ranks meet and which of them rank 0 starts (see the module's docstring)."""
    if env.get("WORLD_SIZE") and int(env["WORLD_SIZE"]) != size:
        raise ValueError(f"WORLD_SIZE={env['WORLD_SIZE']} but --tensor-parallel-size {size}")
    if env.get("RANK", "0") != "0":
        raise ValueError(f"tailrace serve is rank 0; start rank {env['RANK']} with "
                         "`python -m pipeline.layouts.tp_worker` (docs/scaling.md)")
    local = int(env.get("LOCAL_WORLD_SIZE") or size)
    if not 1 <= local <= size:
        raise ValueError(f"LOCAL_WORLD_SIZE={local} is not between 1 and --tensor-parallel-size {size}")
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        url = f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    else:
        with socket.socket() as s:     # free now; rank 0 binds it within seconds
            s.bind(("127.0.0.1", 0))
            url = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    return Rendezvous(url, size, tuple(range(1, local)))


def worker_flags(cfg: EngineConfig) -> list[str]:
    """The serve flags a worker parses (WORKER_FIELDS that differ from their defaults)."""
    flags = [] if cfg.model is None else [cfg.model]
    defaults = attrs.fields_dict(EngineConfig)
    for name in WORKER_FIELDS:
        value = getattr(cfg, name)
        if value == defaults[name].default:
            continue
        flag = "--" + name.replace("_", "-")
        if name == "kv_transfer_config":
            value = value.flag()
        if value is False:          # a BooleanOptionalAction's off
            flags.append("--no-" + flag[2:])
            continue
        flags += [flag] if value is True else [flag, str(value)]
    return flags


def worker_command(rank: int, rdv: Rendezvous, cfg: EngineConfig, log_level: str) -> list[str]:
    return process.python_command(
        "pipeline.layouts.tp_worker", "--die-with-parent", "--rank", str(rank),
        "--init-method", rdv.init_method, "--log-level", log_level, "--", *worker_flags(cfg))


class Workers:
    """The worker ranks rank 0 started (see the module's docstring)."""

    def __init__(self, procs: dict[int, subprocess.Popen]) -> None:
        self.procs = procs
        self.stopping = False

    @classmethod
    def start(cls, cfg: EngineConfig, rdv: Rendezvous) -> Workers:
        """Call it on the main thread (see pipeline.layouts.process.spawn)."""
        level = logging.getLevelName(logging.getLogger("tailrace").getEffectiveLevel()).lower()
        procs = {}
        for rank in rdv.local_ranks:
            # in this process's group (a signal to the group: workers ignore it)
            procs[rank] = process.spawn(worker_command(rank, rdv, cfg, level))
        log.info("tensor parallelism over %d ranks at %s: worker processes %s", rdv.size,
                 rdv.init_method, ", ".join(f"rank {r} pid {p.pid}" for r, p in procs.items()))
        return cls(procs)

    async def watch(self) -> None:
        """Raise TPLost as soon as a worker exits (return instead once stopping)."""
        exits_in, exits_out = trio.open_memory_channel(len(self.procs))
        async with trio.open_nursery() as nursery:
            for rank, proc in self.procs.items():
                nursery.start_soon(self._report_exit, rank, proc, exits_in)
            rank, code = await exits_out.receive()
            nursery.cancel_scope.cancel()
        if not self.stopping:
            raise TPLost(f"tensor-parallel worker rank {rank} (pid {self.procs[rank].pid}) "
                         f"exited with code {code}")

    @staticmethod
    async def _report_exit(rank: int, proc: subprocess.Popen, exits) -> None:
        exits.send_nowait((rank, await process.wait(proc)))

    def stop(self, broadcast, clean: bool) -> list[int]:
        """Stop every worker: the stop message when `clean` (the GPU stage has ended and
        every worker is alive; a failed engine skips it, its workers may be inside a
        collective), then a kill for those not gone STOP_TIMEOUT_S later. Their exit codes."""
        self.stopping = True
        alive = all(p.poll() is None for p in self.procs.values())
        if clean and alive and broadcast is not None:
            try:
                broadcast.stop()
            except Exception as exc:
                log.warning("could not send the workers their stop message: %s", exc)
        else:
            for p in self.procs.values():
                if p.poll() is None:
                    p.kill()
        codes = []
        for rank, p in self.procs.items():
            try:
                codes.append(p.wait(timeout=STOP_TIMEOUT_S))
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel worker rank %d did not stop: killing it", rank)
                p.kill()
                codes.append(p.wait())
        return codes


class TensorParallel:
    """Rank 0's side of --tensor-parallel-size: its workers, and the build that joins them."""

    def __init__(self, rdv: Rendezvous, workers: Workers) -> None:
        self.rdv, self.workers = rdv, workers
        self.broadcast = None      # rank 0's runner's, once built

    async def build(self, cfg: EngineConfig, device, loaded=None):
        """pipeline.core.startup.build as rank 0, in a worker thread, while watching the workers:
        one that exits meanwhile (a shard that fails to load) fails start-up at once rather
        than after the rendezvous' timeout."""
        from pipeline.core.startup import build, join_ranks, rank_device

        if loaded is not None:
            raise ValueError("--tensor-parallel-size: every rank loads its own shard; "
                             "a loaded model cannot be passed in")

        device = rank_device(device, 0)     # cuda:K, not "cuda": the rank's device by index

        def rank0():
            ranks = join_ranks(cfg, device, 0, self.rdv.init_method, collective_timeout_s(),
                               len(self.rdv.local_ranks) + 1)
            return build(cfg, device, None, ranks)

        lost: TPLost | None = None
        done: outcome.Outcome | None = None
        async with trio.open_nursery() as nursery:
            async def watch():
                nonlocal lost
                try:
                    await self.workers.watch()
                except TPLost as exc:
                    lost = exc
                    # rank 0 often fails the same way a moment later (a size that does not
                    # divide): its own error says why, the exit code does not
                    await trio.sleep(LOST_GRACE_S)
                    nursery.cancel_scope.cancel()
            nursery.start_soon(watch)
            done = await outcome.acapture(trio.to_thread.run_sync, rank0, abandon_on_cancel=True)
            nursery.cancel_scope.cancel()
        if isinstance(done, outcome.Error) and not isinstance(done.error, trio.Cancelled):
            done.unwrap()          # rank 0's own error, out here: unwrapped by any nursery
        if lost is not None:
            raise lost
        built = done.unwrap()
        self.broadcast = built.runner.broadcast
        return built

    async def watch(self) -> None:
        await self.workers.watch()


@contextlib.asynccontextmanager
async def open_tensor_parallel(cfg: EngineConfig, device) -> AsyncIterator[TensorParallel | None]:
    """Start the worker ranks (None without tensor parallelism); on exit stop them: the
    stop message after a clean exit (the GPU stage has ended), a kill after an error."""
    if cfg.tensor_parallel_size == 1:
        yield None
        return
    from pipeline.core.startup import check_tensor_parallel

    check_tensor_parallel(cfg, device)
    rdv = rendezvous(cfg.tensor_parallel_size)
    tp = TensorParallel(rdv, Workers.start(cfg, rdv))
    clean = False
    try:
        yield tp
        clean = True
    finally:
        with trio.CancelScope(shield=True):
            codes = await trio.to_thread.run_sync(tp.workers.stop, tp.broadcast, clean)
        log.info("tensor-parallel workers stopped (exit codes %s)", codes)


@contextlib.asynccontextmanager
async def open_built(cfg: EngineConfig, loaded=None) -> AsyncIterator[tuple]:
    """Start-up, for every layout that runs an engine core: the device, the worker ranks
    (with --tensor-parallel-size) and the model built (pipeline.core.startup.build, in a
    worker thread that a cancellation abandons). Yields (device, built, tp), tp None
    without tensor parallelism; on exit the workers are stopped."""
    from pipeline.core.parts import pick_device
    from pipeline.core.startup import build

    device = pick_device(cfg.device)
    async with open_tensor_parallel(cfg, device) as tp:
        if tp is None:
            built = await trio.to_thread.run_sync(partial(build, cfg, device, loaded),
                                                  abandon_on_cancel=True)
        else:   # rank 0: the workers build their shards alongside
            built = await tp.build(cfg, device, loaded)
        yield device, built, tp
