"""The KV block manager alone: allocation and freeing, reference counts, the prefix-hash
chain and LRU eviction. A random mix of sequences (hypothesis) checks the invariants
against a model of who holds which block; the examples pin down single rules.

How the scheduler uses it (preemption, n choices sharing a prompt) is
tests/stages/test_scheduler.py and test_scheduler_invariants.py."""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stages.schedule.blocks import BlockManager, block_hash


def admit(bm: BlockManager, tokens: list[int], root: int | None = None) -> list[int] | None:
    """What the scheduler does for a prompt computed whole: take its cached prefix,
    allocate the rest, hash the full blocks. None when the blocks do not fit."""
    hits, _ = bm.match_prefix(tokens, root)
    need = bm.blocks_for(len(tokens)) - len(hits)
    reclaimed = sum(1 for b in hits if bm.ref_count[b] == 0)   # hits in the free list
    if not bm.can_allocate(need + reclaimed):
        return None
    bm.take_cached(hits)
    table = hits + bm.allocate(need)
    bm.commit_full_blocks(table, tokens, len(tokens), 0, root)
    return table


def check_invariants(bm: BlockManager, held: list[tuple[list[int], list[int]]]) -> None:
    holders = Counter(b for table, _ in held for b in table)
    assert bm.ref_count == [holders[b] for b in range(bm.num_blocks)]
    assert set(bm.free) == {b for b in range(bm.num_blocks) if holders[b] == 0}
    assert bm.num_free + bm.num_used == bm.num_blocks
    for h, b in bm.cached.items():
        assert bm.block_hash[b] == h
    bs = bm.block_size
    # a block in use keeps its content (never evicted under its holder); without prefix
    # caching no content is recorded
    for table, tokens in held if bm.prefix_caching else ():
        for i in range(len(tokens) // bs):
            assert bm.block_tokens[table[i]] == tuple(tokens[i * bs:(i + 1) * bs])


@settings(max_examples=120, deadline=None)
@given(data=st.data(), num_blocks=st.integers(1, 12), block_size=st.integers(1, 4),
       prefix_caching=st.booleans())
def test_random_admits_and_releases_keep_every_invariant(data, num_blocks, block_size,
                                                         prefix_caching):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    held: list[tuple[list[int], list[int]]] = []
    # two token values, short prompts: prefixes repeat often, so blocks are shared
    prompts = st.lists(st.integers(0, 1), min_size=1, max_size=3 * block_size + 1)
    for _ in range(data.draw(st.integers(1, 25))):
        if held and data.draw(st.booleans()):
            table, _ = held.pop(data.draw(st.integers(0, len(held) - 1)))
            bm.release(table)
        else:
            tokens = data.draw(prompts)
            free_before = bm.num_free
            table = admit(bm, tokens)
            if table is None:
                assert bm.num_free == free_before          # refused: nothing taken
            else:
                assert len(table) == bm.blocks_for(len(tokens)) == len(set(table))
                held.append((table, tokens))
        check_invariants(bm, held)
    for table, _ in held:
        bm.release(table)
    assert bm.num_free == num_blocks and not any(bm.ref_count)


def test_a_shared_prefix_is_matched_and_reference_counted():
    bm = BlockManager(8, 2)
    a = admit(bm, [1, 2, 3, 4, 5])                     # blocks: [1 2] [3 4] [5]
    b = admit(bm, [1, 2, 3, 4, 9])
    assert b[:2] == a[:2] and b[2] != a[2]
    assert [bm.ref_count[x] for x in a] == [2, 2, 1]
    bm.release(a)
    assert [bm.ref_count[x] for x in b] == [1, 1, 1] and bm.num_used == 3


def test_a_match_leaves_at_least_one_token_to_compute():
    """A prompt that is all cached blocks still computes its last token (the model needs
    its logits to sample from)."""
    bm = BlockManager(8, 2)
    table = admit(bm, [1, 2, 3, 4])
    hits, prev = bm.match_prefix([1, 2, 3, 4])
    assert hits == table[:1]
    assert prev == block_hash(None, (1, 2))
    assert bm.match_prefix([1, 2, 3, 4, 5])[0] == table


def test_the_chain_hashes_the_whole_prefix_not_one_block():
    """A block matches only behind the same earlier blocks: [3 4] after [9 9] is not the
    [3 4] after [1 2]."""
    bm = BlockManager(8, 2)
    admit(bm, [1, 2, 3, 4, 5])
    assert bm.match_prefix([9, 9, 3, 4, 5])[0] == []


def test_a_different_root_shares_nothing():
    bm = BlockManager(8, 2)
    salt_a, salt_b = hash(("cache_salt", "a")), hash(("cache_salt", "b"))
    table = admit(bm, [1, 2, 3, 4, 5], root=salt_a)
    assert bm.match_prefix([1, 2, 3, 4, 5], salt_b)[0] == []
    assert bm.match_prefix([1, 2, 3, 4, 5])[0] == []
    assert bm.match_prefix([1, 2, 3, 4, 5], salt_a)[0] == table[:2]


def test_freed_blocks_stay_matchable_until_reused_tail_first():
    """Released cached blocks stay in the cache; when they must be reused, a prefix's last
    block goes first, so its first blocks live longest."""
    bm = BlockManager(3, 2)
    assert admit(bm, [1, 2, 3, 4, 5, 6, 7]) is None       # 7 tokens need 4 blocks of 2
    table = admit(bm, [1, 2, 3, 4, 5, 6])
    bm.release(table)
    assert bm.num_free == 3 and bm.match_prefix([1, 2, 3, 4, 5, 6, 0])[0] == table
    [reused] = bm.allocate(1)
    assert reused == table[2]
    assert bm.match_prefix([1, 2, 3, 4, 5, 6, 0])[0] == table[:2]


def test_take_cached_revives_a_free_block():
    bm = BlockManager(4, 2)
    table = admit(bm, [1, 2, 3])
    bm.release(table)
    hits, _ = bm.match_prefix([1, 2, 3])
    bm.take_cached(hits)
    assert bm.ref_count[hits[0]] == 1 and hits[0] not in bm.free
    assert hits[0] not in bm.allocate(bm.num_free)     # not handed out while held


def test_without_prefix_caching_nothing_is_hashed_or_matched():
    bm = BlockManager(4, 2, enable_prefix_caching=False)
    table = admit(bm, [1, 2, 3, 4, 5])
    assert bm.cached == {} and bm.block_hash == [None] * 4
    assert bm.match_prefix([1, 2, 3, 4, 5]) == ([], None)
    assert bm.commit_full_blocks(table, [1, 2, 3, 4, 5], 5, 0, None) == (0, None)


def test_commit_advances_the_cursor_over_full_blocks_only():
    bm = BlockManager(4, 4)
    table = bm.allocate(2)
    tokens = list(range(10, 17))                        # 7 tokens: one full block
    first, prev = bm.commit_full_blocks(table, tokens, 3, 0, None)
    assert (first, prev) == (0, None)                   # 3 computed: nothing full yet
    first, prev = bm.commit_full_blocks(table, tokens, 7, first, prev)
    assert (first, prev) == (1, block_hash(None, (10, 11, 12, 13)))
    assert bm.block_hash[table[1]] is None


def test_sizes_and_refusals():
    assert BlockManager(4, 16).blocks_for(0) == 0
    assert [BlockManager(4, 16).blocks_for(n) for n in (1, 16, 17)] == [1, 1, 2]
    bm = BlockManager(2, 4)
    with pytest.raises(RuntimeError, match="asked for 3 KV blocks, 2 free"):
        bm.allocate(3)
    assert bm.num_free == 2
    with pytest.raises(ValueError, match="at least one block"):
        BlockManager(0, 16)
