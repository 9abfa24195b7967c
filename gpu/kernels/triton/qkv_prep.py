"""One kernel per layer between the qkv projection and attention: per-head q/k RMSNorm
(Qwen3's q_norm / k_norm; skipped for models without), rotary embedding of q and k, and
the write of k and v into the paged KV cache.

    prepare_qkv(qkv [T, (Hq + 2 Hkv) Dh], Hq, Hkv, Dh, q_norm_w [Dh] | None,
                k_norm_w [Dh] | None, eps, positions [T], cos_sin [P, Dh],
                k_cache, v_cache, slot_mapping [T]) -> q [T, Hq, Dh]

Unfused, the same work is rms_norm(q), rms_norm(k) (each after a reshape copy of a
strided view), apply_rope and write_kv: four launches and two copies a layer, about a
hundred launches a step for a 28-layer model. Here one program per token reads the
token's q, k and v once, writes the normed, rotated q (for attention) and puts k and v
into the cache (slot < 0: a padding row of a CUDA graph, nothing written).

Numerics follow the unfused path: statistics and rotation in fp32, and the normed value
rounded to the model's dtype before the rotation, as rms_norm's output is; the rotation
is gpu/kernels/triton/rope.py's own (NeoX halves, cos in the first half of the table row, sin in
the second). KV cache layout as in gpu/kernels/triton/kv_cache.py (any strides).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from gpu.kernels.triton.fp8_kv import to_e4m3_bytes
from gpu.kernels.triton.rope import cos_sin_row, rotate

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _norm_rope(x1, x2, w_ptr, eps, cos, sin, offs_d, d_mask,
               HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    """x1, x2 [heads, BLOCK_HALF] fp32 halves -> rotated halves (fp32, after the norm's
    rounding to the weight's dtype)."""
    if HAS_NORM:
        ss = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)
        rstd = 1.0 / tl.sqrt(ss / HEAD_DIM + eps)
        w1 = tl.load(w_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        dt = w_ptr.dtype.element_ty
        x1 = (x1 * rstd[:, None] * w1[None, :]).to(dt).to(tl.float32)
        x2 = (x2 * rstd[:, None] * w2[None, :]).to(dt).to(tl.float32)
    return rotate(x1, x2, cos, sin)


@triton.jit(do_not_specialize=["eps"],
            do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])   # staged arrays
def _qkv_prep_kernel(
    qkv_ptr, q_out_ptr, q_w_ptr, k_w_ptr, pos_ptr, cos_sin_ptr, slot_ptr,
    k_cache_ptr, v_cache_ptr,
    eps,
    k_inv_scale, v_inv_scale,  # 1 / the layer's k and v scales (read only with FP8)
    stride_t,  # qkv's row stride
    stride_qot, stride_qoh,
    stride_cs,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    N_Q: tl.constexpr, N_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    FP8: tl.constexpr = False,  # the caches are e4m3 codes (uint8 views)
    ROUND_IN_FP32: tl.constexpr = False,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    cos, sin = cos_sin_row(cos_sin_ptr, pos, stride_cs, offs_d, d_mask, HALF)
    row = qkv_ptr + tok * stride_t

    # q: normed, rotated, stored for attention
    offs_hq = tl.arange(0, BLOCK_HQ)
    mq = (offs_hq < N_Q)[:, None] & d_mask[None, :]
    q_ptrs = row + offs_hq[:, None] * HEAD_DIM + offs_d[None, :]
    q1 = tl.load(q_ptrs, mask=mq, other=0.0).to(tl.float32)
    q2 = tl.load(q_ptrs + HALF, mask=mq, other=0.0).to(tl.float32)
    q1, q2 = _norm_rope(q1, q2, q_w_ptr, eps, cos, sin, offs_d, d_mask, HEAD_DIM, HALF, HAS_NORM)
    o_ptrs = q_out_ptr + tok * stride_qot + offs_hq[:, None] * stride_qoh + offs_d[None, :]
    tl.store(o_ptrs, q1.to(q_out_ptr.dtype.element_ty), mask=mq)
    tl.store(o_ptrs + HALF, q2.to(q_out_ptr.dtype.element_ty), mask=mq)

    # k and v: into the cache at the token's slot
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        page = slot // PAGE_SIZE
        in_page = slot % PAGE_SIZE
        offs_hk = tl.arange(0, BLOCK_HK)
        mk = (offs_hk < N_KV)[:, None] & d_mask[None, :]
        k_ptrs = row + (N_Q + offs_hk[:, None]) * HEAD_DIM + offs_d[None, :]
        k1 = tl.load(k_ptrs, mask=mk, other=0.0).to(tl.float32)
        k2 = tl.load(k_ptrs + HALF, mask=mk, other=0.0).to(tl.float32)
        k1, k2 = _norm_rope(k1, k2, k_w_ptr, eps, cos, sin, offs_d, d_mask, HEAD_DIM, HALF, HAS_NORM)
        kc = (k_cache_ptr + page * stride_kcb + in_page * stride_kcs
              + offs_hk[:, None] * stride_kch + offs_d[None, :])
        if FP8:   # through the model's dtype, as the unfused path's rotated k is
            tl.store(kc, to_e4m3_bytes(k1.to(qkv_ptr.dtype.element_ty), k_inv_scale, ROUND_IN_FP32), mask=mk)
            tl.store(kc + HALF, to_e4m3_bytes(k2.to(qkv_ptr.dtype.element_ty), k_inv_scale, ROUND_IN_FP32), mask=mk)
        else:
            tl.store(kc, k1.to(k_cache_ptr.dtype.element_ty), mask=mk)
            tl.store(kc + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=mk)
        v_ptrs = row + (N_Q + N_KV + offs_hk[:, None]) * HEAD_DIM + offs_d[None, :]
        # through fp32: the interpreter mishandles bf16 unless upcast right after the load
        v1 = tl.load(v_ptrs, mask=mk, other=0.0).to(tl.float32)
        v2 = tl.load(v_ptrs + HALF, mask=mk, other=0.0).to(tl.float32)
        vc = (v_cache_ptr + page * stride_vcb + in_page * stride_vcs
              + offs_hk[:, None] * stride_vch + offs_d[None, :])
        if FP8:
            tl.store(vc, to_e4m3_bytes(v1, v_inv_scale, ROUND_IN_FP32), mask=mk)
            tl.store(vc + HALF, to_e4m3_bytes(v2, v_inv_scale, ROUND_IN_FP32), mask=mk)
        else:
            tl.store(vc, v1.to(v_cache_ptr.dtype.element_ty), mask=mk)
            tl.store(vc + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=mk)


def prepare_qkv(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int,
                q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None, eps: float,
                positions: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                v_scale: float = 1.0) -> torch.Tensor:
    """q [T, Hq, Dh] normed and rotated; k (normed, rotated) and v written into the caches
    (an e4m3 cache: divided by the layer's k_scale / v_scale, as write_kv)."""
    T = qkv.shape[0]
    Hq, Hkv, Dh = num_q_heads, num_kv_heads, head_dim
    assert qkv.dim() == 2 and qkv.shape[1] == (Hq + 2 * Hkv) * Dh and qkv.stride(1) == 1, \
        f"qkv {tuple(qkv.shape)} vs heads {Hq}+2*{Hkv} of {Dh}"
    assert Dh % 2 == 0 and cos_sin.shape[1] == Dh and cos_sin.stride(1) == 1
    assert (q_norm_weight is None) == (k_norm_weight is None)
    assert positions.shape == (T,) and positions.is_contiguous()
    assert slot_mapping.shape == (T,) and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (Hkv, Dh) and k_cache.stride(3) == 1
    q = torch.empty((T, Hq, Dh), dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    has_norm = q_norm_weight is not None
    half = Dh // 2
    fp8 = dict(FP8=True, ROUND_IN_FP32=_INTERPRET) if k_cache.dtype == torch.float8_e4m3fn else {}
    if fp8:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _qkv_prep_kernel[(T,)](
        qkv, q, q_norm_weight if has_norm else qkv, k_norm_weight if has_norm else qkv,
        positions, cos_sin, slot_mapping, k_cache, v_cache,
        float(eps), 1.0 / k_scale, 1.0 / v_scale,
        qkv.stride(0), q.stride(0), q.stride(1), cos_sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        N_Q=Hq, N_KV=Hkv, HEAD_DIM=Dh, HALF=half, PAGE_SIZE=k_cache.shape[1],
        BLOCK_HQ=triton.next_power_of_2(Hq), BLOCK_HK=triton.next_power_of_2(Hkv),
        BLOCK_HALF=triton.next_power_of_2(half), HAS_NORM=has_norm,
        num_warps=4 if triton.next_power_of_2(Hq) * triton.next_power_of_2(half) <= 2048 else 8, **fp8,
    )
    return q


def prepare_qkv_ref(qkv, num_q_heads, num_kv_heads, head_dim, q_norm_weight, k_norm_weight, eps,
                    positions, cos_sin, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> torch.Tensor:
    """The unfused torch path, op for op as gpu/model.Attention runs it on CPU."""
    from gpu.kernels.triton.kv_cache import write_kv_ref
    from gpu.layers.ops import apply_rope, rms_norm

    T = qkv.shape[0]
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.reshape(T, num_q_heads, head_dim)
    k = k.reshape(T, num_kv_heads, head_dim)
    v = v.reshape(T, num_kv_heads, head_dim)
    if q_norm_weight is not None:
        q = rms_norm(q.reshape(-1, head_dim), q_norm_weight, eps).view_as(q)
        k = rms_norm(k.reshape(-1, head_dim), k_norm_weight, eps).view_as(k)
    q, k = apply_rope(q, k, positions, cos_sin)
    write_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q
