"""CUDA graphs for pure-decode steps (one new token per sequence).

A decode step at batch size B replays the graph captured for the smallest captured size
>= B. Each size has its own num_kv_splits (paged_attention.suggest_num_kv_splits over the
longest context, --max-model-len): small batches split every sequence's KV over several
programs so the GPU fills, as vLLM's Triton backend switches to a split kernel at small
grids; from about 32 sequences on, one program per sequence and KV head is enough.
Inputs live in static buffers; padding rows write nowhere (slot -1) and attend to one
token of block 0, and their outputs are dropped.

With speculative decoding, verify steps (each sequence its last token and up to K drafts)
replay graphs of their own (`VerifyGraphs`): Q = K + 1 tokens a sequence, captured per
batch size as the decode graphs are, over the varlen attention kernel. Other prefill and
mixed steps run eagerly.

With an EAGLE head the target's auxiliary hidden states (the forward's `aux_layers`) are a
graph's output too: each captured size keeps its own, and a replay returns them beside
the hidden states.

A draft model (gpu/worker/spec_decode/draft.py) has graphs of its own, over its own KV cache: its decode
forwards (a draft each) replay decode graphs, and the forward that catches its KV up to a
verify's accepted run (one or two tokens a sequence) replays verify graphs. An EAGLE head
(gpu/worker/spec_decode/eagle.py) replays `HeadGraphs` for its forwards on its own fed-back state (one token
a sequence) and `HeadVerifyGraphs` for its first forward of a step (up to K + 1 target
states a sequence), the state a row a second input.
"""
from __future__ import annotations

import logging

import torch
from tqdm import tqdm

from gpu.layers.attention import AttentionMetadata

log = logging.getLogger("tailrace.gpu")


def capture_sizes(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 16))
    if not sizes or sizes[-1] < max_bs:
        sizes.append(max_bs)
    return sizes


def capture_graphs(model, attn, *, max_bs: int, max_model_len: int, device: torch.device,
                   verify_tokens: int = 0, label: str = "", pool=None, kinds=None,
                   aux_layers: tuple[int, ...] = ()):
    """(decode graphs, verify graphs or None) of `model` over `attn`'s cache, captured:
    verify graphs of `verify_tokens` tokens a sequence where that is 2 or more. Both share
    one memory pool (their steps never overlap), `pool` where given. A failed capture of
    the decode graphs raises; of the verify graphs, it is logged and kept in the decode
    graphs' `verify_error`, and verify steps run eagerly. kinds: the (decode, verify)
    classes (an EAGLE head's: HeadGraphs, HeadVerifyGraphs). aux_layers: the target's
    layers an EAGLE3 head reads, captured as an output too (DecodeGraphs)."""
    decode_kind, verify_kind = kinds or (DecodeGraphs, VerifyGraphs)
    max_blocks = -(-max_model_len // attn.cache.block_size)
    aux = {"aux_layers": aux_layers} if aux_layers else {}
    graphs = decode_kind(model, attn, max_bs=max_bs, max_blocks=max_blocks, device=device,
                         max_context=max_model_len, label=label, **aux)
    graphs.pool = pool
    graphs.capture()
    verify = None
    if verify_tokens > 1:
        verify = verify_kind(model, attn, max_bs=max_bs, max_blocks=max_blocks, device=device,
                             tokens_per_seq=verify_tokens, label=label, **aux)
        verify.pool = graphs.pool
        try:
            verify.capture()
        except Exception as exc:  # speed, not correctness: those steps run eagerly
            log.warning("CUDA graph capture for %sverify steps failed, running them eagerly: %s",
                        label, exc, exc_info=exc)
            graphs.verify_error = f"{type(exc).__name__}: {exc}"[:500]
            verify = None
    return graphs, verify


def run_graphed(graphs, verify, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, feed: torch.Tensor | None = None):
    """A step's hidden states from the graph that takes it: a decode batch that fits the
    decode graphs, a step of up to K + 1 tokens a sequence that fits the verify graphs;
    None where none does (the step runs eagerly). feed: an EAGLE head's input state a row
    (HeadGraphs, HeadVerifyGraphs), whose (rows for the logits, rows fed back) it returns."""
    if graphs is None:
        return None
    batch, width = len(meta.q_lens), meta.block_tables.shape[1]
    if not meta.prefill_rows:
        g = graphs if graphs.fits(batch, width) else None
    else:
        g = verify if verify is not None and verify.fits(batch, width, meta.max_seqlen_q) else None
    if g is None:
        return None
    return g.run(input_ids, positions, meta) if feed is None else g.run_head(input_ids, positions, meta, feed)


class DecodeGraphs:
    def __init__(self, model, attn, *, max_bs: int, max_blocks: int, device: torch.device,
                 max_context: int | None = None, label: str = "", kv_heads: int | None = None,
                 dtype: torch.dtype | None = None, aux_layers: tuple[int, ...] = ()) -> None:
        from gpu.kernels.triton.paged_attention import suggest_num_kv_splits

        self.model, self.attn, self.label = model, attn, label
        self.aux_layers = aux_layers     # EAGLE3: replays return (hidden, aux)
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        context = max_context or max_blocks * attn.cache.block_size
        hkv = kv_heads or model.local_kv_heads  # this rank's (tensor parallelism)
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
        self.hidden = torch.zeros((n, model.config.hidden_size), dtype=dtype or model.dtype,
                                  device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.aux: dict[int, torch.Tensor] = {}     # EAGLE3's captured layers, per captured size
        self.pool = None
        self.verify_error: str | None = None   # capture_graphs: the verify graphs' failure

    def _capture_meta(self, bs: int) -> AttentionMetadata:
        """The static buffers' metadata for a capture of size bs, their contents set to a
        valid step of that size."""
        return self._views(bs)

    def _views(self, bs: int) -> AttentionMetadata:
        """The metadata of a graph of size bs: views of the static buffers."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
            cu_seqlens_q=self.cu_seqlens_q[:bs + 1], seq_lens=self.seq_lens[:bs],
            q_starts=list(range(bs + 1)), q_lens=[1] * bs, ctx_lens=[1] * bs, start_positions=[0] * bs,
            decode_rows=list(range(bs)), prefill_rows=[], max_seqlen_q=1,
            num_kv_splits=self.num_kv_splits[bs])

    @torch.inference_mode()
    def capture(self) -> None:
        sizes = tqdm(list(reversed(self.sizes)), desc=f"capturing {self.label}CUDA graphs", unit="graph",
                     delay=0.5)
        for bs in sizes:  # largest first: later graphs reuse its memory pool
            self.attn.prepare(self._capture_meta(bs))
            self._forward(bs)     # warm-up: the shapes the capture records, compiled first
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self._forward(bs)
            self.pool = g.pool()
            self.graphs[bs] = g
        torch.cuda.synchronize()
        self._log_captured()

    def _forward(self, bs: int) -> None:
        """The forward a graph of size bs records, over the static buffers."""
        n = self._tokens(bs)
        if self.aux_layers:
            self.hidden[:n], self.aux[bs] = self.model(self.input_ids[:n], self.positions[:n], self.attn,
                                                       aux_layers=self.aux_layers)
        else:
            self.hidden[:n] = self.model(self.input_ids[:n], self.positions[:n], self.attn)

    def _tokens(self, bs: int) -> int:
        return bs

    def _log_captured(self) -> None:
        log.info("captured CUDA graphs for %sdecode batch sizes %s (KV splits %s)", self.label, self.sizes,
                 [self.num_kv_splits[b] for b in self.sizes])

    def _replay(self, bs: int, rows: int):
        """hidden [rows, D]; with aux_layers, (hidden, aux [rows, len(aux) * D])."""
        self.graphs[bs].replay()
        if self.aux_layers:
            return self.hidden[:rows], self.aux[bs][:rows]
        return self.hidden[:rows]

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
        return self._replay(bs, b)


class _HeadIO:
    """An EAGLE head's graphs (gpu/worker/spec_decode/eagle.py EagleDrafter): as a second input the head's
    state a row (`feed`: the target's, combined, or its own fed back from the position
    before), as outputs the rows for the logits (`hidden`) and the rows fed to the next
    forward (`fed`). Padding rows write nowhere and their outputs are dropped."""

    def _head_buffers(self) -> None:
        self.feed = torch.zeros_like(self.hidden)
        self.fed = torch.zeros_like(self.hidden)

    def _forward(self, bs: int) -> None:
        n = self._tokens(bs)
        normed, fed = self.model(self.input_ids[:n], self.positions[:n], self.feed[:n], self.attn)
        self.hidden[:n] = normed
        self.fed[:n] = fed

    def _replay(self, bs: int, rows: int) -> torch.Tensor:
        self.graphs[bs].replay()
        return self.hidden[:rows]

    def run_head(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 feed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's (rows for the logits, rows fed back) for a step that `fits`."""
        t = feed.shape[0]
        self.feed[:t].copy_(feed)
        return self.run(input_ids, positions, meta), self.fed[:t]


class HeadGraphs(_HeadIO, DecodeGraphs):
    """Decode graphs for an EAGLE head: its forwards on its own fed-back state, one token a
    sequence (and a first forward where each sequence has one target state to read)."""

    def __init__(self, head, attn, *, max_bs: int, max_blocks: int, device: torch.device,
                 max_context: int | None = None, label: str = "the EAGLE head's ") -> None:
        super().__init__(head, attn, max_bs=max_bs, max_blocks=max_blocks, device=device,
                         max_context=max_context, label=label,
                         kv_heads=head.config.num_key_value_heads, dtype=head.residual_dtype)
        self._head_buffers()


class VerifyGraphs(DecodeGraphs):
    """Graphs for steps of up to Q = tokens_per_seq new tokens a sequence (speculative
    decoding's verify steps: the last token and up to K = Q - 1 drafts; a short prefill
    chunk fits as well). The graph of size bs holds bs * Q token rows and bs + 1 sequences
    for the varlen kernel (gpu/kernels/triton/paged_attention.py, whose grid depends only on the
    row and sequence counts). A step's real rows come first, packed as eagerly; the rows
    left over belong to sequence b (b the step's sequence count), a padding sequence that
    attends to its own rows of unwritten slots (slot -1) through block 0's entries of its
    table row, and the sequences after it are empty. The real rows' attention, positions
    and KV writes are those of the eager step; the padding rows' outputs are dropped."""

    def __init__(self, model, attn, *, max_bs: int, max_blocks: int, device: torch.device,
                 tokens_per_seq: int, max_context: int | None = None, label: str = "",
                 dtype: torch.dtype | None = None, aux_layers: tuple[int, ...] = ()) -> None:
        assert tokens_per_seq >= 2
        self.q = tokens_per_seq
        self.model, self.attn, self.label = model, attn, label
        self.aux_layers = aux_layers
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        n, q = self.max_bs, self.q
        # the padding sequence may hold up to n * q - 1 rows, each reading its table row
        width = max(max_blocks, -(-(n * q) // attn.cache.block_size))
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(n * q, **i64)
        self.positions = torch.zeros(n * q, **i64)
        self.slot_mapping = torch.full((n * q,), -1, **i64)
        self.block_tables = torch.zeros((n + 1, width), **i32)
        # as captured: bs sequences of q rows each (positions 0..q-1), the padding one empty
        self.cu_seqlens_q = torch.cat([torch.arange(0, n * q + 1, q, **i32),
                                       torch.full((1,), n * q, **i32)])
        self.seq_lens = torch.cat([torch.full((n,), q, **i32), torch.zeros(1, **i32)])
        self.hidden = torch.zeros((n * q, model.config.hidden_size), dtype=dtype or model.dtype,
                                  device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.aux: dict[int, torch.Tensor] = {}
        self.pool = None

    def _tokens(self, bs: int) -> int:
        return bs * self.q

    def _capture_meta(self, bs: int) -> AttentionMetadata:
        # the capture's own layout: bs sequences of q rows, then the padding one empty
        q, t = self.q, bs * self.q
        self.cu_seqlens_q[:bs + 1].copy_(torch.arange(0, t + 1, q, dtype=torch.int32))
        self.cu_seqlens_q[bs + 1:].fill_(t)
        self.seq_lens[:bs].fill_(q)
        self.seq_lens[bs:].zero_()
        return self._views(bs)

    def _views(self, bs: int) -> AttentionMetadata:
        q, t = self.q, bs * self.q
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:t], block_tables=self.block_tables[:bs + 1],
            cu_seqlens_q=self.cu_seqlens_q[:bs + 2], seq_lens=self.seq_lens[:bs + 1],
            q_starts=list(range(0, t + 1, q)) + [t], q_lens=[q] * bs + [0], ctx_lens=[q] * bs + [0],
            start_positions=[0] * (bs + 1), decode_rows=[], prefill_rows=list(range(bs)),
            max_seqlen_q=q, num_kv_splits=1)

    def _log_captured(self) -> None:
        log.info("captured CUDA graphs for %sverify steps of %d tokens a sequence at batch sizes %s",
                 self.label, self.q, self.sizes)

    def fits(self, batch: int, max_blocks: int, max_q: int = 1) -> bool:
        return batch <= self.max_bs and max_blocks <= self.block_tables.shape[1] and max_q <= self.q

    def size_for(self, batch: int) -> int:
        return next(s for s in self.sizes if s >= batch)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self._replay(self.load(input_ids, positions, meta), input_ids.shape[0])

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> int:
        """The step's inputs into the static buffers of the graph that takes it (its size)."""
        t, b = input_ids.shape[0], len(meta.q_lens)
        bs = self.size_for(b)
        n = bs * self.q
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.slot_mapping[:t].copy_(meta.slot_mapping)
        self.slot_mapping[t:n].fill_(-1)
        self.block_tables[:b, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.block_tables[b].zero_()           # the padding sequence reads block 0
        self.cu_seqlens_q[:b + 1].copy_(meta.cu_seqlens_q)
        self.cu_seqlens_q[b + 1:bs + 2].fill_(n)
        self.seq_lens[:b].copy_(meta.seq_lens)
        self.seq_lens[b].fill_(n - t)          # its rows attend causally to their own slots
        self.seq_lens[b + 1:bs + 1].zero_()
        return bs


class HeadVerifyGraphs(_HeadIO, VerifyGraphs):
    """Verify-shaped graphs for an EAGLE head's first forward of a step: up to Q target
    states a sequence to read (after a verify, the accepted run's), packed as
    VerifyGraphs packs a verify step's rows."""

    def __init__(self, head, attn, *, max_bs: int, max_blocks: int, device: torch.device,
                 tokens_per_seq: int, label: str = "the EAGLE head's ") -> None:
        super().__init__(head, attn, max_bs=max_bs, max_blocks=max_blocks, device=device,
                         tokens_per_seq=tokens_per_seq, label=label, dtype=head.residual_dtype)
        self._head_buffers()
