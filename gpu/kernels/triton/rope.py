"""Rotary position embedding, NeoX / Hugging Face rotate_half style.

    apply_rope(q [T, Hq, Dh], k [T, Hkv, Dh], positions [T] int64, cos_sin [P, Dh])
        -> (q_rot, k_rot)   new tensors, same dtypes as q and k

cos_sin[p, :Dh/2] = cos(p * inv_freq), cos_sin[p, Dh/2:] = sin(p * inv_freq); the
scaling variants (linear, llama3, yarn, ...) are baked into the table by its
builder.  With x = [x1, x2] split in halves:
    out1 = x1 * cos - x2 * sin,   out2 = x2 * cos + x1 * sin.
Math in fp32.  One program rotates all heads of one token (q then k).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def cos_sin_row(cos_sin_ptr, pos, stride_cs, offs_d, d_mask, HALF: tl.constexpr):
    """cos and sin [BLOCK_HALF] fp32 of position pos, from its row of the table."""
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def rotate(x1, x2, cos, sin):
    """x1, x2 [heads, BLOCK_HALF] fp32 halves -> the rotated halves."""
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    return o1, o2


@triton.jit
def _rotate_heads(x_ptr, o_ptr, stride_xt, stride_xh, stride_ot, stride_oh, tok, cos, sin,
                  n_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h < n_heads)[:, None] & (offs_d < HALF)[None, :]
    x1_ptrs = x_ptr + tok * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x1_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    o1, o2 = rotate(x1, x2, cos, sin)
    o1_ptrs = o_ptr + tok * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(o1_ptrs, o1.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(o1_ptrs + HALF, o2.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize_on_alignment=["pos_ptr"])   # positions: a staged array
def _rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_sin_ptr,
    n_q_heads, n_k_heads,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_cs,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    cos, sin = cos_sin_row(cos_sin_ptr, pos, stride_cs, offs_d, d_mask, HALF)
    _rotate_heads(q_ptr, q_out_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, tok, cos, sin,
                  n_q_heads, HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr, k_out_ptr, stride_kt, stride_kh, stride_kot, stride_koh, tok, cos, sin,
                  n_k_heads, HALF, BLOCK_HK, BLOCK_HALF)


def _pick_blocks(n_q_heads: int, n_k_heads: int, half: int) -> dict:
    block_half = triton.next_power_of_2(half)
    block_hq = triton.next_power_of_2(n_q_heads)
    num_warps = 4 if block_hq * block_half <= 2048 else 8
    return dict(BLOCK_HQ=block_hq, BLOCK_HK=triton.next_power_of_2(n_k_heads),
                BLOCK_HALF=block_half, num_warps=num_warps)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    T, Hq, Dh = q.shape
    assert k.dim() == 3 and k.shape[0] == T and k.shape[2] == Dh, f"q {tuple(q.shape)} vs k {tuple(k.shape)}"
    assert Dh % 2 == 0 and cos_sin.dim() == 2 and cos_sin.shape[1] == Dh, f"cos_sin {tuple(cos_sin.shape)}"
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos_sin.stride(1) == 1
    assert positions.shape == (T,) and positions.is_contiguous() and not positions.is_floating_point()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if T == 0:
        return q_out, k_out
    Hkv = k.shape[1]
    _rope_kernel[(T,)](
        q, k, q_out, k_out, positions, cos_sin,
        Hq, Hkv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos_sin.stride(0),
        HALF=Dh // 2,
        **_pick_blocks(Hq, Hkv, Dh // 2),
    )
    return q_out, k_out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin[positions].float().chunk(2, dim=-1)  # [T, Dh/2] each
    cos = torch.cat((cos, cos), dim=-1)[:, None, :]
    sin = torch.cat((sin, sin), dim=-1)[:, None, :]
    qf, kf = q.float(), k.float()
    return ((qf * cos + _rotate_half(qf) * sin).to(q.dtype),
            (kf * cos + _rotate_half(kf) * sin).to(k.dtype))
