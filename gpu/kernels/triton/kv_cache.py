"""Scatter new K/V rows into the paged KV cache.

Layout
    k, v           [T, Hkv, Dh]  (any strides; a view into a fused qkv tensor is fine)
    k_cache, v_cache [num_blocks, block_size, Hkv, Dh]
    slot_mapping   [T] int64: slot = block_id * block_size + offset; slot < 0 skips
                   the token (padding rows of a CUDA-graph batch).

One program writes BLOCK_T tokens; each token's Hkv * Dh values are one flat
tile. Values are cast to the cache dtype on store.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from gpu.kernels.triton.fp8_kv import to_e4m3_bytes

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# the row count changes every step; slot_mapping is a staged array (see paged_attention)
@triton.jit(do_not_specialize=["num_tokens"], do_not_specialize_on_alignment=["slot_ptr"])
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    num_tokens,
    k_inv_scale, v_inv_scale,  # 1 / the layer's k and v scales (read only with FP8)
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,  # Hkv * Dh
    PAGE_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    FP8: tl.constexpr = False,  # the caches are e4m3 codes (uint8 views)
    ROUND_IN_FP32: tl.constexpr = False,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < num_tokens
    slot = tl.load(slot_ptr + offs_t, mask=t_mask, other=-1).to(tl.int64)
    t_mask = t_mask & (slot >= 0)
    page = slot // PAGE_SIZE
    in_page = slot % PAGE_SIZE

    offs_r = tl.arange(0, BLOCK_R)
    head = offs_r // HEAD_DIM
    dim = offs_r % HEAD_DIM
    mask = t_mask[:, None] & (offs_r < ROW)[None, :]
    tok = offs_t.to(tl.int64)[:, None]

    k = tl.load(k_ptr + tok * stride_kt + head[None, :] * stride_kh + dim[None, :] * stride_kd, mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + head[None, :] * stride_vh + dim[None, :] * stride_vd, mask=mask)
    kc_ptrs = (k_cache_ptr + page[:, None] * stride_kcb + in_page[:, None] * stride_kcs
               + head[None, :] * stride_kch + dim[None, :] * stride_kcd)
    vc_ptrs = (v_cache_ptr + page[:, None] * stride_vcb + in_page[:, None] * stride_vcs
               + head[None, :] * stride_vch + dim[None, :] * stride_vcd)
    # Through fp32: the interpreter mishandles bf16 unless upcast right after the load.
    if FP8:
        tl.store(kc_ptrs, to_e4m3_bytes(k, k_inv_scale, ROUND_IN_FP32), mask=mask)
        tl.store(vc_ptrs, to_e4m3_bytes(v, v_inv_scale, ROUND_IN_FP32), mask=mask)
    else:
        tl.store(kc_ptrs, k.to(tl.float32).to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptrs, v.to(tl.float32).to(v_cache_ptr.dtype.element_ty), mask=mask)


def _pick_blocks(row: int) -> dict:
    block_r = triton.next_power_of_2(row)
    block_t = max(1, min(16, 4096 // block_r))
    return dict(BLOCK_T=block_t, BLOCK_R=block_r, num_warps=4)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """In place: k_cache[slot // bs, slot % bs] = k[t] for every t with slot >= 0; an e4m3
    cache (float8_e4m3fn) holds e4m3(k / k_scale), saturated at +-448 (v likewise)."""
    T, Hkv, Dh = k.shape
    assert v.shape == k.shape, f"k {tuple(k.shape)} vs v {tuple(v.shape)}"
    assert k_cache.dim() == 4 and k_cache.shape[2:] == (Hkv, Dh), f"cache {tuple(k_cache.shape)} vs k {tuple(k.shape)}"
    assert v_cache.shape == k_cache.shape
    assert slot_mapping.shape == (T,) and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
    if T == 0:
        return
    cfg = _pick_blocks(Hkv * Dh)
    grid = (triton.cdiv(T, cfg["BLOCK_T"]),)
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8:
        cfg.update(FP8=True, ROUND_IN_FP32=_INTERPRET)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _write_kv_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping,
        T, 1.0 / k_scale, 1.0 / v_scale,
        *k.stride(), *v.stride(),
        *k_cache.stride(), *v_cache.stride(),
        HEAD_DIM=Dh, ROW=Hkv * Dh, PAGE_SIZE=k_cache.shape[1],
        **cfg,
    )


def write_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    page_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for cache, x, scale in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
        if cache.dtype == torch.float8_e4m3fn:   # byte views: torch's CPU indexing takes no float8
            x8 = (x[keep].float() * (1.0 / scale)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            cache.view(torch.uint8)[slots // page_size, slots % page_size] = x8.view(torch.uint8)
        else:
            cache[slots // page_size, slots % page_size] = x[keep].to(cache.dtype)
