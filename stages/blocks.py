"""The KV block manager: allocation, freeing and automatic prefix caching.

A block is shared by reference count. A *full* block gets a chained hash
(hash of the previous block's hash and its own token ids), so two sequences with
the same prefix share its blocks. A freed block keeps its hash and stays reusable
until it is evicted: free blocks are handed out least-recently-freed first.
"""
from __future__ import annotations

from collections import OrderedDict


def block_hash(prev: int | None, tokens: tuple[int, ...]) -> int:
    return hash((prev, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True) -> None:
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
        return n <= len(self.free)

    # -- prefix cache --------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int], root: int | None = None
                     ) -> tuple[list[int], int | None]:
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
            h = block_hash(prev, toks)
            b = self.cached.get(h)
            if b is None or self.block_tokens[b] != toks:
                break
            hits.append(b)
            prev = h
        return hits, prev

    # -- allocation ----------------------------------------------------------------------
    def take_cached(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref_count[b] == 0:
                del self.free[b]
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
        return out

    def release(self, blocks: list[int]) -> None:
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
                           first_uncommitted: int, prev_hash: int | None) -> tuple[int, int | None]:
        """Hash the blocks of ``table`` that became full once ``num_computed`` tokens are in
        the cache. Returns the new (first_uncommitted, prev_hash) cursor for the sequence."""
        if not self.prefix_caching:
            return first_uncommitted, prev_hash
        bs = self.block_size
        full = num_computed // bs
        for i in range(first_uncommitted, full):
            toks = tuple(token_ids[i * bs:(i + 1) * bs])
            h = block_hash(prev_hash, toks)
            b = table[i]
            if self.block_hash[b] is None:
                self.block_hash[b] = h
                self.block_tokens[b] = toks
                self.cached.setdefault(h, b)
            prev_hash = h
        return max(first_uncommitted, full), prev_hash
