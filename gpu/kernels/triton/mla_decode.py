"""Multi-head latent attention decode over the paged latent cache (DeepSeek-V2/V3, Kimi K2).

Layout (gpu/layers/mla.py derives it)
    q            [N, H, R + P]     absorbed queries: q_nope_h W_uk_h (R = kv_lora_rank) beside
                                   the rotary part q_pe_h (P = qk_rope_head_dim); 576 for V3
    cache        [num_blocks, block_size, 1, R + P]: a token's latent c and rotary key k_pe
    block_tables [N, max_blocks] int32: query row n's pages, in order
    seq_lens     [N] int32: row n sees cache positions 0 .. seq_lens[n] - 1
    out          [N, H, R]         sum_j p_j c_j, to be multiplied by W_uv_h by the caller

Every head reads the same cached rows (multi-query attention with one KV head), so one
program takes BLOCK_H heads of one row and streams the row's KV once for all of them:
scores s = q_lat c^T + q_pe k_pe^T (two tl.dots, the latent and rotary parts apart, so
neither width is padded to 1,024), the online softmax in base 2, and acc += p c, the
values being the tile's latent columns already loaded for the scores. The grid is
(rows, head tiles, splits); with NUM_SPLITS > 1 (flash-decoding) each program takes one
contiguous share of the row's KV tiles and paged_attention's combine kernel merges the
partial softmaxes. A row of length 0 (a CUDA-graph batch's padding) gives zeros.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from gpu.kernels.triton.paged_attention import _combine_splits_kernel, _online_softmax_step, _split_range

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit(do_not_specialize=["stride_qn", "stride_on", "stride_os", "stride_bt"],
            do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr"])
def _mla_decode_kernel(
    q_ptr, cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr,
    m_part_ptr, l_part_ptr,  # [splits, N, H] fp32 (only with NUM_SPLITS > 1)
    qk_scale,                # softmax scale times log2(e)
    stride_qn, stride_qh,
    stride_on, stride_oh, stride_os,
    stride_cb, stride_cs,
    stride_bt,
    n_heads,
    RANK: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    h_mask = head < n_heads
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    r_mask = offs_r < RANK
    p_mask = offs_p < ROPE
    q_row = q_ptr + row * stride_qn + head[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)
    q_pe = tl.load(q_row + RANK + offs_p[None, :], mask=h_mask[:, None] & p_mask[None, :], other=0.0)
    if UPCAST:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    seq_len = tl.load(seq_lens_ptr + row)
    kv_start, kv_stop = _split_range(0, seq_len, split, BLOCK_N, NUM_SPLITS)
    table = block_tables_ptr + row * stride_bt
    for start_n in range(kv_start, kv_stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_stop
        page = tl.load(table + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        tok = cache_ptr + page * stride_cb + (offs_n % PAGE_SIZE) * stride_cs                 # [BLOCK_N]
        c = tl.load(tok[:, None] + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        pe_t = tl.load(tok[None, :] + RANK + offs_p[:, None], mask=n_mask[None, :] & p_mask[:, None], other=0.0)
        if UPCAST:
            c = c.to(tl.float32)
            pe_t = pe_t.to(tl.float32)
        s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
        s += tl.dot(q_pe, pe_t, input_precision=DOT_PRECISION)                                # [BLOCK_H, BLOCK_N]
        m_i, l_i, acc = _online_softmax_step(s * qk_scale, n_mask[None, :], c, m_i, l_i, acc, DOT_PRECISION)

    o_mask = h_mask[:, None] & r_mask[None, :]
    if NUM_SPLITS > 1:
        part = split.to(tl.int64) * stride_os + row * stride_on + head * stride_oh          # [BLOCK_H]
        tl.store(out_ptr + part[:, None] + offs_r[None, :], acc, mask=o_mask)
        tl.store(m_part_ptr + part // RANK, m_i, mask=h_mask)
        tl.store(l_part_ptr + part // RANK, l_i, mask=h_mask)
    else:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + row * stride_on + head[:, None] * stride_oh + offs_r[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=o_mask)


def _pick_blocks(heads: int, rank: int, rope: int) -> dict:
    """16 heads a program (tl.dot's least M; V3's 128 heads are 8 programs a row, its 16 a rank
    at TP 8 one), KV tiles of 32 positions at V3's 512-wide latent (a [32, 512] bf16 tile is
    32 KiB: two stages in flight fit an H100's shared memory), 64 when narrower."""
    block_r = max(16, triton.next_power_of_2(rank))
    return dict(BLOCK_H=max(16, min(64, triton.next_power_of_2(heads))) if block_r <= 128 else 16,
                BLOCK_R=block_r, BLOCK_P=max(16, triton.next_power_of_2(rope)),
                BLOCK_N=32 if block_r >= 256 else 64, num_warps=4 if block_r <= 256 else 8,
                num_stages=1 if _INTERPRET else 2)


def mla_decode(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               scale: float, rank: int, *, num_kv_splits: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
    """out [N, H, rank] (q's dtype): each row's heads attending over its cached latent rows
    (see the module's layout); scale multiplies q . [c, k_pe]."""
    N, H, width = q.shape
    num_blocks, page_size, one, width_c = cache.shape
    rope = width - rank
    assert one == 1 and width_c == width and 0 < rank < width, f"q {tuple(q.shape)} vs cache {tuple(cache.shape)}"
    assert q.stride(2) == 1 and cache.stride(3) == 1, "the last dimension must be contiguous"
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2 and block_tables.stride(1) == 1
    assert seq_lens.dtype == torch.int32 and seq_lens.shape == (N,) and seq_lens.is_contiguous()
    assert block_tables.shape[0] == N, f"{block_tables.shape[0]} tables for {N} rows"
    if out is None:
        out = q.new_empty(N, H, rank)
    assert out.shape == (N, H, rank) and out.stride(2) == 1
    if N == 0:
        return out
    upcast = _INTERPRET or q.dtype == torch.float32 or cache.dtype != q.dtype
    splits = max(1, int(num_kv_splits))
    cfg = _pick_blocks(H, rank, rope)
    if splits > 1:
        acc_part = torch.empty((splits, N, H, rank), dtype=torch.float32, device=q.device)
        m_part = torch.empty((splits, N, H), dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
        target, strides = acc_part, (acc_part.stride(1), acc_part.stride(2), acc_part.stride(0))
    else:
        m_part = l_part = out  # unused
        target, strides = out, (out.stride(0), out.stride(1), 0)
    grid = (N, triton.cdiv(H, cfg["BLOCK_H"]), splits)
    _mla_decode_kernel[grid](
        q, cache, target, block_tables, seq_lens, m_part, l_part,
        scale * 1.4426950408889634,
        q.stride(0), q.stride(1), *strides, cache.stride(0), cache.stride(1), block_tables.stride(0), H,
        RANK=rank, ROPE=rope, PAGE_SIZE=page_size, UPCAST=upcast,
        DOT_PRECISION="ieee" if upcast else None, NUM_SPLITS=splits, **cfg)
    if splits > 1:
        _combine_splits_kernel[(N * H,)](
            acc_part, m_part, l_part, out, N * H, acc_part.stride(0), out.stride(0), out.stride(1), H,
            HEAD_DIM=rank, NUM_SPLITS=splits, BLOCK_S=max(2, triton.next_power_of_2(splits)),
            BLOCK_D=triton.next_power_of_2(rank), num_warps=4)
    return out


def mla_decode_ref(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   scale: float, rank: int) -> torch.Tensor:
    """mla_decode in torch, one row at a time, fp32."""
    N, H, _ = q.shape
    bs = cache.shape[1]
    out = torch.zeros(N, H, rank, dtype=torch.float32, device=q.device)
    for n in range(N):
        L = int(seq_lens[n])
        if L == 0:
            continue
        pages = block_tables[n, :-(-L // bs)].long()
        rows = cache[pages].reshape(-1, cache.shape[-1])[:L].float()                       # [L, R + P]
        p = (q[n].float() @ rows.T * scale).softmax(-1)                                     # [H, L]
        out[n] = p @ rows[:, :rank]
    return out.to(q.dtype)


def aot_cases():
    """scripts/check_triton_compile.py's launches: DeepSeek-V3's latent (512 + 64) at 128 heads
    (TP 1) and 16 (TP 8), bf16, 4 rows over 300 positions, without and with 4 splits."""
    for heads in (128, 16):
        for splits in (1, 4):
            def launch(heads=heads, splits=splits, B=4, ctx=300, page=16):
                pages = -(-ctx // page)
                cache = torch.zeros(B * pages, page, 1, 576, dtype=torch.bfloat16)
                tables = torch.arange(B * pages, dtype=torch.int32).view(B, pages)
                mla_decode(torch.zeros(B, heads, 576, dtype=torch.bfloat16), cache, tables,
                           torch.full((B,), ctx, dtype=torch.int32), 0.1, 512, num_kv_splits=splits)
            names = ["_mla_decode_kernel"] + (["_combine_splits_kernel"] if splits > 1 else [])
            yield f"mla_decode[deepseek-v3,bf16,{heads} heads,split{splits}]", names, launch
