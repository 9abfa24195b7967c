"""Paged attention over a block-table KV cache, for mixed prefill/decode batches.

Layout
    q            [T, Hq, Dh]       the new tokens of every sequence, packed
    k_cache      [num_blocks, block_size, Hkv, Dh]   (v_cache the same)
    block_tables [B, max_blocks] int32: page ids of sequence b, in order
    cu_seqlens_q [B + 1] int32: sequence b owns q rows cu[b]:cu[b+1]
    seq_lens     [B] int32: total context of b, *including* its new tokens
                 (whose K/V are already written to the cache)

Query j of sequence b sits at position seq_lens[b] - q_len_b + j and attends to
cache positions 0..that position (with a sliding window W, only to the last W of
them, its own included).  Hq = Hkv * group (GQA).  With sinks [Hq] (gpt-oss), each
head's softmax denominator gains exp(sink[h]), a key whose value is zero.

Algorithm (flash-attention style online softmax, fp32 accumulation):
one program owns a tile of BLOCK_Q consecutive query tokens of one sequence and
one KV head, and processes the whole GQA group of that KV head at once, so the
tile has BLOCK_Q * group rows and each K/V tile is loaded once for the group.
Tiles are numbered without a host sync: sequence b's tiles start at
cu[b] // BLOCK_Q + b (at most T // BLOCK_Q + B tiles in all), and a program
finds its sequence by binary search over cu_seqlens_q.  K/V are read in tiles of
BLOCK_N positions; each position looks up its own page, so any block_size works.
With a window, a tile starts at the first KV tile its earliest query can see.
A sink starts the online softmax: the running max at the sink's logit and the
running sum at exp(0) = 1 (in split 0 only, so the combine counts it once).

Pure decode (max_seqlen_q=1: every sequence has one new token, row b is sequence b)
runs its own kernel, _decode_attention_kernel, on a grid of (sequence, KV head, split):
no search, every program busy, KV tiles of 64 positions, three pipeline stages. With
num_kv_splits > 1 (flash-decoding) each program takes one contiguous share of the
sequence's KV tiles, and _combine_splits_kernel merges the partial softmaxes.

Any strides work for the caches (head_dim contiguous): a cache kept as
[num_blocks, Hkv, block_size, Dh] is passed as its .transpose(1, 2) view
(gpu/kernels/triton/bench.py measures both layouts).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from gpu.kernels.triton.fp8_kv import from_e4m3_bytes

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _softmax_start(sinks_ptr, head, row_mask, split, BLOCK_M: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Running max and sum of the online softmax before the first KV tile. A sink starts
    them at its logit and exp(0) = 1, in split 0 only, so the combine counts it once."""
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head, mask=row_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_i = tl.where(split == 0, sink, float("-inf"))
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.where(split == 0, 1.0, 0.0)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    return m_i, l_i


@triton.jit
def _softcap(s, cap):
    """cap * tanh(s / cap), s and cap both in base-2 units (times log2(e)):
    tanh(x) = 2 sigmoid(2x) - 1, finite at either end."""
    return cap * (2.0 / (1.0 + tl.exp(-2.0 * s / cap)) - 1.0)


@triton.jit
def _split_range(kv_lo, kv_end, split, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """The KV positions [kv_start, kv_stop) of this program: all of kv_lo..kv_end, or with
    NUM_SPLITS > 1 (flash-decoding) one contiguous share of its KV tiles."""
    kv_start = kv_lo
    kv_stop = kv_end
    if NUM_SPLITS > 1:
        tiles_per_split = tl.cdiv(tl.cdiv(kv_end - kv_lo, BLOCK_N), NUM_SPLITS)
        kv_start = kv_lo + split * tiles_per_split * BLOCK_N
        kv_stop = tl.minimum(kv_end, kv_start + tiles_per_split * BLOCK_N)
    return kv_start, kv_stop


@triton.jit
def _load_kv_tile(k_cache_ptr, v_cache_ptr, table, offs_n, n_mask, kv_head, offs_d, d_mask,
                  stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                  PAGE_SIZE: tl.constexpr, UPCAST: tl.constexpr, FP8_KV: tl.constexpr = False):
    """K transposed [BLOCK_D, BLOCK_N] and V [BLOCK_N, BLOCK_D] at KV positions offs_n of one
    sequence (table: its row of the block table): each position looks up its own page."""
    page = tl.load(table + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
    in_page = offs_n % PAGE_SIZE
    k = tl.load(k_cache_ptr + page[None, :] * stride_kb + in_page[None, :] * stride_ks
                + kv_head * stride_kh + offs_d[:, None],
                mask=n_mask[None, :] & d_mask[:, None], other=0)
    v = tl.load(v_cache_ptr + page[:, None] * stride_vb + in_page[:, None] * stride_vs
                + kv_head * stride_vh + offs_d[None, :],
                mask=n_mask[:, None] & d_mask[None, :], other=0)
    if FP8_KV:   # e4m3 codes: their values (the layer's scales are applied to the scores and the output)
        k = from_e4m3_bytes(k)
        v = from_e4m3_bytes(v)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _online_softmax_step(s, visible, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """Folds one KV tile into the running max m_i, sum l_i and output acc: s [BLOCK_M, BLOCK_N]
    its scores (base 2), hidden where not visible, v [BLOCK_N, BLOCK_D] its values."""
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen nothing yet keeps m = -inf; shift by 0 to avoid inf - inf.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_shift[:, None])
    alpha = tl.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc += tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# Shape arguments that change every step are not specialised (Triton would otherwise
# compile a new variant whenever one equals 1 or turns a multiple of 16, in the middle of
# a timed run): a variant buys nothing for them.
# The step's metadata arrays are staged back to back (gpu/runner.Staging): padded to 16
# bytes there, and not specialised on alignment here either (scalar and gathered loads
# gain nothing from it), so no staging layout can ever mean a new variant.
@triton.jit(do_not_specialize=["num_seqs", "stride_os", "stride_bt"],
            do_not_specialize_on_alignment=["block_tables_ptr", "cu_seqlens_q_ptr", "seq_lens_ptr"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, cu_seqlens_q_ptr, seq_lens_ptr,
    m_part_ptr, l_part_ptr,  # [splits, T, Hq] fp32 (only with NUM_SPLITS > 1)
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    num_seqs,
    stride_qt, stride_qh,
    stride_ot, stride_oh,  # out is acc_part [splits, T, Hq, Dh] fp32 with NUM_SPLITS > 1
    stride_os,  # split stride of the partial buffers
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    sinks_ptr,  # [Hq] sink logits (read only with HAS_SINKS)
    window,  # keys per query, its own included (read only with SLIDING)
    softcap,  # Gemma 2's cap * log2(e) (read only with SOFTCAP)
    v_scale,  # an fp8 cache's v scale (read only with FP8_KV; k's is in qk_scale)
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_SINKS: tl.constexpr = False,
    SLIDING: tl.constexpr = False,
    CAUSAL: tl.constexpr = True,
    SOFTCAP: tl.constexpr = False,
    FP8_KV: tl.constexpr = False,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Largest b with cu[b] // BLOCK_Q + b <= pid.
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        mid_start = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(mid_start <= pid, mid, lo)
        hi = tl.where(mid_start <= pid, hi, mid)
    seq = lo

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    tile = pid - (q_start // BLOCK_Q + seq)
    if tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len  # cache position of query 0

    offs_m = tl.arange(0, BLOCK_M)
    tok = tile * BLOCK_Q + offs_m // GROUP  # query index within the sequence
    head = kv_head * GROUP + offs_m % GROUP
    row_mask = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = first_pos + tok
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM

    q_rows = (q_start + tok).to(tl.int64)
    q_ptrs = q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i, l_i = _softmax_start(sinks_ptr, head, row_mask, split, BLOCK_M, HAS_SINKS)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # The last query of this tile sees positions < kv_end (every query sees the whole
    # context when not causal: an encoder's bidirectional attention).
    last_tok = tl.minimum(q_len, (tile + 1) * BLOCK_Q)
    kv_end = first_pos + last_tok
    if not CAUSAL:
        kv_end = seq_len
    kv_lo = 0
    if SLIDING:  # the first query of the tile sees positions > its own - window
        kv_lo = tl.maximum(first_pos + tile * BLOCK_Q - window + 1, 0) // BLOCK_N * BLOCK_N
    kv_start, kv_stop = _split_range(kv_lo, kv_end, split, BLOCK_N, NUM_SPLITS)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start_n in range(kv_start, kv_stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, table, offs_n, n_mask, kv_head, offs_d, d_mask,
                             stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                             PAGE_SIZE, UPCAST, FP8_KV)
        if FP8_KV and not UPCAST:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if SOFTCAP:
            s = _softcap(s, softcap)
        if CAUSAL:
            visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        else:
            visible = n_mask[None, :] & row_mask[:, None]
        if SLIDING:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = _online_softmax_step(s, visible, v, m_i, l_i, acc, DOT_PRECISION)

    o_mask = row_mask[:, None] & d_mask[None, :]
    if FP8_KV:
        acc = acc * v_scale
    if NUM_SPLITS > 1:
        # Unnormalized partials; _combine_splits_kernel merges them.
        part = split.to(tl.int64) * stride_os + q_rows * stride_ot + head * stride_oh
        tl.store(out_ptr + part[:, None] + offs_d[None, :], acc, mask=o_mask)
        # acc_part is contiguous [splits, T, Hq, Dh]: its offset / Dh indexes m_part and l_part.
        ml_offs = (split.to(tl.int64) * stride_os + q_rows * stride_ot + head * stride_oh) // HEAD_DIM
        tl.store(m_part_ptr + ml_offs, m_i, mask=row_mask)
        tl.store(l_part_ptr + ml_offs, l_i, mask=row_mask)
    else:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / l_safe[:, None]
        o_ptrs = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit(do_not_specialize=["stride_os", "stride_bt"],
            do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr"])
def _decode_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, seq_lens_ptr,
    m_part_ptr, l_part_ptr,  # [splits, B, Hq] fp32 (only with NUM_SPLITS > 1)
    qk_scale,
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_os,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    sinks_ptr,
    window,
    softcap,
    v_scale,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_SINKS: tl.constexpr = False,
    SLIDING: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
    FP8_KV: tl.constexpr = False,
):
    """Pure decode: query row b is sequence b's one new token (cu_seqlens_q = 0..B), so
    the grid is (B, Hkv, splits) with every program busy: no search over cu_seqlens_q and
    no tile that exits at once. One program takes the GROUP query heads of one KV head
    (rows padded to BLOCK_M >= 16 for tl.dot) over its share of the sequence's KV."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_pos = seq_len - 1  # the new token's position: it sees 0..q_pos

    offs_m = tl.arange(0, BLOCK_M)
    row_mask = offs_m < GROUP
    head = kv_head * GROUP + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    row = seq.to(tl.int64)
    q = tl.load(q_ptr + row * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i, l_i = _softmax_start(sinks_ptr, head, row_mask, split, BLOCK_M, HAS_SINKS)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    kv_lo = 0
    if SLIDING:
        kv_lo = tl.maximum(seq_len - window, 0) // BLOCK_N * BLOCK_N
    kv_start, kv_stop = _split_range(kv_lo, seq_len, split, BLOCK_N, NUM_SPLITS)
    table = block_tables_ptr + row * stride_bt
    for start_n in range(kv_start, kv_stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < seq_len
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, table, offs_n, n_mask, kv_head, offs_d, d_mask,
                             stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                             PAGE_SIZE, UPCAST, FP8_KV)
        if FP8_KV and not UPCAST:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if SOFTCAP:
            s = _softcap(s, softcap)
        visible = n_mask  # q_pos = seq_len - 1 sees every position below seq_len
        if SLIDING:
            visible = visible & (offs_n > q_pos - window)
        m_i, l_i, acc = _online_softmax_step(s, visible[None, :], v, m_i, l_i, acc, DOT_PRECISION)

    o_mask = row_mask[:, None] & d_mask[None, :]
    if FP8_KV:
        acc = acc * v_scale
    if NUM_SPLITS > 1:
        part = split.to(tl.int64) * stride_os + row * stride_ot + head * stride_oh
        tl.store(out_ptr + part[:, None] + offs_d[None, :], acc, mask=o_mask)
        tl.store(m_part_ptr + part // HEAD_DIM, m_i, mask=row_mask)
        tl.store(l_part_ptr + part // HEAD_DIM, l_i, mask=row_mask)
    else:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + row * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit(do_not_specialize=["n_rows", "stride_s"])
def _combine_splits_kernel(
    acc_part_ptr, m_part_ptr, l_part_ptr, out_ptr,
    n_rows,  # T * Hq
    stride_s,  # T * Hq * Dh: split stride of acc_part (m/l: T * Hq)
    stride_ot, stride_oh,
    n_heads,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # token * Hq + head
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    m = tl.load(m_part_ptr + offs_s * n_rows + row, mask=s_mask, other=float("-inf"))
    l = tl.load(l_part_ptr + offs_s * n_rows + row, mask=s_mask, other=0.0)
    acc = tl.load(acc_part_ptr + offs_s[:, None] * stride_s + row * HEAD_DIM + offs_d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # splits that saw nothing have m = -inf, weight 0
    total = tl.sum(w * l, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0.0, total, 1.0)
    tok = row // n_heads
    head = row % n_heads
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def _pick_blocks(group: int, head_dim: int, max_seqlen_q: int | None) -> dict:
    """BLOCK_Q query tokens x group heads per tile (>= 16 rows for tl.dot)."""
    # One tile shape for every batch with a prefill, whatever its longest chunk: two
    # compiled variants in all (_decode_attention_kernel's, and this), none new mid-run.
    target_rows = 64 if head_dim <= 128 else 32
    block_q = max(1, target_rows // triton.next_power_of_2(group))
    block_m = max(16, triton.next_power_of_2(block_q * group))
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = 32 if block_d <= 128 else 16
    return dict(BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_N=block_n,
                num_warps=4, num_stages=1 if _INTERPRET else 2)


def _pick_decode_blocks(group: int, head_dim: int) -> dict:
    """Decode tiles: the group's heads as rows (>= 16 for tl.dot), 64 KV positions a tile
    (a [Dh, 64] K tile and a [64, Dh] V tile of bf16 are 16 KiB each at Dh 128: three
    stages in flight fit the H100/H200's shared memory with room to spare)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    return dict(BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
                BLOCK_N=64 if block_d <= 128 else 32, num_warps=4,
                num_stages=1 if _INTERPRET else 3)


def suggest_num_kv_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Host-side heuristic for decode batches: enough programs to cover the SMs twice,
    but no split shorter than 256 positions."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    by_occupancy = (2 * sms) // max(1, num_seqs * num_kv_heads)
    return max(1, min(16, by_occupancy, triton.cdiv(max_context, 256)))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seqlen_q: int | None = None,
    num_kv_splits: int = 1,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
    causal: bool = True,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of packed new tokens over their paged context (causal=False:
    every query sees its sequence's whole context, an encoder's bidirectional attention).

    max_seqlen_q is an optional host-side hint (the longest q_len in the batch);
    it only picks tile sizes and never has to be exact, except that passing 1
    promises a pure decode batch.  num_kv_splits > 1 splits every tile's KV
    range over that many programs (flash-decoding) and merges the partial
    softmaxes in a second kernel: worth it when B * Hkv programs cannot fill the
    GPU, i.e. small decode batches over long contexts (see suggest_num_kv_splits).
    sinks [Hq] (any float dtype): per-head sink logits in the softmax denominator;
    window: each query sees only the last `window` positions up to its own;
    softcap (Gemma 2): each scaled score s is softcap * tanh(s / softcap).
    An e4m3 cache (float8_e4m3fn, --kv-cache-dtype fp8) holds k / k_scale and v / v_scale:
    its codes are upcast to q's dtype in the kernel, k_scale joins the softmax scale and
    v_scale the output.
    Returns out [T, Hq, Dh] in q's dtype.
    """
    T, Hq, Dh = q.shape
    num_blocks, page_size, Hkv, Dh_k = k_cache.shape
    assert v_cache.shape == k_cache.shape, "k_cache and v_cache must have the same shape"
    assert Dh_k == Dh and Hq % Hkv == 0, f"q {tuple(q.shape)} vs cache {tuple(k_cache.shape)}"
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "head_dim must be contiguous"
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2 and block_tables.stride(1) == 1
    assert cu_seqlens_q.dtype == torch.int32 and seq_lens.dtype == torch.int32
    B = seq_lens.shape[0]
    assert cu_seqlens_q.shape == (B + 1,) and block_tables.shape[0] == B
    assert cu_seqlens_q.is_contiguous() and seq_lens.is_contiguous()
    assert k_cache.dtype == v_cache.dtype
    if sinks is not None:
        assert sinks.shape == (Hq,) and sinks.is_contiguous(), f"sinks must be [{Hq}], got {tuple(sinks.shape)}"
    assert window is None or window > 0, f"window must be positive, got {window}"
    assert causal or window is None, "a sliding window is causal"
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(2) == 1
    if T == 0 or B == 0:
        return out

    group = Hq // Hkv
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8:   # the kernels read the codes as bytes
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    upcast = _INTERPRET or q.dtype == torch.float32 or (k_cache.dtype != q.dtype and not fp8)
    splits = max(1, int(num_kv_splits))
    # one query per sequence at the context's end: it sees the whole context either way
    decode = max_seqlen_q is not None and max_seqlen_q <= 1
    if decode:  # the promise: one token per sequence, row b is sequence b
        assert T == B, f"max_seqlen_q=1 promises one query per sequence: {T} rows, {B} sequences"
        cfg = _pick_decode_blocks(group, Dh)
        grid = (B, Hkv, splits)
    else:
        cfg = _pick_blocks(group, Dh, max_seqlen_q)
        grid = (T // cfg["BLOCK_Q"] + B, Hkv, splits)
    if splits > 1:
        acc_part = torch.empty((splits, T, Hq, Dh), dtype=torch.float32, device=q.device)
        m_part = torch.empty((splits, T, Hq), dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
        target, target_strides = acc_part, (acc_part.stride(1), acc_part.stride(2), acc_part.stride(0))
    else:
        m_part = l_part = out  # unused
        target, target_strides = out, (out.stride(0), out.stride(1), 0)
    common = dict(GROUP=group, HEAD_DIM=Dh, PAGE_SIZE=page_size, UPCAST=upcast,
                  DOT_PRECISION="ieee" if upcast else None, NUM_SPLITS=splits,
                  HAS_SINKS=sinks is not None, SLIDING=window is not None, **cfg)
    if fp8:
        common["FP8_KV"] = True
    if softcap:
        common["SOFTCAP"] = True
    if not causal and not decode:
        common["CAUSAL"] = False
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                     v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
    sinks_arg = q if sinks is None else sinks  # a valid pointer the kernel never reads
    window_arg = 0 if window is None else int(window)
    softcap_arg = float(softcap or 0.0) * 1.4426950408889634    # in the kernel's base-2 units
    if decode:
        _decode_attention_kernel[grid](
            q, k_cache, v_cache, target, block_tables, seq_lens, m_part, l_part,
            scale * k_scale * 1.4426950408889634,  # log2(e)
            q.stride(0), q.stride(1), *target_strides, *cache_strides, block_tables.stride(0),
            sinks_arg, window_arg, softcap_arg, float(v_scale), **common)
    else:
        _paged_attention_kernel[grid](
            q, k_cache, v_cache, target,
            block_tables, cu_seqlens_q, seq_lens,
            m_part, l_part,
            scale * k_scale * 1.4426950408889634,  # log2(e)
            B,
            q.stride(0), q.stride(1),
            *target_strides,
            *cache_strides,
            block_tables.stride(0),
            sinks_arg, window_arg, softcap_arg, float(v_scale),
            **common,
        )
    if splits > 1:
        _combine_splits_kernel[(T * Hq,)](
            acc_part, m_part, l_part, out,
            T * Hq, acc_part.stride(0), out.stride(0), out.stride(1), Hq,
            HEAD_DIM=Dh, NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits),
            BLOCK_D=cfg["BLOCK_D"], num_warps=4,
        )
    return out


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
    causal: bool = True,
    softcap: float | None = None,
) -> torch.Tensor:
    """Per-sequence gather of the paged K/V and plain causal (or, causal=False, full)
    softmax attention in fp32;
    a sink is one more score column, dropped after the softmax."""
    T, Hq, Dh = q.shape
    _, page_size, Hkv, _ = k_cache.shape
    group = Hq // Hkv
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_b = q[cu[b]:cu[b + 1]].float()  # [q_len, Hq, Dh]
        q_len = q_b.shape[0]
        if q_len == 0:
            continue
        pos = torch.arange(seq_len, device=q.device)
        pages = block_tables[b].long()[pos // page_size]
        k = k_cache[pages, pos % page_size].float().repeat_interleave(group, dim=1)  # [S, Hq, Dh]
        v = v_cache[pages, pos % page_size].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_b, k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = seq_len - q_len + torch.arange(q_len, device=q.device)
        hidden = pos[None, None, :] > q_pos[None, :, None]
        if not causal:
            hidden = torch.zeros_like(hidden)
        if window is not None:
            hidden = hidden | (pos[None, None, :] <= q_pos[None, :, None] - window)
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:
            sink = sinks.float()[:, None, None].expand(Hq, q_len, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[cu[b]:cu[b + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
