"""CUDA graphs for pure-decode steps (one new token per sequence).

A decode step at batch size B replays the graph captured for the smallest captured size
>= B. Each size has its own num_kv_splits (paged_attention.suggest_num_kv_splits over the
longest context, --max-model-len): small batches split every sequence's KV over several
programs so the GPU fills, as vLLM's Triton backend switches to a split kernel at small
grids; from about 32 sequences on, one program per sequence and KV head is enough.
Inputs live in static buffers; padding rows write nowhere (slot -1) and attend to one
token of block 0, and their outputs are dropped. Prefill and mixed steps run eagerly.
"""
from __future__ import annotations

import logging

import torch
from tqdm import tqdm

from gpu.attention import AttentionMetadata

log = logging.getLogger("tailrace.gpu")


def capture_sizes(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 16))
    if not sizes or sizes[-1] < max_bs:
        sizes.append(max_bs)
    return sizes


class DecodeGraphs:
    def __init__(self, model, attn, *, max_bs: int, max_blocks: int, device: torch.device,
                 max_context: int | None = None) -> None:
        from gpu.kernels.paged_attention import suggest_num_kv_splits

        self.model, self.attn = model, attn
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        context = max_context or max_blocks * attn.cache.block_size
        hkv = model.local_kv_heads  # this rank's (tensor parallelism)
        self.num_kv_splits = {bs: suggest_num_kv_splits(bs, hkv, context, torch.device(device))
                              for bs in self.sizes}
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        n = self.max_bs
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slot_mapping = torch.full((n,), -1, **i64)
        self.block_tables = torch.zeros((n, max_blocks), **i32)
        self.cu_seqlens_q = torch.arange(n + 1, **i32)
        self.seq_lens = torch.ones(n, **i32)
        self.hidden = torch.zeros((n, model.config.hidden_size), dtype=model.dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
            cu_seqlens_q=self.cu_seqlens_q[:bs + 1], seq_lens=self.seq_lens[:bs],
            q_starts=list(range(bs + 1)), q_lens=[1] * bs, ctx_lens=[1] * bs, start_positions=[0] * bs,
            decode_rows=list(range(bs)), prefill_rows=[], max_seqlen_q=1,
            num_kv_splits=self.num_kv_splits[bs])

    @torch.inference_mode()
    def capture(self) -> None:
        sizes = tqdm(list(reversed(self.sizes)), desc="capturing CUDA graphs", unit="graph", delay=0.5)
        for bs in sizes:  # largest first: later graphs reuse its memory pool
            self.attn.prepare(self._meta(bs))
            self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs], self.attn)  # warm-up
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs], self.attn)
            self.pool = g.pool()
            self.graphs[bs] = g
        torch.cuda.synchronize()
        log.info("captured CUDA graphs for decode batch sizes %s (KV splits %s)", self.sizes,
                 [self.num_kv_splits[b] for b in self.sizes])

    def fits(self, batch: int, max_blocks: int) -> bool:
        return batch <= self.max_bs and max_blocks <= self.block_tables.shape[1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        b = input_ids.shape[0]
        bs = next(s for s in self.sizes if s >= b)
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.slot_mapping[b:bs].fill_(-1)
        self.block_tables[:b, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.seq_lens[:b].copy_(meta.seq_lens)
        self.seq_lens[b:bs].fill_(1)
        self.graphs[bs].replay()
        return self.hidden[:b]
