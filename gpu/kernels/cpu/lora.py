"""Multi-LoRA's grouped shrink/expand on the CPU (issue 60): gpu/kernels/cpu/lora.c through ctypes,
built and cached like gpu/kernels/cpu/ops.c (the same builder, the same TAILRACE_CPU_KERNELS=0
switch; without a compiler gpu/lora/adapters.py keeps its torch grouped matmuls).

One call per patched linear and step adds every adapter's term to the base output in place,
out[perm[m]] += (x[perm[m]] A_g^T) (scale_g B_g)^T, the step's LoRA rows sorted by adapter
(`perm`, group g = perm[bounds[g]:bounds[g+1]]), each adapter's A^T [K, R] and B^T [R, N] read
once, as panels `pack` lays out at load. The step's table holds every group's weight pointers
and ranks for every patched linear (built once a step), so a hook passes one offset into it.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from gpu.kernels.cpu import ops as cpu_kernels

_SOURCE = Path(__file__).with_name("lora.c")
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class LoRAKernels:
    def __init__(self, lib: ctypes.CDLL) -> None:
        f = lib.cpu_lora_apply
        f.restype = _INT
        f.argtypes = [_P, _I64, _INT, _P, _I64, _INT, _P, _P, _P, _I64, _I64, _INT, _I64, _I64]
        self._apply = f
        lib.cpu_lora_vector_width.restype = lib.cpu_lora_panel.restype = _INT
        self.vector_width = lib.cpu_lora_vector_width()   # fp32 lanes: 16, 8, or 0 (scalar)
        self.panel = lib.cpu_lora_panel()                 # columns per weight panel

    def pack(self, weights: dict) -> dict:
        """An adapter's (A^T [K, R], B^T [R, N]) per linear as the kernel reads them: panels of
        `panel` columns, A^T [ceil(R / P), K, P] and B^T [ceil(N / P), R, P], zero-padded; with
        the rank R, as (A panels, B panels, R)."""
        return {k: (_panels(a, self.panel), _panels(b, self.panel), a.shape[1]) for k, (a, b) in weights.items()}

    @staticmethod
    def pointers(packed: dict, keys: list) -> torch.Tensor:
        """An adapter's [len(keys), 3] int64 rows (A panels' pointer, B panels' pointer, rank)
        per patched linear (`pack`'s), zeros where it patches none (the packed tensors must
        outlive the table)."""
        rows = [(w[0].data_ptr(), w[1].data_ptr(), w[2]) if (w := packed.get(k)) is not None
                else (0, 0, 0) for k in keys]
        return torch.tensor(rows, dtype=torch.int64)

    def apply(self, x: torch.Tensor, out: torch.Tensor, perm: torch.Tensor, bounds: torch.Tensor,
              table: torch.Tensor, key: int, w_dtype: torch.dtype) -> bool:
        """out += the LoRA term of the rows in perm, in place; False (nothing done) when the
        arguments are not ones it takes. x [T, K] and out [T, N] with unit column stride, fp32
        or bf16; perm int64 [M]; bounds int64 [G + 1]; table int64 [G, n_keys, 3]
        (`pointers` of `pack`ed weights stacked over the groups), this linear's row `key`;
        weights w_dtype."""
        if (x.dim() != 2 or out.dim() != 2 or x.stride(1) != 1 or out.stride(1) != 1
                or x.dtype not in _DTYPES or out.dtype not in _DTYPES or w_dtype not in _DTYPES
                or x.device.type != "cpu" or out.device.type != "cpu" or out.shape[0] != x.shape[0]
                or (torch.is_grad_enabled() and (x.requires_grad or out.requires_grad))):
            return False
        g, n_keys = table.shape[0], table.shape[1]
        rc = self._apply(x.data_ptr(), x.stride(0), _DTYPES[x.dtype], out.data_ptr(), out.stride(0),
                         _DTYPES[out.dtype], perm.data_ptr(), bounds.data_ptr(),
                         table.data_ptr() + key * 3 * 8, n_keys * 3, g, _DTYPES[w_dtype],
                         x.shape[1], out.shape[1])
        return rc == 0


def _panels(w: torch.Tensor, p: int) -> torch.Tensor:
    rows, cols = w.shape
    n = -(-cols // p)
    padded = torch.zeros(rows, n * p, dtype=w.dtype)
    padded[:, :cols] = w
    return padded.view(rows, n, p).transpose(0, 1).contiguous()


def reference(x: torch.Tensor, out: torch.Tensor, perm: torch.Tensor, bounds: list[int],
              weights: list[tuple[torch.Tensor, torch.Tensor] | None]) -> torch.Tensor:
    """The same term in fp32 torch (the tests' oracle): out + per group x[rows] A^T B^T."""
    want = out.float().clone()
    for g, w in enumerate(weights):
        if w is None:
            continue
        rows = perm[bounds[g]:bounds[g + 1]]
        want[rows] += (x[rows].float() @ w[0].float()) @ w[1].float()
    return want


@functools.cache
def kernels() -> LoRAKernels | None:
    """The built kernel, or None (TAILRACE_CPU_KERNELS=0, no compiler, a failed build)."""
    lib = cpu_kernels.load_library(_SOURCE)
    return None if lib is None else LoRAKernels(lib)
