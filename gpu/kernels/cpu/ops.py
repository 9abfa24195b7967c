"""C kernels for the CPU decode step (gpu/kernels/cpu/ops.c), built on first use and called
through ctypes: paged decode attention (gpu/layers/attention.py), fused add + RMSNorm and RoPE
(gpu/layers/ops.py), exact_top_logits (gpu/models/causal_lm.py).

Why C: decode attention over the paged cache in torch needs a gather of every sequence's
blocks per layer (index_select, then SDPA over the copy), which reads and writes the whole
context twice more than attending in place; torch.compile could fuse it but its compile
took minutes on a 2-core machine. The C file needs no torch headers and builds in about a
second with the system compiler (cc -O3 -march=native -fopenmp), once per machine: the
shared object is cached under $XDG_CACHE_HOME/tailrace/cpu_kernels, keyed by the source,
the compiler command and the CPU's flags.

Without a compiler, or with TAILRACE_CPU_KERNELS=0, `kernels()` returns None and the
callers keep their torch path (the fallback, also what the tests compare against).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

DISABLE_ENV = "TAILRACE_CPU_KERNELS"     # "0": never build or use the C kernels
CACHE_ENV = "TAILRACE_CPU_KERNELS_CACHE"
# "-march=" value for the C kernels (default native): e.g. haswell builds the AVX2 path an
# AVX2-only CPU runs, on a machine with AVX-512 (scripts/bench_vs_llamacpp.sh ISA=avx2)
MARCH_ENV = "TAILRACE_CPU_MARCH"
_SOURCE = Path(__file__).with_name("ops.c")
# -ffp-contract=off: elementwise products and sums rounded one by one, as torch's ops round
# them (RoPE comes out bit-identical); the attention's FMAs are explicit intrinsics
_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno", "-ffp-contract=off",
          "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _cache_dir() -> Path:
    base = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tailrace", "cpu_kernels")
    return Path(base)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _with_includes(source: Path, seen: set | None = None) -> bytes:
    """The source and every file it #includes from gpu/, nested ones too (gpu/kernels/cpu/layer.c
    includes cpu_quant.c, which includes cpu_quant_gemm.c): all of them are part of the key."""
    seen = set() if seen is None else seen
    seen.add(source)
    src = source.read_bytes()
    out = src
    for line in src.decode().splitlines():
        if line.startswith('#include "'):
            inc = source.parent / line.split('"')[1]
            if inc not in seen:
                out += _with_includes(inc, seen)
    return out


def _flags() -> list[str]:
    march = os.environ.get(MARCH_ENV, "").strip()
    return [f"-march={march}" if f == "-march=native" and march else f for f in _FLAGS]


def _build(cc: str, source: Path = _SOURCE) -> Path:
    """The shared object for this source, compiler and CPU (built now unless cached)."""
    src = _with_includes(source)
    flags = _flags()
    key = hashlib.sha256(src + " ".join([cc, *flags]).encode() + _cpu_flags().encode()).hexdigest()[:16]
    out = _cache_dir() / f"{source.stem}-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=out.name + ".", suffix=".so")
    os.close(fd)
    try:
        subprocess.run([cc, *flags, str(source), "-o", tmp, "-lm"], check=True,
                       capture_output=True, timeout=120)
        os.replace(tmp, out)  # atomic: processes starting together never load half a file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


class CpuKernels:
    def __init__(self, lib: ctypes.CDLL) -> None:
        f = lib.paged_decode_attention
        f.restype = ctypes.c_int
        f.argtypes = [_P, _I64, _P, _P, _P, _P, _I64, _P, _I64, _P, _P, _P, _I64, _I64, _P, _P, _I64,
                      _I64, _I64, _I64, _I64, _I64, ctypes.c_float, ctypes.c_int]
        self._decode = f
        lib.add_rms_norm.restype = None
        lib.add_rms_norm.argtypes = [_P, ctypes.c_int, _P, ctypes.c_int, _P, ctypes.c_int, _P, _P,
                                     ctypes.c_int, _I64, _I64, ctypes.c_float]
        lib.rope.restype = ctypes.c_int
        lib.rope.argtypes = [_P, _I64, _P, _I64, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, ctypes.c_int]
        lib.exact_top_logits.restype = None
        lib.exact_top_logits.argtypes = [_P, _P, _P, ctypes.c_int, _I64, _I64, _I64, ctypes.c_float]
        lib.argmax_rows.restype = None
        lib.argmax_rows.argtypes = [_P, _I64, _I64, _P]
        self._lib = lib
        lib.cpu_kernels_vector_width.restype = ctypes.c_int
        # 0: built without AVX-512, where the loops were never measured against torch's
        self.vector_width = lib.cpu_kernels_vector_width()

    def paged_decode_attention(self, q: torch.Tensor, q_rows: torch.Tensor, out: torch.Tensor,
                               k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                               seq_lens: torch.Tensor, scale: float, *,
                               new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                               slots: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                               window: int | None = None) -> bool:
        """Decode attention in place over the paged cache; False when the kernel declines
        (a block id or slot out of range, no memory): the caller's fallback then rewrites
        whatever k/v it may have written.

        q [T, Hq, D] with contiguous rows (any row stride), sequence i's row q_rows[i]
        (int64); out [T, Hq, D] contiguous; k_cache/v_cache [num_blocks, bs, Hkv, D]
        contiguous, of q's dtype (fp32 or bf16); tables [B, N] int32 contiguous; seq_lens
        [B] int64; new_kv [T, Hkv, D] each with contiguous rows (any row stride),
        sequence i's written first to slot slots[i] (int64, < 0: skip); sinks [Hq] fp32
        contiguous."""
        nb, bs, hkv, d = k_cache.shape
        if new_kv is not None:
            nk, nv = new_kv
            kv_ptrs = (nk.data_ptr(), nv.data_ptr(), nk.stride(0), nv.stride(0), slots.data_ptr())
        else:
            kv_ptrs = (None, None, 0, 0, None)
        with torch.profiler.record_function("cpu_kernels::paged_decode_attention"):
            rc = self._decode(q.data_ptr(), q.stride(0), q_rows.data_ptr(), out.data_ptr(),
                              k_cache.data_ptr(), v_cache.data_ptr(), nb, tables.data_ptr(), tables.shape[1],
                              seq_lens.data_ptr(),
                              *kv_ptrs, None if sinks is None else sinks.data_ptr(), window or 0,
                              seq_lens.shape[0], q.shape[1], hkv, d, bs, scale, _DTYPES[q.dtype])
        return rc == 0


    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(rms_norm(x + residual) * weight, x + residual) (None for the sum without a
        residual), in torch's promoted dtype, as gpu/layers/ops.py computes them; None when the
        arguments are not ones it takes (the caller's torch path serves)."""
        if (not _plain(x, residual, weight) or x.dim() != 2 or not x.is_contiguous() or x.dtype not in _DTYPES
                or weight.dtype not in _DTYPES
                or not weight.is_contiguous() or weight.shape != x.shape[-1:]):
            return None
        if residual is not None and (residual.shape != x.shape or residual.dtype not in _DTYPES
                                     or not residual.is_contiguous()):
            return None
        dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
        out = torch.empty(x.shape, dtype=dtype)
        summed = None if residual is None else torch.empty(x.shape, dtype=dtype)
        # no record_function here (5 us, a fifth of the call): in a profile this shows as the
        # caller's self time
        self._lib.add_rms_norm(x.data_ptr(), _DTYPES[x.dtype], None if residual is None else residual.data_ptr(),
                               0 if residual is None else _DTYPES[residual.dtype], weight.data_ptr(),
                               _DTYPES[weight.dtype], out.data_ptr(), None if summed is None else summed.data_ptr(),
                               _DTYPES[dtype], x.shape[0], x.shape[1], eps)
        return out, summed

    def rope(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
             cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """gpu/ops.apply_rope's (q, k) rotated, new contiguous tensors; None when the
        arguments are not ones it takes (or a position is beyond the table)."""
        T, hq, d = q.shape
        if (not _plain(q, k, positions, cos_sin) or q.dtype not in _DTYPES or k.dtype != q.dtype or d % 2 or d > 1024 or k.shape[2] != d
                or q.stride()[1:] != (d, 1) or k.stride()[1:] != (d, 1) or positions.dtype != torch.int64
                or not positions.is_contiguous() or cos_sin.dtype != torch.float32
                or not cos_sin.is_contiguous() or cos_sin.shape[1] != d):
            return None
        q_out, k_out = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
        rc = self._lib.rope(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), positions.data_ptr(),
                            cos_sin.data_ptr(), cos_sin.shape[0], q_out.data_ptr(), k_out.data_ptr(), T,
                            hq, k.shape[1], d, _DTYPES[q.dtype])
        return (q_out, k_out) if rc == 0 else None


    def exact_top_logits(self, logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                         margin: float) -> bool:
        """gpu/model.exact_top_logits in place on logits [N, V] fp32 (hidden [N, D] fp32,
        weight [V, D] fp32 or bf16, all contiguous); False (nothing done) when the arguments
        are not ones it takes."""
        if (not _plain(logits, hidden, weight) or logits.dtype != torch.float32 or hidden.dtype != torch.float32
                or weight.dtype not in _DTYPES or not (logits.is_contiguous() and hidden.is_contiguous()
                                                       and weight.is_contiguous())
                or logits.dim() != 2 or hidden.shape != (logits.shape[0], weight.shape[1])
                or weight.shape[0] != logits.shape[1]):
            return False
        self._lib.exact_top_logits(logits.data_ptr(), hidden.data_ptr(), weight.data_ptr(), _DTYPES[weight.dtype],
                                   logits.shape[0], logits.shape[1], hidden.shape[1], margin)
        return True


    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor | None:
        """logits [N, V] fp32 contiguous on the CPU -> [N] int64, each row's first maximal index
        (a NaN counts as the maximum), as logits.max(dim=-1).indices; None for other arguments."""
        if (logits.dim() != 2 or logits.dtype != torch.float32 or not logits.is_contiguous()
                or logits.device.type != "cpu" or logits.shape[1] == 0):
            return None
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self._lib.argmax_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr())
        return out


def _plain(*tensors: torch.Tensor | None) -> bool:
    """CPU tensors with data, and no autograd to record (the kernels write raw memory)."""
    grad = torch.is_grad_enabled()
    return all(t is None or (t.device.type == "cpu" and not (grad and t.requires_grad)) for t in tensors)


def supports(dtype: torch.dtype) -> bool:
    return dtype in _DTYPES


@functools.cache
def kernels() -> CpuKernels | None:
    """The built kernels, or None (disabled, no compiler, or the build failed: the torch
    path serves instead)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    lib = load_library(_SOURCE)
    return None if lib is None else CpuKernels(lib)


def load_library(source: Path) -> ctypes.CDLL | None:
    """A C file of gpu/ built (or found cached) for this CPU and loaded; None without a
    compiler, with TAILRACE_CPU_KERNELS=0, or when the build fails (gpu/kernels/cpu/quant.py's too)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None
    try:
        return ctypes.CDLL(str(_build(cc, source)))
    except (OSError, subprocess.SubprocessError):
        return None


def describe() -> str:
    """Whether the C kernels serve this process, in words (the start-up line)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return f"C kernels off ({DISABLE_ENV}=0)"
    k = kernels()
    if k is None:
        return "C kernels off (no C compiler, or the build failed: torch ops serve)"
    if not k.vector_width:
        return "C kernels for norms and rope; decode attention by gather + SDPA (no AVX-512)"
    return f"C kernels on (AVX-512, {k.vector_width} fp32 lanes: paged decode attention, norms, rope)"
