"""Tensor parallelism as the model sees it (issue 25): which rank this process is, of how
many, and the torch.distributed group the collectives run over.

The contract shared by the sharded model (gpu/models/causal_lm.py) and the processes that run it
(the engine's rank 0 and its workers):
- every rank builds the same CausalLM with its own `TP`, and loads only its shard;
- `CausalLM.forward` is a collective (all-reduces after o_proj and down_proj, a vocabulary-
  parallel embedding): every rank calls it with the same inputs, in the same order;
- `CausalLM.compute_logits` is a collective too: every rank calls it with the same rows;
  rank 0 gets the whole [N, V] logits, the other ranks get None;
- the KV cache of a rank holds `CausalLM.local_kv_heads` heads.

Every collective is bounded by the group's timeout (init_group's timeout_s): a dead peer makes
the call raise (gloo: at once or at the timeout; NCCL: its watchdog aborts the communicator)
instead of hanging.

torch is imported lazily: this module is imported by start-up code that may run torch-free.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

import attrs


@attrs.frozen
class TP:
    rank: int = 0
    size: int = 1
    group: Any = None   # torch.distributed ProcessGroup when size > 1

    @property
    def first(self) -> bool:
        return self.rank == 0

    def split(self, n: int, what: str = "dimension") -> tuple[int, int]:
        """This rank's [start, stop) of n rows split evenly over the ranks."""
        if n % self.size:
            raise ValueError(f"{what} {n} is not divisible by --tensor-parallel-size {self.size}")
        step = n // self.size
        return self.rank * step, (self.rank + 1) * step

    def padded_split(self, n: int) -> tuple[int, int]:
        """This rank's [start, stop) of n rows padded up to a multiple of size (a vocabulary):
        stop may pass n, and the last ranks may hold only padding."""
        step = -(-n // self.size)
        return self.rank * step, (self.rank + 1) * step

    def all_reduce(self, x):
        """Sum x over the ranks, in place; x itself at size 1 (no call at all)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def gather_first(self, x, dim: int = -1):
        """Rank 0: the ranks' x concatenated along dim in rank order; other ranks: None.
        Every rank passes a tensor of the same shape. gloo has a true gather; NCCL gets
        all_gather_into_tensor (its gather is recent and point-to-point underneath), whose
        copies on the other ranks are dropped."""
        if self.size == 1:
            return x
        import torch
        import torch.distributed as dist

        x = x.contiguous()
        if x.is_cuda:
            out = x.new_empty(self.size * x.shape[0], *x.shape[1:])
            dist.all_gather_into_tensor(out, x, group=self.group)
            return torch.cat(out.chunk(self.size), dim=dim) if self.first else None
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.first else None
        dist.gather(x, parts, group=self.group, group_dst=0)
        return torch.cat(parts, dim=dim) if self.first else None


SINGLE = TP()


def init_group(rank: int, size: int, *, backend: str | None = None, init_method: str = "env://",
               timeout_s: float = 300.0) -> TP:
    """Join the default torch.distributed group (rank of size) and return this rank's TP.

    backend: "nccl" when CUDA is available (call torch.cuda.set_device for this rank's device
    first: the group is bound to the current device), else "gloo". init_method: "tcp://HOST:PORT"
    (rank 0 listens there) or "env://" (MASTER_ADDR, MASTER_PORT: torchrun's and multi-node
    start-up's way). timeout_s bounds the rendezvous and every later collective."""
    if size == 1:
        return SINGLE
    import torch
    import torch.distributed as dist

    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    kw = {"device_id": torch.device("cuda", torch.cuda.current_device())} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s), **kw)
    return TP(rank=rank, size=size, group=dist.group.WORLD)


def destroy_group(tp: TP) -> None:
    """Leave the group init_group joined (no-op at size 1)."""
    if tp.size > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
