"""GPTQ checkpoints (AutoGPTQ / GPTQModel, vLLM's `gptq`):

  {"quant_method": "gptq", "bits": 4 | 8, "group_size": 128 | -1, "desc_act": false,
   "sym": true, "checkpoint_format": "gptq" | "gptq_v2"}

A linear W [out, in] is stored transposed:
  NAME.qweight int32 [in * b / 32, out]: word r of column o holds input rows r*32/b ..,
    row r*32/b + i in bits i*b .. i*b+b-1;
  NAME.qzeros int32 [groups, out * b / 32]: each group's zero points, packed the same way
    along the output columns;
  NAME.scales [groups, out] fp16;
  NAME.g_idx int32 [in]: the group of each input row: k // g, or with desc_act (act-order)
    a permutation's groups (the rows stay in their original order).
w[o, k] = (q[k, o] - z[g_idx[k], o]) * s[g_idx[k], o], where the "gptq" format stores
z - 1 (AutoGPTQ's legacy offset; a symmetric 4-bit checkpoint's zeros read 7 for 8) and
"gptq_v2" stores z.
"""

from __future__ import annotations

import torch

from gpu.quantization.awq import unpack_columns
from gpu.quantization.base import LinearFormat


class GPTQ(LinearFormat):
    name = "gptq"
    integer_grid = True
    markers = ("qweight",)
    suffixes = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, config: dict):
        super().__init__(config)
        self.bits = int(config.get("bits", 4))
        if self.bits not in (2, 4, 8):
            raise ValueError(f"gptq: {self.bits}-bit weights are not served (2, 4 and 8 are)")
        self.group_size = int(config.get("group_size", 128))
        self.desc_act = bool(config.get("desc_act", False))
        self.sym = bool(config.get("sym", True))
        fmt = config.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"gptq: checkpoint_format {fmt!r} is not served (gptq and gptq_v2 are)")
        self.zero_offset = 1 if fmt == "gptq" else 0
        self.skip = tuple(config.get("modules_to_not_convert") or ())

    def ignored(self, prefix: str) -> bool:
        return any(s in prefix for s in self.skip)

    def required(self, prefix):
        return ("qweight", "qzeros", "scales") + (("g_idx",) if self.desc_act else ())

    def kernel_kind(self, prefix):
        return f"w{self.bits}" if self.bits in (4, 8) else None

    def integers(self, prefix, parts):
        q = unpack_columns(parts["qweight"].t().contiguous(), self.bits).t()     # [in, out]
        cols = q.shape[0]
        scales = parts["scales"].float()                                       # [groups, out]
        z = unpack_columns(parts["qzeros"], self.bits)[:, :q.shape[1]] + self.zero_offset
        g_idx = parts.get("g_idx")
        if g_idx is None or g_idx.numel() != cols:
            g = self.group_size if self.group_size > 0 else cols
            g_idx = torch.arange(cols, device=q.device) // g
        g_idx = g_idx.long()
        if int(g_idx.max()) >= scales.shape[0] or z.shape[0] != scales.shape[0]:
            raise ValueError(f"gptq: {prefix}.g_idx names group {int(g_idx.max())}, but scales has "
                             f"{scales.shape[0]} groups and qzeros {z.shape[0]}")
        return (q - z[g_idx]).t(), scales[g_idx].t()

    def scheme(self) -> str:
        g = "per-channel" if self.group_size <= 0 else f"group {self.group_size}"
        return (f"GPTQ W{self.bits}A16 ({g}, {'act-order' if self.desc_act else 'no act-order'}, "
                f"{'symmetric' if self.sym else 'asymmetric'})")
