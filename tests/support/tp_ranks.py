"""Run a function on N tensor-parallel ranks: spawned processes over gloo on loopback, each
with one intra-op thread (N ranks share this machine's few cores), rank 0's result returned.
A deadline on the whole run and the group's timeout on every collective: a failing rank
cannot hang the test."""

from __future__ import annotations

import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from gpu.layers.attention_dense import DenseCachedAttention, DenseCausalAttention
from gpu.parallel import TP, destroy_group, init_group


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(size: int, fn, *args, timeout_s: float = 120.0):
    """fn(tp, *args) on ranks 0..size-1 (fn importable: a module-level function); rank 0's
    return value (torch.save-able)."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "rank0.pt"
        ctx = mp.start_processes(_rank_main, args=(size, free_port(), fn, args, str(out), timeout_s),
                                 nprocs=size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{size} ranks did not finish in {timeout_s} s")
        finally:
            for p in ctx.processes:  # only the ones started here
                if p.is_alive():
                    p.kill()
                    p.join(5)
        return torch.load(out, weights_only=False)


def _rank_main(rank: int, size: int, port: int, fn, args, out: str, timeout_s: float) -> None:
    torch.set_num_threads(1)
    # half the run's deadline: a stuck collective raises (and names itself) before the deadline
    tp = init_group(rank, size, backend="gloo", init_method=f"tcp://127.0.0.1:{port}", timeout_s=timeout_s / 2)
    try:
        result = fn(tp, *args)
        if tp.first:
            torch.save(result, out)
    finally:
        destroy_group(tp)


def logits(model, prompts: list[list[int]]) -> torch.Tensor | None:
    """[T, V] on rank 0 (None elsewhere): the prompts as one flat batch through the dense
    attention, positions restarting per prompt."""
    ids = [t for p in prompts for t in p]
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), positions, DenseCausalAttention([len(p) for p in prompts]))
        return model.compute_logits(hidden)


def greedy(model, tp: TP, ids: list[int], n: int) -> list[int]:
    """n argmax tokens decoded one at a time through a KV cache of this rank's heads: rank 0
    picks each token and broadcasts it (what the engine's per-step broadcast does)."""
    attn, step, start, new = DenseCachedAttention(), list(ids), 0, []
    with torch.inference_mode():
        for _ in range(n):
            hidden = model(torch.tensor(step), torch.arange(start, start + len(step)), attn)
            logits = model.compute_logits(hidden[-1:])
            token = torch.tensor([-1]) if logits is None else logits.argmax(-1)
            if tp.size > 1:
                torch.distributed.broadcast(token, src=0, group=tp.group)
            new.append(int(token))
            start, step = start + len(step), new[-1:]
    return new


def paged_greedy(model, tp: TP, prompts: list[list[int]], n: int, block_size: int = 4,
                 chunk: int = 5) -> list[list[int]]:
    """n argmax tokens for each prompt, batched the engine's way: prompts prefilled in chunks
    of `chunk` tokens, decode rows mixed with the other prompt's prefill, through a paged
    KVCache of this rank's KV heads (TorchPagedAttention, gpu/worker/staging.py's inputs). A
    hybrid linear-attention model's states live in a StatePool of this rank's heads, prompt i
    in slot i + 1 (the runner's way: gpu/worker/runner.py)."""
    from gpu.layers.attention import KVCache, TorchPagedAttention
    from gpu.layers.linear_attention import LinearDims, StatePool
    from gpu.interface import SeqChunk
    from gpu.worker.staging import prepare_step

    c = model.config
    per_seq = -(-(max(map(len, prompts)) + n) // block_size)
    cache = KVCache(c.num_kv_layers, 1 + per_seq * len(prompts), block_size, model.local_kv_heads,
                    c.kv_cache_head_dim, model.dtype, "cpu", latent=c.kv_cache_latent)
    pool = (StatePool(c.num_linear_layers, 1 + len(prompts), LinearDims.of(c, tp), model.dtype, "cpu")
            if c.num_linear_layers else None)
    attn = TorchPagedAttention(cache, c.head_dim ** -0.5)
    tables = [tuple(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(len(prompts))]
    seqs, done, new = [list(p) for p in prompts], [0] * len(prompts), [[] for _ in prompts]
    with torch.inference_mode():
        while any(len(t) < n for t in new):
            chunks, rows = [], []
            for i, s in enumerate(seqs):
                if len(new[i]) == n:
                    continue
                todo = s[done[i]:done[i] + chunk]
                end = done[i] + len(todo)
                chunks.append(SeqChunk(str(i), tuple(todo), done[i], tables[i][:-(-end // block_size)],
                                       end == len(s), state_slot=i + 1 if pool is not None else -1))
                if end == len(s):
                    rows.append(i)
                done[i] = end
            input_ids, positions, meta, sample_idx = prepare_step(tuple(chunks), block_size, torch.device("cpu"))
            if pool is not None:
                meta.states = pool.step([ch.state_slot for ch in chunks], meta.q_starts, meta.q_lens,
                                        meta.start_positions)
            attn.prepare(meta)
            hidden = model(input_ids, positions, attn)
            logits = model.compute_logits(hidden.index_select(0, sample_idx))
            tokens = torch.full((len(rows),), -1) if logits is None else logits.argmax(-1)
            if tp.size > 1:
                torch.distributed.broadcast(tokens, src=0, group=tp.group)
            for i, t in zip(rows, tokens.tolist()):
                new[i].append(t)
                seqs[i].append(t)
    return new
