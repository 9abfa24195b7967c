"""GGUF-quantized linear layers kept packed on the CPU (issue 39): gpu/kernels/cpu/quant.c through
ctypes, built and cached like gpu/kernels/cpu/ops.c (the same builder, the same
TAILRACE_CPU_KERNELS=0 switch; without a compiler the loader dequantizes instead).

PackedLinear holds a linear's weight as the GGUF file stores it, one segment per source
tensor (a merged qkv_proj or gate_up_proj is its parts' rows one after another; parts may
differ in format, as a Q4_K_M file's attn_v does). Its forward keeps nn.Linear's call,
y = forward(x), so an additive term after it (LoRA's y = base(x) + lora(x)) wraps it as it
wraps a Linear.

Rows per call decide the kernel (`QuantKernels.large_m`, measured in docs/kernels.md):
- up to `large_m` rows: cpu_quant_matmul, which dequantizes each weight row once (into
  registers or L1; with AVX-512 from 24 rows, with AVX2+FMA from 12 (Q8_0: 48, 16), into
  k-major panels for its outer-product GEMM tiles) and multiplies it with every activation
  row in fp32 FMAs;
- more rows: the weight dequantized to fp32 in C, then torch's fp32 GEMM (oneDNN). With the
  GEMM tiles `large_m` is their most rows (2048: they beat this path up to there), without
  them LARGE_M (48: above that torch's blocking beats the dot-product tiles).
Both compute with exactly gguf-py's dequantized values in fp32. Where the build has them, the
int16 tiles quantize x per row and 32-element block to int16 (~2^-16 of the block's largest)
and multiply the weights' integers: AVX512_VNNI's GEMM tiles (Q4_0/Q4_1/Q8_0 batches), and
without AVX-512 the int16 GEMV tiles (every format, up to `int16_gemv_max_m(fmt)` rows: 3, Q8_0
11, the K-quants 6); TAILRACE_CPU_QUANT_INT16=0 turns both off.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import nn

from gpu.kernels.cpu import ops as cpu_kernels

_SOURCE = Path(__file__).with_name("quant.c")
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int

# ggml type ids (gguf.GGMLQuantizationType) the kernels take, and their names
FORMATS = {2: "Q4_0", 3: "Q4_1", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
# rows per call above which a linear dequantizes and calls torch's GEMM without the GEMM tiles
# (docs/kernels.md); gpu/kernels/cpu/layer.py's decode stack takes up to this many rows
LARGE_M = 48


class QuantKernels:
    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.cpu_quant_matmul.restype = _INT
        lib.cpu_quant_matmul.argtypes = [_INT, _P, _I64, _I64, _I64, _P, _I64, _I64, _P, _I64, _P]
        lib.cpu_quant_dequantize.restype = _INT
        lib.cpu_quant_dequantize.argtypes = [_INT, _P, _I64, _I64, _I64, _I64, _P]
        for f in (lib.cpu_quant_block_bytes, lib.cpu_quant_block_elems, lib.cpu_quant_vector_width):
            f.restype = _INT
        lib.cpu_quant_block_bytes.argtypes = lib.cpu_quant_block_elems.argtypes = [_INT]
        lib.cpu_quant_set_fused.restype = lib.cpu_quant_fused_max_m.restype = _INT
        lib.cpu_quant_set_fused.argtypes = [_INT]
        lib.cpu_quant_set_gemm.restype = lib.cpu_quant_gemm_max_m.restype = lib.cpu_quant_gemm_min_m.restype = _INT
        lib.cpu_quant_set_gemm.argtypes = [_INT, _INT]
        lib.cpu_quant_gemm_min_m.argtypes = [_INT]
        lib.cpu_quant_set_int16.restype = lib.cpu_quant_int16.restype = _INT
        lib.cpu_quant_set_int16.argtypes = lib.cpu_quant_int16.argtypes = [_INT]
        lib.cpu_quant_set_int16_gemv.restype = lib.cpu_quant_int16_gemv_max_m.restype = _INT
        lib.cpu_quant_set_int16_gemv.argtypes = lib.cpu_quant_int16_gemv_max_m.argtypes = [_INT]
        self._lib = lib
        self.vector_width = lib.cpu_quant_vector_width()
        self._set_large_m()

    def _set_large_m(self) -> None:
        # rows per call above which PackedLinear dequantizes and calls torch's GEMM
        self.large_m = max(LARGE_M, self._lib.cpu_quant_gemm_max_m())

    @property
    def fused_max_m(self) -> int:
        """The most rows of Q4_0/Q4_1/Q8_0 that take the fused tiles (0: none)."""
        return self._lib.cpu_quant_fused_max_m()

    def set_fused(self, max_m: int) -> bool:
        """The most rows of Q4_0/Q4_1/Q8_0 that take the fused tiles (blocks dequantized in
        registers, MR rows at a time; bit-identical to the buffered path), 0 for none, -1 for
        the default (gpu/kernels/cpu/quant.c FUSED_MAX_M_DEFAULT). Returns
        whether this build has them. Tests and A/B runs only; not while a product runs."""
        return bool(self._lib.cpu_quant_set_fused(int(max_m)))

    def gemm_rows(self, fmt: int = 2) -> tuple[int, int]:
        """(fewest, most) rows of format fmt a call that take the GEMM tiles ((0, 0): none)."""
        most = self._lib.cpu_quant_gemm_max_m()
        return (self._lib.cpu_quant_gemm_min_m(fmt), most) if most else (0, 0)

    def set_gemm(self, max_m: int, min_m: int = -1) -> bool:
        """Calls of min_m..max_m rows take the outer-product GEMM tiles (AVX-512 and AVX2+FMA
        builds; gpu/kernels/cpu/quant_gemm.c), max_m 0 for none, -1 for the default, min_m -1 for each
        format's default; `large_m` follows. Returns whether this build has them. Tests and
        A/B runs only; not while a product runs."""
        has = bool(self._lib.cpu_quant_set_gemm(int(min_m), int(max_m)))
        self._set_large_m()
        return has

    def int16(self, fmt: int = 2) -> bool:
        """Whether format fmt's GEMM-tile calls take the int16 tiles now (AVX512_VNNI builds and
        AVX2 builds without AVX-512, Q4_0/Q4_1/Q8_0; gpu/kernels/cpu/quant_gemm.c gemm_panel16)."""
        return bool(self._lib.cpu_quant_int16(int(fmt)))

    def set_int16(self, on: int) -> bool:
        """The int16 GEMM tiles (x quantized per 32-element block to int16, vpdpwssd) on (1), off
        (0: the fp32 tiles) or as TAILRACE_CPU_QUANT_INT16 says (-1, on unless it is 0); their
        rows follow (`gemm_rows`). Returns whether this build has them (AVX512_VNNI, or AVX2
        without AVX-512). Tests and
        A/B runs only; not while a product runs."""
        return bool(self._lib.cpu_quant_set_int16(int(on)))

    def int16_gemv_max_m(self, fmt: int = 2) -> int:
        """The most rows of format fmt that take the int16 GEMV tiles now (AVX2 builds without
        AVX-512, every format; gpu/cpu_quant.c i16tile), 0: none."""
        return self._lib.cpu_quant_int16_gemv_max_m(int(fmt))

    def set_int16_gemv(self, max_m: int) -> bool:
        """The most rows of every format that take the int16 GEMV tiles, 0 for none, -1 for each
        format's default (off where TAILRACE_CPU_QUANT_INT16=0). Returns whether this build has
        them. Tests and A/B runs only; not while a product runs."""
        return bool(self._lib.cpu_quant_set_int16_gemv(int(max_m)))

    def block(self, fmt: int) -> tuple[int, int]:
        """(elements, bytes) of one block of format fmt; (0, 0) for one it does not take."""
        return self._lib.cpu_quant_block_elems(fmt), self._lib.cpu_quant_block_bytes(fmt)

    def matmul(self, fmt: int, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
               bias: torch.Tensor | None = None) -> None:
        """y [M, N] (rows contiguous, any row stride) = x [M, K] fp32 (rows contiguous) @ W^T
        (+ bias [N] fp32), W packed [N, row_bytes] uint8 contiguous."""
        rc = self._lib.cpu_quant_matmul(fmt, w.data_ptr(), w.shape[1], w.shape[0], x.shape[1], x.data_ptr(),
                                        x.stride(0), x.shape[0], y.data_ptr(), y.stride(0),
                                        None if bias is None else bias.data_ptr())
        if rc:
            raise ValueError(f"cpu_quant_matmul declined {FORMATS.get(fmt, fmt)} {tuple(w.shape)} K={x.shape[1]}")

    def dequantize(self, fmt: int, w: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """W packed [N, row_bytes] -> fp32 [N, k] (into out when given)."""
        out = torch.empty(w.shape[0], k, dtype=torch.float32) if out is None else out
        if self._lib.cpu_quant_dequantize(fmt, w.data_ptr(), w.shape[1], 0, w.shape[0], k, out.data_ptr()):
            raise ValueError(f"cpu_quant_dequantize declined {FORMATS.get(fmt, fmt)} {tuple(w.shape)} K={k}")
        return out


@functools.cache
def kernels() -> QuantKernels | None:
    """The built kernels, or None (TAILRACE_CPU_KERNELS=0, no compiler, a failed build)."""
    global _KERNELS
    lib = cpu_kernels.load_library(_SOURCE)
    _KERNELS = None if lib is None else QuantKernels(lib)
    return _KERNELS


def isa() -> str:
    """The vector ISA the kernels were built for, in words (the start-up line)."""
    k = kernels()
    flags = cpu_kernels._cpu_flags().split()
    if k is None:
        return "none"
    if k.vector_width == 16:
        if k.int16():
            return "AVX-512, AVX512_VNNI (int16 GEMM tiles)"
        return "AVX-512" + (" (CPU also has AVX512_VNNI)" if "avx512_vnni" in flags else "")
    if k.vector_width == 8 and k.int16_gemv_max_m():
        return "AVX2+FMA (int16 GEMV and GEMM tiles)" if k.int16() else "AVX2+FMA (int16 GEMV tiles)"
    return {8: "AVX2+FMA"}.get(k.vector_width, "scalar C")


_SCRATCH: list[torch.Tensor] = []


def _scratch(numel: int) -> torch.Tensor:
    """One fp32 buffer for the large-M path's dequantized weight, grown to the largest linear
    that has needed it and then reused: no allocation (nor page faults) per call. The model
    runs in one thread at a time (the runner's), and each call is done with it on return."""
    if not _SCRATCH or _SCRATCH[0].numel() < numel:
        _SCRATCH[:] = [torch.empty(numel, dtype=torch.float32)]
    return _SCRATCH[0][:numel]


class PackedLinear(nn.Module):
    """y = x @ W^T + b with W in GGUF blocks: segments [(ggml type, packed [rows, row_bytes]
    uint8)] stacked along the output dimension; bias fp32 or None. fp32 math; the output in
    fp32 (the residual stream's dtype under packed weights)."""

    def __init__(self, in_features: int, segments: list[tuple[int, torch.Tensor]],
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.formats = tuple(fmt for fmt, _ in segments)
        self.rows = tuple(int(w.shape[0]) for _, w in segments)
        self.out_features = sum(self.rows)
        for i, (_, w) in enumerate(segments):
            self.register_buffer(f"packed{i}", w.contiguous(), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    def _segments(self):
        return ((fmt, getattr(self, f"packed{i}")) for i, fmt in enumerate(self.formats))

    @property
    def packed_bytes(self) -> int:
        """Bytes of weights one call reads."""
        return sum(w.numel() for _, w in self._segments())

    def extra_repr(self) -> str:
        kinds = "+".join(FORMATS.get(f, str(f)) for f in self.formats)
        return f"in_features={self.in_features}, out_features={self.out_features}, {kinds}"

    def dequantized(self) -> torch.Tensor:
        """The whole weight [out, in] in fp32."""
        k = kernels()
        return torch.cat([k.dequantize(fmt, w, self.in_features) for fmt, w in self._segments()])

    def _calls(self) -> list[tuple]:
        """Per segment: (ggml type, packed rows, first output column, last, bias part), made
        once (and again if the buffers were replaced, e.g. by .to())."""
        plan = self.__dict__.get("_plan")
        segs = list(self._segments())
        if plan is None or any(p[1] is not w for p, (_, w) in zip(plan, segs)):
            plan, start = [], 0
            for (fmt, w), rows in zip(segs, self.rows):
                bias = None if self.bias is None else self.bias.detach()[start:start + rows]
                plan.append((fmt, w, start, start + rows, bias))
                start += rows
            self.__dict__["_plan"] = plan
        return plan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] (any float dtype) -> [T, out] fp32. The additive hook for LoRA
        (y = base(x) + lora(x)) goes around this call, as around a Linear's."""
        k = _KERNELS or kernels()
        if x.dtype != torch.float32:
            x = x.float()
        if x.dim() != 2 or x.stride(-1) != 1:
            x = x.reshape(-1, self.in_features).contiguous()
        if x.shape[0] > k.large_m:
            w = _scratch(self.out_features * self.in_features).view(self.out_features, self.in_features)
            for fmt, packed, start, stop, _ in self._calls():
                k.dequantize(fmt, packed, self.in_features, w[start:stop])
            return torch.nn.functional.linear(x, w, self.bias)
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        for fmt, packed, start, stop, bias in self._calls():
            k.matmul(fmt, packed, x, y if start == 0 and stop == self.out_features else y[:, start:stop], bias)
        return y


class PackedEmbedding(nn.Module):
    """An embedding table kept in GGUF blocks ([rows, row_bytes] uint8 of format fmt): a lookup
    dequantizes only the rows it takes (exactly gguf-py's values, fp32). A tied table shares its
    blocks with the packed LM head, so a GGUF file's vocabulary is held once, packed, instead of
    beside an fp32 copy (Gemma 3's 262k x 640 Q8_0 table: 178 MB against 671 MB)."""

    def __init__(self, fmt: int, packed: torch.Tensor, embedding_dim: int) -> None:
        super().__init__()
        self.fmt, self.num_embeddings, self.embedding_dim = fmt, int(packed.shape[0]), embedding_dim
        self.register_buffer("packed", packed, persistent=False)
        # what callers read of a table: its device and dtype (lookups are fp32)
        self.register_buffer("weight", torch.empty(0, embedding_dim), persistent=False)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {FORMATS.get(self.fmt, self.fmt)}"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [*] -> [*, embedding_dim] fp32."""
        k = _KERNELS or kernels()
        flat = ids.reshape(-1)
        rows = self.packed.index_select(0, flat)
        return k.dequantize(self.fmt, rows, self.embedding_dim).view(*ids.shape, self.embedding_dim)


_KERNELS = None   # kernels() once built: skips the cache lookup per call
