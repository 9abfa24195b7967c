"""e4m3 helpers shared by the kernels that write or read an fp8 KV cache (kv_cache.py,
qkv_prep.py, paged_attention.py) and the FP8 GEMM (fp8_gemm.py).

An fp8 cache is handed to the kernels as its uint8 bytes (torch.float8_e4m3fn tensors view as
uint8; the bytes are the e4m3 codes), so every kernel loads and stores plain bytes:
  write: byte = e4m3(clamp(x / scale, +-448))   (saturating: e4m3fn has no infinity)
  read:  x = float(e4m3(byte)) * scale
with one scale per layer for k and one for v (the checkpoint's k_scale / v_scale, else 1.0).
"""
from __future__ import annotations

import triton
import triton.language as tl

E4M3_MAX = 448.0


@triton.jit
def round_e4m3(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32
    arithmetic: for the interpreter, whose fp32 -> float8e4nv conversion (triton 3.9) loses a
    carry into the next binade (-124.6 gives -64, not -128). Every step is exact."""
    e = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    ulp = ((tl.maximum(e, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)    # 3 mantissa bits; subnormals below 2^-6
    t = v / ulp
    r = tl.floor(t + 0.5)
    r = tl.where((r - t == 0.5) & (r % 2 != 0), r - 1.0, r)
    return r * ulp


@triton.jit
def to_e4m3_bytes(x, inv_scale, ROUND_IN_FP32: tl.constexpr):
    """x (any float) -> the uint8 codes of e4m3(clamp(x * inv_scale))."""
    v = tl.clamp(x.to(tl.float32) * inv_scale, -448.0, 448.0)
    if ROUND_IN_FP32:
        v = round_e4m3(v)
    return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def from_e4m3_bytes(b):
    """uint8 codes -> their e4m3 values in fp32 (exact)."""
    return b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
