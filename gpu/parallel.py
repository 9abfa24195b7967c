"""Tensor parallelism as the model sees it (issue 25): which rank this process is, of how
many, and the torch.distributed group the collectives run over.

The contract shared by the sharded model (gpu/model.py) and the processes that run it
(the engine's rank 0 and its workers):
- every rank builds the same CausalLM with its own `TP`, and loads only its shard;
- `CausalLM.forward` is a collective (all-reduces after o_proj and down_proj, a vocabulary-
  parallel embedding): every rank calls it with the same inputs, in the same order;
- `CausalLM.compute_logits` is a collective too: every rank calls it with the same rows;
  rank 0 gets the whole [N, V] logits, the other ranks get None;
- the KV cache of a rank holds `CausalLM.local_kv_heads` heads.

torch is imported lazily: this module is imported by start-up code that may run torch-free.
"""
from __future__ import annotations

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


SINGLE = TP()
