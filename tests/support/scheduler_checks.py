"""The scheduler's and block manager's invariants, checked after every plan and update by the
randomised scheduler tests (tests/stages/test_scheduler_invariants.py and the policies'
tests): reference counts match the block tables, free means unheld, cached hashes match,
budgets hold (check); each chunk reads KV slots that hold exactly its own tokens and no slot
is written twice in a step (kvcheck, over a dict standing in for the KV cache)."""
from collections import Counter

def check(s):
    bm = s.blocks
    refs = Counter()
    for seq in list(s.running) + list(s.waiting):
        for b in seq.table: refs[b] += 1
        assert len(seq.table) >= bm.blocks_for(seq.num_computed), (seq.id, seq.table, seq.num_computed)
        assert seq.table_t == tuple(seq.table), (seq.id, seq.table_t, seq.table)   # the cached copy
        assert seq.end_len == min(seq.prompt_len + seq.max_tokens, s.max_model_len)
    for b in range(bm.num_blocks):
        assert bm.ref_count[b] == refs[b], (b, bm.ref_count[b], refs[b])
        assert (b in bm.free) == (refs[b] == 0), b
    for h, b in bm.cached.items():
        assert bm.block_hash[b] == h
    ids = [q.id for q in s.running] + [q.id for q in s.waiting]
    assert len(ids) == len(set(ids))
    assert set(ids) == set(s.by_id)
    assert len(s.running) <= s.max_num_seqs


def kvcheck(s, plan, kv):
    bs = s.blocks.block_size
    for c in plan.chunks:
        seq = s.by_id[c.seq_id]
        toks = seq.token_ids
        assert tuple(toks[c.start_pos:c.start_pos+len(c.token_ids)]) == c.token_ids
        for p in range(c.start_pos):
            slot = c.block_table[p // bs] * bs + p % bs
            assert kv.get(slot) == tuple(toks[:p+1]), ("stale kv", c.seq_id, p)
    written = set(); read = set()
    for c in plan.chunks:
        for p in range(c.start_pos):
            read.add(c.block_table[p // bs] * bs + p % bs)
    for c in plan.chunks:
        seq = s.by_id[c.seq_id]
        for p in range(c.start_pos, c.start_pos + len(c.token_ids)):
            slot = c.block_table[p // bs] * bs + p % bs
            assert slot not in written and slot not in read, "write conflict"
            written.add(slot)
            kv[slot] = tuple(seq.token_ids[:p+1])
