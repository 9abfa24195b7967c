"""A GGUF mixture's experts kept in the file's blocks on the CPU (issue 56): `ffn_gate_exps`,
`ffn_up_exps` and `ffn_down_exps` ([E, rows, row_bytes] each, one expert's rows contiguous)
become one PackedLinear a projection and expert over views of the packed bytes (no copy), and
each expert runs through gpu/kernels/cpu/quant.c on the rows routed to it only: a decode
step reads the routed experts' blocks and nothing else, at about a seventh of fp32's bytes
for Q4_K. gpu/quantization/gguf.py's pack_linears puts them in place of gpu/layers/moe.py's
Experts; MoE.forward routes and sorts as for any experts and calls `run_rows`.

Gate and up stay halves here (GGUF's layout: gate's rows, then up's, one PackedLinear), not
the interleaved pairs of the dense Experts; `dense_weights` interleaves them for references.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu.kernels.cpu import quant as cpu_quant

# (the experts' GGUF tensors, in order: gate, up, down)
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


class GGUFExperts(nn.Module):
    """gate, up, down: (ggml type, packed uint8 [E, rows, row_bytes]) as the file stores them."""

    use_kernel = False              # the CUDA kernels' flag (gpu/layers/moe.py): a CPU module
    gate_up_proj_bias = down_proj_bias = None

    def __init__(self, hidden: int, intermediate: int, gate, up, down) -> None:
        super().__init__()
        (fg, g), (fu, u), (fd, d) = gate, up, down
        self.num_experts = int(g.shape[0])
        self.gate_up = nn.ModuleList(cpu_quant.PackedLinear(hidden, [(fg, g[e]), (fu, u[e])])
                                     for e in range(self.num_experts))
        self.down = nn.ModuleList(cpu_quant.PackedLinear(intermediate, [(fd, d[e])])
                                  for e in range(self.num_experts))
        self.intermediate = intermediate
        self.formats = (fg, fu, fd)

    def run_rows(self, rows: torch.Tensor, offs: torch.Tensor, by_expert: torch.Tensor, activation) -> torch.Tensor:
        """Expert-sorted rows [N, D] -> [N, D] fp32: each non-empty segment through its expert's
        packed gate|up, SwiGLU and down (gpu/quantization/gguf.py packs swiglu experts only)."""
        out = torch.empty(rows.shape[0], rows.shape[1], dtype=torch.float32)
        I, start = self.intermediate, 0   # noqa: E741
        for e, end in enumerate(offs.tolist()):
            if end > start:
                h = self.gate_up[e](rows[start:end])                             # [n, 2I]: gate | up
                out[start:end] = self.down[e](F.silu(h[:, :I]) * h[:, I:])
            start = end
        return out

    def dense_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, D] interleaved as Experts holds it, down [E, D, I]) in fp32."""
        E, I = self.num_experts, self.intermediate  # noqa: E741
        gu = torch.stack([m.dequantized() for m in self.gate_up])                 # [E, 2I, D] halves
        gu = torch.stack([gu[:, :I], gu[:, I:]], dim=2).reshape(E, 2 * I, -1)
        return gu, torch.stack([m.dequantized() for m in self.down])

    @property
    def packed_bytes(self) -> int:
        return sum(m.packed_bytes for m in (*self.gate_up, *self.down))


def packed_experts(f, layer: int, hidden: int, intermediate: int) -> GGUFExperts | None:
    """Layer `layer`'s experts kept packed, or None when the file's are not all in a format the
    kernels take, as 3-D [E, rows, blocks] tensors of the model's sizes."""
    k = cpu_quant.kernels()
    names = [f"blk.{layer}.{t}.weight" for t in EXPERT_TENSORS]
    parts = []
    for name, (rows, cols) in zip(names, ((intermediate, hidden), (intermediate, hidden), (hidden, intermediate))):
        if name not in f.tensors or len(f.tensors[name].shape) != 3:
            return None
        fmt = f.packed_type(name)
        elems, nbytes = k.block(fmt) if fmt in cpu_quant.FORMATS else (0, 0)
        if not elems or cols % elems or tuple(int(n) for n in f.tensors[name].shape[:2]) != (cols, rows):
            return None
        fmt, data = f.packed(name)                                               # [E, rows * row_bytes]
        parts.append((fmt, data.view(data.shape[0], rows, cols // elems * nbytes)))
    return GGUFExperts(hidden, intermediate, *parts)
