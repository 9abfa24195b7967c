"""A hybrid model's per-sequence state slots (Qwen3-Next, Qwen3.5): the scheduler's second
resource beside KV blocks. Each running sequence holds one slot of the runner's StatePool
(gpu/layers/linear_attention.py: every linear-attention layer's conv and recurrent state)
from its first planned chunk until it finishes or is preempted; SeqChunk.state_slot
carries it to the runner.

The pool has --max-num-seqs slots and only running sequences hold one, so a slot is
always free when a sequence is planned (beam search and remote prefills, which can run
more, are refused for hybrid models). A chunk that starts at position 0 begins from zeros
in whatever slot it gets, so a slot freed by an abort or a preemption is reused at once,
even while a step that still names it for its old holder runs: the runner runs steps in
plan order. A preempted sequence restarts from position 0 (recompute), and prefix-cache
hits are off (a block boundary's state is not kept: docs/architecture.md).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from gpu.interface import SeqChunk

if TYPE_CHECKING:
    from stages.schedule.sequence import Sequence


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"a hybrid model needs at least one state slot, got {num_slots}")
        self.num_slots = num_slots
        self.free = list(range(num_slots - 1, -1, -1))     # popped from the end: 0 first

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self.free)

    def stamp(self, chunks: list[SeqChunk], planned: list[tuple[Sequence, int]]) -> list[SeqChunk]:
        """The step's chunks with their sequences' slots, giving one to each that has none."""
        out = []
        for chunk, (seq, _) in zip(chunks, planned):
            if seq.slot < 0:
                if not self.free:
                    raise RuntimeError(f"no state slot left for {seq.id} ({self.num_slots} slots): "
                                       "more sequences planned than --max-num-seqs")
                seq.slot = self.free.pop()
            out.append(attrs.evolve(chunk, state_slot=seq.slot))
        return out

    def release(self, seq: Sequence) -> None:
        """The sequence's slot back to the pool (it finished, or was preempted)."""
        self.free.append(seq.slot)
        seq.slot = -1
