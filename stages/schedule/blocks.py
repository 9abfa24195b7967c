"""The KV block manager: allocation, freeing and automatic prefix caching.

A block is shared by reference count. A *full* block gets a chained hash
(hash of the previous block's hash and its own token ids), so two sequences with
the same prefix share its blocks. A freed block keeps its hash and stays reusable
until it is evicted: free blocks are handed out least-recently-freed first.

Hybrid models (gpt-oss: sliding-window layers alternating with full ones) keep the sliding
layers' K/V in a pool of their own, smaller than the full layers' (`SlidingHalves`): a block
id indexes the full layers' cache, and the block's *sliding half*, a slot of the sliding
layers' cache, is attached to it only while someone may read it. A sequence needs the half
of its blocks that its next query's window reaches; once every holder has passed a block
(its last position is older than the window), the half is free to be taken by a new block.
A half whose block nobody needs stays attached (and so prefix-cacheable) until taken, as a
freed full block keeps its hash until reused. The slot of each block is shipped to the
runner as (block, slot) updates with the next plan (KVCache.remap).
"""
from __future__ import annotations

from collections import OrderedDict


def block_hash(prev: int | None, tokens: tuple[int, ...]) -> int:
    return hash((prev, tokens))


def image_block_keys(images, block_size: int) -> dict[int, tuple]:
    """Block index -> the content hashes of the pictures whose placeholder tokens it holds
    (issue 34): mixed into those blocks' keys, so the same picture reuses its KV and
    another picture at the same positions (the same placeholder ids) never does."""
    keys: dict[int, tuple] = {}
    for im in images:
        for i in range(im.offset // block_size, (im.offset + im.length - 1) // block_size + 1):
            keys[i] = keys.get(i, ()) + (("image", im.hash),)
    return keys


class SlidingHalves:
    """The sliding layers' pool: `num_slots` slots lent to blocks of a `num_blocks` id space.

    slot_of[b]: b's slot, or -1. users[b]: holders of b whose window still reaches it (a
    holder that passed b, or a block before the window of the prefix a holder took from the
    cache, does not count). A block with a slot and no users is *evictable* (kept in LRU
    order): its slot is available, taken over when a new block needs one."""

    def __init__(self, num_slots: int, num_blocks: int, window: int, block_size: int) -> None:
        if num_slots <= 0 or window <= 0:
            raise ValueError("the sliding KV pool needs at least one slot and a positive window")
        self.num_slots = num_slots
        self.window = window
        self.block_size = block_size
        self.slot_of = [-1] * num_blocks
        self.users = [0] * num_blocks
        self.free_slots = list(range(num_slots - 1, -1, -1))   # a stack: slot 0 first
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.updates: list[tuple[int, int]] = []                # (block, slot or -1) to ship

    @property
    def available(self) -> int:
        return len(self.free_slots) + len(self.evictable)

    def passed(self, pos: int) -> int:
        """Blocks wholly before the window of a query at position pos (and of every later one)."""
        return max(0, pos - self.window + 1) // self.block_size

    def attach(self, b: int) -> None:
        """b holds new tokens for one holder: it needs a slot (its own, if it kept one)."""
        if self.slot_of[b] >= 0:
            self.evictable.pop(b, None)
        else:
            if self.free_slots:
                slot = self.free_slots.pop()
            else:
                victim, _ = self.evictable.popitem(last=False)
                slot, self.slot_of[victim] = self.slot_of[victim], -1
                self.updates.append((victim, -1))
            self.slot_of[b] = slot
            self.updates.append((b, slot))
        self.users[b] = 1

    def use(self, b: int) -> None:
        self.users[b] += 1
        if self.users[b] == 1:
            del self.evictable[b]

    def unuse(self, b: int) -> None:
        self.users[b] -= 1
        if self.users[b] == 0:
            self.evictable[b] = None

    def drain_updates(self) -> tuple[tuple[int, int], ...]:
        out, self.updates = tuple(self.updates), []
        return out


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 sliding: tuple[int, int] | None = None) -> None:
        """sliding: (slots, window) for a hybrid model's sliding layers (SlidingHalves)."""
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}                       # hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.sliding = SlidingHalves(sliding[0], num_blocks, sliding[1], block_size) if sliding else None

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free) and (self.sliding is None or n <= self.sliding.available)

    def can_take(self, hits: list[int], new: int) -> bool:
        """Room for a sequence to take the cached `hits` and `new` fresh blocks: hits sitting
        in the free list (and, hybrid, in-window hits whose halves are evictable) count too."""
        reclaimed = sum(1 for b in hits if self.ref_count[b] == 0)
        if new + reclaimed > len(self.free):
            return False
        sl = self.sliding
        if sl is None:
            return True
        start = sl.passed(len(hits) * self.block_size)
        return new + sum(1 for b in hits[start:] if sl.users[b] == 0) <= sl.available

    # -- prefix cache --------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int], root: int | None = None,
                     keys: dict[int, tuple] | None = None) -> tuple[list[int], int | None]:
        """Cached full blocks that hold a prefix of token_ids (at most len-1 tokens, so at
        least one token is left to compute and sample from), and the last one's hash.
        `root` seeds the hash chain (a request's cache_salt): chains with different roots
        share no block."""
        if not self.prefix_caching:
            return [], root
        bs = self.block_size
        hits: list[int] = []
        prev = root
        for i in range((len(token_ids) - 1) // bs):
            toks = tuple(token_ids[i * bs:(i + 1) * bs])
            if keys and i in keys:
                toks += keys[i]
            h = block_hash(prev, toks)
            b = self.cached.get(h)
            if b is None or self.block_tokens[b] != toks:
                break
            hits.append(b)
            prev = h
        sl = self.sliding
        if sl is not None:  # the window of the first computed position needs its halves
            while hits and any(sl.slot_of[b] < 0 for b in hits[sl.passed(len(hits) * bs):]):
                hits.pop()
            prev = self.block_hash[hits[-1]] if hits else root
        return hits, prev

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (POST /reset_prefix_cache); False, and nothing
        changed, while any block is held."""
        if self.num_used:
            return False
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        self.block_tokens = [None] * self.num_blocks
        return True

    # -- allocation ----------------------------------------------------------------------
    def take_cached(self, blocks: list[int]) -> int:
        """Hold a cached prefix (match_prefix's hits). Returns how many of its leading blocks
        the holder has passed already (hybrid: their sliding halves are not needed)."""
        for b in blocks:
            if self.ref_count[b] == 0:
                del self.free[b]
            self.ref_count[b] += 1
        sl = self.sliding
        if sl is None:
            return 0
        passed = sl.passed(len(blocks) * self.block_size)
        for b in blocks[passed:]:
            sl.use(b)
        return passed

    def share(self, blocks: list[int]) -> None:
        """One more holder of blocks already held (a forked beam takes its parent's full
        blocks: beam.py). Not with a hybrid cache's sliding halves."""
        if self.sliding is not None:
            raise RuntimeError("a sliding-window hybrid KV cache cannot share held blocks")
        for b in blocks:
            self.ref_count[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self.free)} free")
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:  # evict its cached content
                if self.cached.get(h) == b:
                    del self.cached[h]
                self.block_hash[b] = self.block_tokens[b] = None
            self.ref_count[b] = 1
            out.append(b)
            if self.sliding is not None:
                self.sliding.attach(b)
        return out

    def pass_window(self, table: list[int], passed: int, pos: int) -> int:
        """A holder of `table` whose next query is at `pos`, and that had passed its first
        `passed` blocks: let go of the sliding halves it no longer needs. Returns the new count."""
        sl = self.sliding
        now = min(sl.passed(pos), len(table))
        for b in table[passed:now]:
            sl.unuse(b)
        return max(passed, now)

    def release(self, blocks: list[int], passed: int = 0) -> None:
        """Let go of a holder's blocks (of which it had passed the first `passed`, hybrid)."""
        if self.sliding is not None:
            for b in reversed(blocks[passed:]):
                self.sliding.unuse(b)
        # Free the tail first so that, under LRU eviction, a prefix's first blocks live longest.
        for b in reversed(blocks):
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                if self.block_hash[b] is None:
                    self.free[b] = None
                    self.free.move_to_end(b, last=False)  # uncached blocks are reused first
                else:
                    self.free[b] = None

    def commit_full_blocks(self, table: list[int], token_ids: list[int], num_computed: int,
                           first_uncommitted: int, prev_hash: int | None,
                           keys: dict[int, tuple] | None = None) -> tuple[int, int | None]:
        """Hash the blocks of ``table`` that became full once ``num_computed`` tokens are in
        the cache. Returns the new (first_uncommitted, prev_hash) cursor for the sequence."""
        if not self.prefix_caching:
            return first_uncommitted, prev_hash
        bs = self.block_size
        full = num_computed // bs
        for i in range(first_uncommitted, full):
            toks = tuple(token_ids[i * bs:(i + 1) * bs])
            if keys and i in keys:
                toks += keys[i]
            h = block_hash(prev_hash, toks)
            b = table[i]
            if self.block_hash[b] is None:
                self.block_hash[b] = h
                self.block_tokens[b] = toks
                self.cached.setdefault(h, b)
            prev_hash = h
        return max(first_uncommitted, full), prev_hash
