"""Paged attention backends.

KV layout (per layer): k_cache, v_cache of shape [num_blocks, block_size, kv_heads, head_dim].
Token at position p of a sequence lives in slot block_table[p // block_size] * block_size
+ p % block_size. The model calls ``backend.forward(layer, q, k, v, sinks=, window=)`` once
per layer; the backend writes the new k/v through the slot mapping, then attends over each
sequence's whole context (cached prefix + new tokens), causally; with a window, only over
the last `window` positions up to the query's own; with sinks, each head's sink logit joins
the softmax denominator.

Sliding-window layers keep their k/v in the same blocks as full layers, unless the cache is
*hybrid* (KVCache(sliding_layers=..., num_sliding_blocks=...), gpt-oss by default): then the
sliding layers have a smaller pool of their own, and block b of a table holds their k/v in
slot sliding_map[b] (stages/schedule/blocks.py SlidingHalves lends the slots; the plan ships changes,
KVCache.remap applies them). A sliding layer reads its table and slot mapping through that
map (`sliding_view`, once per forward, inside a captured CUDA graph too); blocks the window
no longer reaches map to slot 0 or to another block's slot, which the window masks.

Two backends share one metadata object:
- TorchPagedAttention: CPU (and reference) path. Decodes go in one call of
  gpu/kernels/cpu/ops.c's paged_decode_attention, which reads the blocks in place (where it is
  built: a C compiler, AVX-512); otherwise, and with cpu_kernels=False, they are batched
  into one SDPA call over gathered blocks. Each prefill chunk is its own SDPA call.
- TritonPagedAttention: CUDA path, gpu/kernels/kv_cache.write_kv + paged_attention; on
  CUDA the model instead hands it the raw qkv projection, and one kernel per layer norms,
  rotates and writes (gpu/kernels/triton/qkv_prep.py) before paged_attention.
"""
from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F


@attrs.define
class AttentionMetadata:
    """Per-step layout of the flat token batch, built once by the runner for all layers."""
    slot_mapping: torch.Tensor        # [T] int64
    block_tables: torch.Tensor        # [B, max_blocks] int32 (padded with 0)
    cu_seqlens_q: torch.Tensor        # [B+1] int32
    seq_lens: torch.Tensor            # [B] int32: context incl. the new tokens
    # Host-side copies for the torch path (no device sync needed to read them).
    q_starts: list[int]               # host copy of cu_seqlens_q
    q_lens: list[int]
    ctx_lens: list[int]
    start_positions: list[int]
    decode_rows: list[int]            # sequences with q_len == 1
    prefill_rows: list[int]           # sequences with q_len > 1
    max_seqlen_q: int = 1             # host hint for kernel tile sizes
    num_kv_splits: int = 1            # Triton decode: split each sequence's KV over this many
                                      # programs (flash-decoding); fixed per captured batch size
    # a hybrid model's linear-attention layout (gpu/layers/linear_attention.py StateStep),
    # set by the runner that holds a StatePool; None: every sequence starts from zeros
    states: object = None


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str, *,
                 sliding_layers: tuple[int, ...] = (), num_sliding_blocks: int = 0, latent: int = 0,
                 layer_shapes: tuple[tuple[int, int] | None, ...] | None = None,
                 kv_sources: tuple[int, ...] | None = None) -> None:
        """sliding_layers, num_sliding_blocks: a hybrid cache (those layers in a pool of their own).
        latent: MLA (gpu/layers/mla.py): K rows hold the compressed latent and the rotary key,
        and V is a view of K's first `latent` columns, no memory of its own.
        layer_shapes (ModelConfig.kv_layer_shapes, Gemma 4): each layer's (KV heads, head dim)
        in place of kv_heads, head_dim; None for a layer that reads layer kv_sources[i]'s
        cache, whose k/v it names (no memory of its own; the model attends with that index)."""
        self.sliding_layers = frozenset(sliding_layers)
        self.first_sliding = min(sliding_layers, default=-1)
        dims = layer_shapes or ((kv_heads, head_dim),) * num_layers

        def shape(i: int) -> tuple[int, ...]:
            return (num_sliding_blocks if i in self.sliding_layers else num_blocks, block_size, *dims[i])
        # zeros: a masked-out read (a slot the window no longer reaches) must be finite
        self.k = [torch.zeros(shape(i), dtype=dtype, device=device) if dims[i] else None for i in range(num_layers)]
        self.v = ([k[..., :latent] for k in self.k] if latent else
                  [torch.zeros(shape(i), dtype=dtype, device=device) if dims[i] else None
                   for i in range(num_layers)])
        for i, d in enumerate(dims):
            if d is None:       # a shared-KV layer: its source's tensors
                self.k[i], self.v[i] = self.k[kv_sources[i]], self.v[kv_sources[i]]
        self.latent = latent
        self.num_blocks = num_blocks
        self.num_sliding_blocks = num_sliding_blocks
        # an e4m3 cache's per-layer scales (the checkpoint's k_scale / v_scale, else 1.0):
        # it holds k / k_scale and v / v_scale
        self.k_scale = [1.0] * num_layers
        self.v_scale = [1.0] * num_layers
        self.block_size = block_size
        # block -> its slot in the sliding layers' pool (0 when none: never written, masked)
        self.sliding_map = (torch.zeros(num_blocks, dtype=torch.int64, device=device)
                            if sliding_layers else None)

    def remap(self, updates: tuple[tuple[int, int], ...]) -> None:
        """Apply (block, slot or -1) changes to sliding_map (in place: captured graphs read it)."""
        blocks, slots = zip(*updates)
        dev = self.sliding_map.device
        self.sliding_map[torch.tensor(blocks, device=dev)] = torch.tensor(slots, device=dev).clamp(min=0)

    def sliding_view(self, meta: "AttentionMetadata") -> "AttentionMetadata":
        """meta with the sliding layers' slot mapping and block tables (device ops only)."""
        m, bs = self.sliding_map, self.block_size
        slots = meta.slot_mapping
        mapped = m[(slots // bs).clamp(min=0)] * bs + slots % bs
        return attrs.evolve(meta, slot_mapping=torch.where(slots >= 0, mapped, slots),  # -1: padding
                            block_tables=m[meta.block_tables.long()].to(meta.block_tables.dtype))

    def set_scales(self, scales: dict[int, tuple[float, float]]) -> None:
        """Layer -> (k_scale, v_scale) for an e4m3 cache (the checkpoint's; others stay 1.0)."""
        for layer, (k, v) in scales.items():
            if not (k > 0 and v > 0):
                raise ValueError(f"layer {layer}'s KV cache scales must be positive, got k {k}, v {v}")
            self.k_scale[layer], self.v_scale[layer] = float(k), float(v)

    @staticmethod
    def dtype_for(kv_cache_dtype: str, model_dtype: torch.dtype, device) -> torch.dtype:
        """--kv-cache-dtype -> the cache's dtype: auto, the model's; fp8 (fp8_e4m3): e4m3,
        stored divided by the layer's scale and upcast where attention reads it (on a CPU the
        torch paths: the C decode attention and the fused C decode step take fp32/bf16 caches
        only; on CUDA the Triton kernels, sm_89 or later for e4m3 conversions)."""
        if kv_cache_dtype == "auto":
            return model_dtype
        if kv_cache_dtype not in ("fp8", "fp8_e4m3"):
            raise ValueError(f"--kv-cache-dtype {kv_cache_dtype!r}: choose auto, fp8 or fp8_e4m3")
        device = torch.device(device)
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError("--kv-cache-dtype fp8 on CUDA needs compute capability 8.9 or later (e4m3 "
                             f"conversions); this GPU is {torch.cuda.get_device_capability(device)}")
        return torch.float8_e4m3fn

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int,
                        dtype: torch.dtype, latent: int = 0,
                        layer_shapes: tuple[tuple[int, int] | None, ...] | None = None) -> int:
        """layer_shapes (ModelConfig.kv_layer_shapes): the layers' own shapes, in place of
        num_layers x kv_heads x head_dim; a layer reading another's cache counts nothing."""
        elem = torch.empty((), dtype=dtype).element_size()
        if layer_shapes is not None:
            return 2 * block_size * elem * sum(h * d for h, d in filter(None, layer_shapes))
        return (1 if latent else 2) * num_layers * block_size * kv_heads * head_dim * elem


def hybrid_layout(config, num_blocks: int, block_size: int, max_num_seqs: int,
                  max_num_batched_tokens: int) -> tuple[int, tuple[int, ...], int]:
    """(full-layer blocks, sliding layers, sliding slots) of a KV cache in the memory of
    `num_blocks` plain blocks; no sliding layers when the model has none (or all are) or the
    split would save nothing."""
    L = config.num_hidden_layers
    shapes = getattr(config, "kv_layer_shapes", None)    # per-layer shapes: the layers owning KV only
    owners = [i for i in range(L) if shapes is None or shapes[i] is not None]
    sliding = tuple(i for i in owners if config.layer_window(i) is not None)
    if not sliding or len(sliding) == len(owners):
        return num_blocks, (), 0
    window = max(config.layer_window(i) for i in sliding)

    def size(i: int) -> int:
        return 1 if shapes is None else shapes[i][0] * shapes[i][1]
    weights = (sum(size(i) for i in owners if i not in sliding), sum(size(i) for i in sliding))
    full, slots = split_for_sliding(num_blocks, len(owners), len(sliding), window, block_size, max_num_seqs,
                                    max_num_batched_tokens, weights=weights)
    return (num_blocks, (), 0) if slots >= num_blocks else (full, sliding, slots)


def split_for_sliding(num_blocks: int, num_layers: int, num_sliding_layers: int, window: int,
                      block_size: int, max_num_seqs: int, max_num_batched_tokens: int, *,
                      weights: tuple[int, int] | None = None) -> tuple[int, int]:
    """A hybrid KV cache in the memory of `num_blocks` plain blocks: (full-layer blocks,
    sliding-layer slots). The sliding pool holds what the running sequences can need at
    once: each one's window (ceil((window - 1) / block_size) + 1 blocks) plus the block its
    in-flight step writes, and two steps' worth of prefill chunks (one planned ahead); the
    memory this frees goes to more full-layer blocks. When that pool would be as large as
    the cache, no split: (num_blocks, num_blocks). weights: the full layers' and the sliding
    layers' sizes a block (their KV heads x head dims summed: layers of different shapes,
    Gemma 4); default one a layer."""
    per_seq = -(-(window - 1) // block_size) + 2
    slots = max_num_seqs * per_seq + 2 * -(-max_num_batched_tokens // block_size)
    if slots >= num_blocks:
        return num_blocks, num_blocks
    full_w, sliding_w = weights or (num_layers - num_sliding_layers, num_sliding_layers)
    budget = num_blocks * (full_w + sliding_w)         # in (block x layer size) units
    return (budget - slots * sliding_w) // full_w, slots


def window_visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[Q, K] bool: key position k_pos[j] is visible to query position q_pos[i] (causal, windowed)."""
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    return visible


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None,
         scale: float | None, sink_logits: torch.Tensor | None = None, is_causal: bool = False,
         softcap: float | None = None) -> torch.Tensor:
    """SDPA over q [B, H, Q, D], k/v [B, Hk, K, D] (GQA when Hk < H), visible broadcastable to
    [B, H, Q, K]. sink_logits, broadcastable to [B, H, Q, 1], join each softmax denominator as
    one extra key whose score is the sink and whose value is zero: softmax over [scores, sink]
    with the sink's column dropped, as gpt-oss computes it. softcap (Gemma 2): each scaled
    score s becomes softcap * tanh(s / softcap) before the mask and the softmax."""
    if softcap:
        return _softcapped(q, k, v, visible, scale, sink_logits, is_causal, softcap)
    if sink_logits is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, is_causal=is_causal,
                                              scale=scale, enable_gqa=True)
    B, H, Q, _ = q.shape
    K = k.shape[-2]
    if visible is None:
        visible = torch.ones(Q, K, dtype=torch.bool, device=q.device).tril(K - Q)
    zero = k.new_zeros(*k.shape[:-2], 1, k.shape[-1])
    k, v = torch.cat([k, zero], dim=-2), torch.cat([v, zero], dim=-2)
    bias = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill(~visible, float("-inf"))
    bias = torch.cat([bias.expand(B, H, Q, K), sink_logits.to(q.dtype).expand(B, H, Q, 1)], dim=-1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=True)


def _softcapped(q, k, v, visible, scale, sink_logits, is_causal, cap) -> torch.Tensor:
    """sdpa with soft-capped scores, spelled out in fp32 (torch's SDPA has no soft-capping)."""
    B, H, Q, D = q.shape
    K, group = k.shape[-2], H // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1) if group > 1 else k.float()
    vf = v.float().repeat_interleave(group, dim=1) if group > 1 else v.float()
    scores = q.float() @ kf.transpose(-1, -2) * (D ** -0.5 if scale is None else scale)  # [B, H, Q, K]
    scores = torch.tanh(scores / cap) * cap
    if visible is None and is_causal:
        visible = torch.ones(Q, K, dtype=torch.bool, device=q.device).tril(K - Q)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    if sink_logits is not None:
        sink = sink_logits.float().expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return (probs @ vf).to(q.dtype)


def _decode_kernels(cache: KVCache):
    """gpu/cpu_kernels for a CPU cache of fp32 or bf16, when built with AVX-512 loops (the
    only ones measured against gather + SDPA); else None."""
    if not cache.k or cache.k[0].device.type != "cpu":
        return None
    from gpu.kernels.cpu import ops as cpu_kernels
    if not cpu_kernels.supports(cache.k[0].dtype):
        return None
    kernels = cpu_kernels.kernels()
    return kernels if kernels is not None and kernels.vector_width else None


class TorchPagedAttention:
    fused_qkv = False     # takes q, k, v normed and roped (gpu/models/causal_lm.py AttentionBackend)

    def __init__(self, cache: KVCache, scale: float, *, cpu_kernels: bool = True) -> None:
        """cpu_kernels: decode rows through gpu/kernels/cpu/ops.c where it is available (False:
        always gather + SDPA, the reference path)."""
        self.cache = cache
        self.scale = scale
        self.meta: AttentionMetadata | None = None
        self._decode_blocks: torch.Tensor | None = None
        self._decode_mask: torch.Tensor | None = None
        self._decode_rows: torch.Tensor | None = None
        self._decode_lens: torch.Tensor | None = None
        self._decode_windowed: dict[int, torch.Tensor] = {}
        self._sliding: TorchPagedAttention | None = None
        # decode rows through gpu/kernels/cpu/ops.c (reads the blocks in place) where it is built
        # and vectorised; None: the gather + SDPA path below
        self.kernels = _decode_kernels(cache) if cpu_kernels else None
        self._c_args: tuple | None = None

    # a chunk of at most this many tokens after a cached context (a verify pass: the last
    # token and its drafts) attends as that many decode rows, each seeing the context up
    # to its own position, in the decode rows' one batched call (not one call per chunk)
    SHORT_CHUNK = 8

    def prepare(self, meta: AttentionMetadata) -> None:
        """Precompute what every layer reuses: the decode rows' blocks and mask."""
        self.meta = meta
        self._sliding = None    # a hybrid cache's sliding layers: made by the first of them
        self._decode_blocks = self._decode_mask = self._decode_rows = self._c_args = None
        self._decode_windowed = {}
        # the query rows that attend as decodes: (sequence, query row, keys it sees)
        seqs, q_rows, lens = [], [], []
        self._prefill_rows = []
        for r, ql in enumerate(meta.q_lens):
            if ql == 1:
                seqs.append(r)
                q_rows.append(meta.q_starts[r])
                lens.append(meta.ctx_lens[r])
            elif ql <= self.SHORT_CHUNK and meta.start_positions[r] > 0:
                s, ctx = meta.q_starts[r], meta.ctx_lens[r]
                seqs.extend([r] * ql)
                q_rows.extend(range(s, s + ql))
                lens.extend(range(ctx - ql + 1, ctx + 1))
            else:
                self._prefill_rows.append(r)
        self._num_decode = len(q_rows)
        if q_rows:
            bs = self.cache.block_size
            dev = meta.block_tables.device  # every index and mask lives with the metadata
            nblk = -(-max(lens) // bs)
            plain = all(q == 1 for q in meta.q_lens)      # every sequence one decode row
            # when every query row decodes, in order, they need no gather/scatter
            all_rows = q_rows == list(range(len(meta.slot_mapping)))
            table = (meta.block_tables[:, :nblk] if plain else
                     meta.block_tables[torch.tensor(seqs, device=dev), :nblk])
            self._decode_blocks = table.to(torch.int64).flatten()                      # [B*nblk]
            lens_t = (meta.seq_lens.to(torch.int64) if plain
                      else torch.tensor(lens, dtype=torch.int64, device=dev))
            self._decode_mask = (torch.arange(nblk * bs, device=dev)[None, :] < lens_t[:, None])[:, None, None, :]
            self._decode_lens = lens_t
            if not all_rows:
                self._decode_rows = torch.tensor(q_rows, device=dev)
            if self.kernels is not None:
                # the C kernel's per-step arguments: tables, lengths, query rows and, when
                # every sequence decodes one token, the slots it writes this step's k/v to
                # itself (a short chunk's rows must see each other's: written beforehand)
                qr = torch.arange(len(q_rows), device=dev) if all_rows else self._decode_rows
                slots = meta.slot_mapping.index_select(0, qr).to(torch.int64) if plain else None
                self._c_args = (table.to(torch.int32).contiguous(), lens_t.contiguous(), qr, slots)

    def _decode_visible(self, window: int | None) -> torch.Tensor:
        """[B, 1, 1, K] decode mask; with a window, also drop keys older than the last `window`
        (built once per step and window, shared by that window's layers)."""
        if window is None:
            return self._decode_mask
        if window not in self._decode_windowed:
            lens, K = self._decode_lens, self._decode_mask.shape[-1]
            recent = torch.arange(K, device=lens.device)[None, :] >= (lens - window)[:, None]  # query at lens - 1
            self._decode_windowed[window] = self._decode_mask & recent[:, None, None, :]
        return self._decode_windowed[window]

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                sinks: torch.Tensor | None = None, window: int | None = None,
                softcap: float | None = None, prefills: bool = True) -> torch.Tensor:
        """prefills=False (MLA's expanded prefill, gpu/layers/mla.py): every row's k/v written,
        only the decode rows attended; the prefill rows of the output are left unset."""
        if not prefills:
            return self._attend(layer, q, k, v, None, None, skip_prefills=True)
        if layer in self.cache.sliding_layers:
            if layer == self.cache.first_sliding or self._sliding is None:
                self._sliding = TorchPagedAttention(self.cache, self.scale,
                                                    cpu_kernels=self.kernels is not None)
                self._sliding.prepare(self.cache.sliding_view(self.meta))
            return self._sliding._attend(layer, q, k, v, sinks, window, softcap)
        return self._attend(layer, q, k, v, sinks, window, softcap)

    def _attend(self, layer: int, q, k, v, sinks, window, softcap=None, skip_prefills=False) -> torch.Tensor:
        meta = self.meta
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        flat_k = kc.view(-1, kc.shape[2], kc.shape[3])
        flat_v = vc.view(-1, vc.shape[2], vc.shape[3])
        out = q.new_empty(*q.shape[:-1], v.shape[-1])      # MLA: V narrower than Q and K
        # the C kernel writes the step's k/v itself when every row decodes (its slots)
        kernel_writes = self._c_args is not None and self._c_args[3] is not None
        if not kernel_writes:
            _store(flat_k, meta.slot_mapping, k, self.cache.k_scale[layer])
            _store(flat_v, meta.slot_mapping, v, self.cache.v_scale[layer])
        if (self._c_args is not None and not softcap     # the C kernel has no soft-capping
                and self._kernel_decode(layer, q, k, v, out, sinks, window)):
            if not self._prefill_rows or skip_prefills:
                return out
        else:
            if kernel_writes:   # it declined: nothing it may have written differs from these
                _store(flat_k, meta.slot_mapping, k, self.cache.k_scale[layer])
                _store(flat_v, meta.slot_mapping, v, self.cache.v_scale[layer])
            out = self._torch_decode(layer, q, out, sinks, window, softcap)
            if not self._prefill_rows or skip_prefills:
                return out
        return self._prefill(q, k, v, out, sinks, window, flat_k, flat_v, softcap,
                                 (self.cache.k_scale[layer], self.cache.v_scale[layer]))

    def decode_layout(self) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] | None:
        """The prepared step's rows that attend as decodes (short chunks' rows included):
        (their query rows, None when they are every row in order; their block tables [B, nblk]
        int64; the keys each sees [B] int64), or None when there are none."""
        if not self._num_decode:
            return None
        return self._decode_rows, self._decode_blocks.view(self._num_decode, -1), self._decode_lens

    def prefill_spans(self) -> tuple[tuple[int, int, int, int], ...]:
        """The prepared step's sequences that attend as prefills (not as decode rows): (their
        first query row, one past their last, their first position, their sequence index)."""
        m = self.meta
        return tuple((m.q_starts[r], m.q_starts[r + 1], m.start_positions[r], r) for r in self._prefill_rows)

    def context(self, layer: int, seq: int, dtype: torch.dtype) -> torch.Tensor:
        """[ctx, Hkv, D]: the cached K rows of the step's sequence `seq`, positions 0 .. ctx - 1
        (this step's written already), in dtype."""
        m, bs = self.meta, self.cache.block_size
        ctx = m.ctx_lens[seq]
        table = m.block_tables[seq, :-(-ctx // bs)].to(torch.int64)
        slots = (table[:, None] * bs + torch.arange(bs, device=table.device)).reshape(-1)[:ctx]
        kc = self.cache.k[layer]
        return _load(kc.view(-1, kc.shape[2], kc.shape[3]), slots, dtype, self.cache.k_scale[layer])

    def attend_prefills(self, layer: int, q, k, v, out) -> torch.Tensor:
        """out with the prepared step's prefill rows, their k/v written already (MLA on CUDA:
        gpu/layers/attention.py TritonPagedAttention sends its prefills here)."""
        if not self._prefill_rows:
            return out
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        flat_k = kc.view(-1, kc.shape[2], kc.shape[3])
        flat_v = vc.view(-1, vc.shape[2], vc.shape[3])
        return self._prefill(q, k, v, out, None, None, flat_k, flat_v)

    def _kernel_decode(self, layer: int, q, k, v, out, sinks, window) -> bool:
        """The decode rows through the C kernel (which also writes their k/v when no prefill
        shares the step); False when it declines, having written nothing the torch path
        would not rewrite."""
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        if (q.dtype != kc.dtype or k.dtype != kc.dtype or q.stride(-1) != 1 or q.stride(-2) != q.shape[-1]
                or vc.shape[-1] != kc.shape[-1]):      # MLA's latent cache: the torch path
            return False
        tables, lens, q_rows, slots = self._c_args
        new_kv = None
        if slots is not None:
            if k.stride()[1:] != (k.shape[-1], 1) or v.stride()[1:] != (v.shape[-1], 1):
                return False
            new_kv = (k, v)
        return self.kernels.paged_decode_attention(
            q, q_rows, out, kc, vc, tables, lens, self.scale, new_kv=new_kv, slots=slots,
            sinks=None if sinks is None else sinks.float().contiguous(), window=window)

    def _torch_decode(self, layer: int, q, out, sinks, window, softcap=None) -> torch.Tensor:
        """out with the decode rows: their blocks gathered, one SDPA call (k/v already written)."""
        meta = self.meta
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        if self._num_decode:
            B, (_, bs, hkv, d) = self._num_decode, kc.shape
            rows = self._decode_rows
            qd = q if rows is None else q.index_select(0, rows)
            # GQA folded into the query axis: the G query heads of a KV head are G query rows
            qd = qd.reshape(B, hkv, -1, d)                                      # [B, Hkv, G, D]
            kd = _load(kc, self._decode_blocks, q.dtype, self.cache.k_scale[layer]).view(B, -1, hkv, d).transpose(1, 2)
            vd = _load(vc, self._decode_blocks, q.dtype, self.cache.v_scale[layer]).view(B, -1, hkv, vc.shape[-1]).transpose(1, 2)
            sink = None if sinks is None else sinks.view(1, hkv, -1, 1)         # head h = kv * G + g
            od = sdpa(qd, kd, vd, self._decode_visible(window), self.scale, sink,
                      softcap=softcap)                                          # [B, Hkv, G, D]
            od = od.reshape(B, -1, od.shape[-1])                                # [B, Hq, Dv]
            if rows is None:
                return od
            out.index_copy_(0, rows, od)
        return out

    def _prefill(self, q, k, v, out, sinks, window, flat_k, flat_v, softcap=None, scales=(1.0, 1.0)) -> torch.Tensor:
        """out with the prefill rows: one SDPA call each (k/v already written)."""
        meta, starts = self.meta, self.meta.q_starts
        for r in self._prefill_rows:
            s, e = starts[r], starts[r + 1]
            qp = q[s:e].transpose(0, 1)[None]                                   # [1, Hq, Q, D]
            start = meta.start_positions[r]
            sink = None if sinks is None else sinks.view(1, -1, 1, 1)
            if start == 0:  # no cached prefix: the new k/v are the whole context
                kp, vp = k[s:e].transpose(0, 1)[None], v[s:e].transpose(0, 1)[None]
                if window is None and sink is None:
                    op = sdpa(qp, kp, vp, None, self.scale, is_causal=True, softcap=softcap)
                else:
                    pos = torch.arange(e - s, device=meta.block_tables.device)
                    op = sdpa(qp, kp, vp, window_visible(pos, pos, window), self.scale, sink, softcap=softcap)
            else:
                ctx = meta.ctx_lens[r]
                bs = self.cache.block_size
                nblk = -(-ctx // bs)
                dev = meta.block_tables.device
                table = meta.block_tables[r, :nblk].to(torch.int64)
                slots = (table[:, None] * bs + torch.arange(bs, device=dev)).reshape(-1)[:ctx]
                kp = _load(flat_k, slots, q.dtype, scales[0]).transpose(0, 1)[None]        # [1, Hkv, ctx, D]
                vp = _load(flat_v, slots, q.dtype, scales[1]).transpose(0, 1)[None]
                qpos = torch.arange(start, start + (e - s), device=dev)
                mask = window_visible(qpos, torch.arange(ctx, device=dev), window)  # [Q, ctx]
                op = sdpa(qp, kp, vp, mask, self.scale, sink, softcap=softcap)
            out[s:e] = op[0].transpose(0, 1)
        return out


E4M3_MAX = 448.0   # float8_e4m3fn's largest finite value (it has no infinity: past it, NaN)


def _store(flat: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float = 1.0) -> None:
    """flat[slots] = x, or for an fp8 cache e4m3(x / scale) (saturating) through byte views:
    torch's CPU index_copy_ takes no float8."""
    if flat.dtype != torch.float8_e4m3fn:
        flat.index_copy_(0, slots, x)
        return
    x8 = (x.float() * (1.0 / scale)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    flat.view(torch.uint8).index_copy_(0, slots, x8.view(torch.uint8))


def _load(cache: torch.Tensor, index: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """cache's rows at index; an fp8 cache's upcast to dtype and times its scale (in fp32)."""
    if cache.dtype != torch.float8_e4m3fn:
        return cache.index_select(0, index)
    x8 = cache.view(torch.uint8).index_select(0, index).view(torch.float8_e4m3fn)
    return x8.to(dtype) if scale == 1.0 else (x8.float() * scale).to(dtype)


class TritonPagedAttention:
    """CUDA path: one kernel writes k/v, one kernel attends over the mixed batch.

    With ``fused_qkv`` (on for a CUDA cache) the model hands over the raw qkv projection
    instead: `write_qkv` norms and rotates q and k and writes k/v into the cache in one
    kernel (gpu/kernels/triton/qkv_prep.py), and `attend` attends; `forward` is the unfused
    path (write_kv, then attend)."""

    def __init__(self, cache: KVCache, scale: float) -> None:
        from gpu.kernels.triton.kv_cache import write_kv
        from gpu.kernels.triton.paged_attention import paged_attention
        self._write_kv, self._attend = write_kv, paged_attention
        self.cache = cache
        self.scale = scale
        self.meta: AttentionMetadata | None = None
        self.fused_qkv = cache.k[0].is_cuda if cache.k else False
        self._sliding: AttentionMetadata | None = None
        # MLA's latent cache: decode rows through gpu/kernels/triton/mla_decode.py; this torch
        # path classifies a mixed step's rows and reads a prefill's latent context back
        # (gpu/layers/mla.py expands it), or attends the prefills over the latent when asked
        self._latent_torch = TorchPagedAttention(cache, scale, cpu_kernels=False) if cache.latent else None

    def prepare(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        self._sliding = None
        if self._latent_torch is not None and meta.max_seqlen_q > 1:
            self._latent_torch.prepare(meta)

    def _layer_meta(self, layer: int, *, writing: bool = False) -> AttentionMetadata:
        """The step's metadata, or for a sliding layer its view through the sliding map."""
        if layer not in self.cache.sliding_layers:
            return self.meta
        # remade by the first sliding layer's k/v write of every forward: inside a captured graph too
        if self._sliding is None or (writing and layer == self.cache.first_sliding):
            self._sliding = self.cache.sliding_view(self.meta)
        return self._sliding

    def write_qkv(self, layer: int, qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                  head_dim: int, q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None,
                  eps: float, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """qkv [T, (Hq + 2 Hkv) Dh] -> q [T, Hq, Dh] normed and rotated; k and v (k normed
        and rotated) written into layer's cache."""
        from gpu.kernels.triton.qkv_prep import prepare_qkv
        return prepare_qkv(qkv, num_q_heads, num_kv_heads, head_dim, q_norm_weight, k_norm_weight,
                           eps, positions, cos_sin, self.cache.k[layer], self.cache.v[layer],
                           self._layer_meta(layer, writing=True).slot_mapping,
                           self.cache.k_scale[layer], self.cache.v_scale[layer])

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                sinks: torch.Tensor | None = None, window: int | None = None,
                softcap: float | None = None, prefills: bool = True) -> torch.Tensor:
        if self.cache.latent:
            return self._latent_forward(layer, q, k, v, prefills)
        self._write_kv(k, v, self.cache.k[layer], self.cache.v[layer],
                       self._layer_meta(layer, writing=True).slot_mapping,
                       self.cache.k_scale[layer], self.cache.v_scale[layer])
        return self.attend(layer, q, sinks=sinks, window=window, softcap=softcap)

    def prefill_spans(self) -> tuple[tuple[int, int, int, int], ...]:
        """MLA: TorchPagedAttention.prefill_spans (none in a decode-only step: no host work
        there, so a captured decode graph stays valid)."""
        if self._latent_torch is None or self.meta.max_seqlen_q <= 1:
            return ()
        return self._latent_torch.prefill_spans()

    def context(self, layer: int, seq: int, dtype: torch.dtype) -> torch.Tensor:
        return self._latent_torch.context(layer, seq, dtype)

    def _latent_forward(self, layer: int, q, k, v, prefills: bool = True) -> torch.Tensor:
        """MLA (gpu/layers/mla.py): q [T, H, R + P] absorbed, k [T, 1, R + P] the new latent
        rows, v their first R columns -> [T, H, R]. A decode step is one kernel over device
        metadata alone (CUDA-graph safe); a mixed step's decode rows go through the kernel
        and its prefills through SDPA over the latent, unless prefills=False (gpu/layers/mla.py
        expands them itself: their rows of the output are left unset)."""
        from gpu.kernels.triton.mla_decode import mla_decode
        kc, m, r = self.cache.k[layer], self.meta, self.cache.latent
        self._write_kv(k, k, kc, kc, m.slot_mapping)     # V is a view of K's first R columns
        if m.max_seqlen_q <= 1:
            return mla_decode(q, kc, m.block_tables, m.seq_lens, self.scale, r, num_kv_splits=m.num_kv_splits)
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("MLA: a step with prefill rows runs eagerly (its layout is built on the host)")
        t = self._latent_torch
        out = q.new_empty(*q.shape[:-1], r)
        layout = t.decode_layout()
        if layout is not None:
            rows, table, lens = layout
            qd = q if rows is None else q.index_select(0, rows)
            od = mla_decode(qd.contiguous(), kc, table.to(torch.int32), lens.to(torch.int32), self.scale, r)
            if rows is None:
                out = od
            else:
                out.index_copy_(0, rows, od)
        return t.attend_prefills(layer, q, k, v, out) if prefills else out

    def attend(self, layer: int, q: torch.Tensor, *, sinks: torch.Tensor | None = None,
               window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """q [T, Hq, Dh] over the cache, whose k/v for this step are written already."""
        m = self._layer_meta(layer)
        return self._attend(q, self.cache.k[layer], self.cache.v[layer], m.block_tables,
                            m.cu_seqlens_q, m.seq_lens, self.scale, max_seqlen_q=m.max_seqlen_q,
                            num_kv_splits=m.num_kv_splits if m.max_seqlen_q <= 1 else 1,
                            sinks=sinks, window=window, softcap=softcap,
                            k_scale=self.cache.k_scale[layer], v_scale=self.cache.v_scale[layer])
