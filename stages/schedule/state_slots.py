"""A hybrid model's per-sequence state slots (Qwen3-Next, Qwen3.5): the scheduler's second
resource beside KV blocks. Each running sequence holds one slot of the runner's StatePool
(gpu/layers/linear_attention.py: every linear-attention layer's conv and recurrent state)
from its first planned chunk until it finishes or is preempted; SeqChunk.state_slot
carries it to the runner.

The pool has --max-num-seqs running slots and only running sequences hold one, so a slot
is always free when a sequence is planned (beam search and remote prefills, which can run
more, are refused for hybrid models). A chunk that starts at position 0 begins from zeros
in whatever slot it gets, so a slot freed by an abort or a preemption is reused at once,
even while a step that still names it for its old holder runs: the runner runs steps in
plan order. A preempted sequence restarts from position 0 (recompute), or from a snapshot.

Prefix caching (docs/architecture.md): with `num_snapshots` > 0 the pool has that many more
slots, each a snapshot of the states at one block boundary, keyed by the chained hash of
the block that ends there (blocks.py), least recently used evicted first. A sequence's
snapshot is taken at its prompt's last block boundary that a later identical or longer
prompt can hit, ((prompt_len - 1) // block_size) * block_size: the chunk that would cross
it is cut there (`cut`) and carries `state_save`; the runner copies the slot into the
snapshot after that step's forward. A sequence that starts with cached blocks keeps only
the leading blocks whose last one has a snapshot (`trim`) and its first chunk carries
`state_load`: the runner copies the snapshot into its slot before the forward, and the
chunk continues from there. Steps run in plan order, so a snapshot is written before any
later step reads it, and one evicted and rewritten within a step is read (before the
forward) before it is written (after).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import attrs

from gpu.interface import SeqChunk
from stages.schedule.blocks import block_hash

if TYPE_CHECKING:
    from stages.schedule.blocks import BlockManager
    from stages.schedule.sequence import Sequence


class StateSlots:
    def __init__(self, num_slots: int, num_snapshots: int = 0, block_size: int = 16) -> None:
        if num_slots <= 0:
            raise ValueError(f"a hybrid model needs at least one state slot, got {num_slots}")
        self.num_slots, self.num_snapshots, self.block_size = num_slots, num_snapshots, block_size
        self.free = list(range(num_slots - 1, -1, -1))     # popped from the end: 0 first
        self.free_snapshots = list(range(num_slots + num_snapshots - 1, num_slots - 1, -1))
        self.snapshots: OrderedDict[int, int] = OrderedDict()   # block hash -> slot, LRU first
        self.seeds: dict[str, int] = {}       # sequence id -> the snapshot its next chunk loads
        self.hits = self.saves = 0
        self._fresh: set[int] = set()         # the snapshot slots the step being stamped writes

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self.free)

    def boundary(self, seq: Sequence) -> int:
        """Where the sequence's snapshot is taken (0: none)."""
        if not self.num_snapshots:
            return 0
        return (seq.prompt_len - 1) // self.block_size * self.block_size

    def cut(self, seq: Sequence, n: int) -> int:
        """A chunk of n tokens from seq.num_computed, cut at the snapshot boundary when it
        would cross it (and the boundary's states are not kept yet)."""
        b, start = self.boundary(seq), seq.num_computed
        if start < b < start + n and self._key(seq, b) not in self.snapshots:
            return b - start
        return n

    def trim(self, seq: Sequence, hits: list[int], bm: BlockManager) -> tuple[list[int], int | None]:
        """match_prefix's hits cut back to the longest run whose last block has a snapshot,
        and that block's hash; the sequence's first chunk then loads the snapshot."""
        self.seeds.pop(seq.id, None)
        for j in range(len(hits), 0, -1):
            h = bm.block_hash[hits[j - 1]]
            if h in self.snapshots:
                self.snapshots.move_to_end(h)
                self.seeds[seq.id] = self.snapshots[h]
                return hits[:j], h
        return [], seq.hash_root

    def stamp(self, chunks: list[SeqChunk], planned: list[tuple[Sequence, int]]) -> list[SeqChunk]:
        """The step's chunks with their sequences' slots, giving one to each that has none,
        and the snapshots to load before the step and to save after it."""
        out, self._fresh = [], set()
        for chunk, (seq, _) in zip(chunks, planned):
            if seq.slot < 0:
                if not self.free:
                    raise RuntimeError(f"no state slot left for {seq.id} ({self.num_slots} slots): "
                                       "more sequences planned than --max-num-seqs")
                seq.slot = self.free.pop()
            load = self.seeds.pop(seq.id, -1) if chunk.start_pos else -1
            if load >= 0:
                self.hits += 1
            end = chunk.start_pos + len(chunk.token_ids)
            save = self._snapshot(seq) if end == self.boundary(seq) and end > 0 else -1
            out.append(attrs.evolve(chunk, state_slot=seq.slot, state_load=load, state_save=save))
        return out

    def release(self, seq: Sequence) -> None:
        """The sequence's slot back to the pool, and its pin on a snapshot it was to load
        (it finished, was preempted, or let go of its cached prefix while waiting)."""
        self.seeds.pop(seq.id, None)
        if seq.slot >= 0:
            self.free.append(seq.slot)
            seq.slot = -1

    def reset(self) -> None:
        """Forget every snapshot (the prefix cache was reset)."""
        self.free_snapshots.extend(self.snapshots.values())
        self.snapshots.clear()

    def _key(self, seq: Sequence, end: int) -> int | None:
        """The chained hash of the block that ends at `end`, as blocks.py computes it."""
        bs, prev, keys = self.block_size, seq.hash_root, seq.block_keys
        for i in range(end // bs):
            toks = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            prev = block_hash(prev, toks + keys[i] if keys and i in keys else toks)
        return prev

    def _snapshot(self, seq: Sequence) -> int:
        """A snapshot slot for the states at the sequence's boundary (the least recently
        used one evicted when none is free); -1 when they are kept already."""
        key = self._key(seq, self.boundary(seq))
        if key in self.snapshots:
            return -1
        if self.free_snapshots:
            slot = self.free_snapshots.pop()
        else:   # the least recently used one that no waiting sequence is still to load
            # and that this step does not write already (one copy a snapshot slot a step)
            pinned = set(self.seeds.values()) | self._fresh
            old = next((k for k, s in self.snapshots.items() if s not in pinned), None)
            if old is None:
                return -1
            slot = self.snapshots.pop(old)
        self.snapshots[key] = slot
        self._fresh.add(slot)
        self.saves += 1
        return slot
