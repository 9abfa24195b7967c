"""AWQ checkpoints, GEMM packing (AutoAWQ's "gemm" version, vLLM's `awq`):

  {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true, "version": "gemm",
   "modules_to_not_convert": null | [...]}

A linear W [out, in] is stored transposed and packed along its output columns:
  NAME.qweight int32 [in, out / 8]: word j of input row k holds output columns 8j .. 8j+7, the
    column 8j + AWQ_ORDER[i] in bits 4i .. 4i+3 (AWQ_ORDER = 0 2 4 6 1 3 5 7: the order
    AutoAWQ's GEMM kernel reads them in);
  NAME.qzeros int32 [in / g, out / 8], packed the same way: each group's zero point;
  NAME.scales [in / g, out] fp16.
w[o, k] = (q[k, o] - z[k // g, o]) * s[k // g, o].
"""

from __future__ import annotations

import torch

from gpu.quantization.base import LinearFormat

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_columns(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[R, W] int32 -> [R, W * 32 / bits] int64: field i of word j (bits i*b ..) is column
    j * (32/b) + order[i] (order None: i)."""
    per = 32 // bits
    shifts = torch.arange(per, device=packed.device) * bits
    fields = (packed.to(torch.int64)[..., None] >> shifts) & ((1 << bits) - 1)   # [R, W, per]
    if order is not None:
        fields = fields[..., torch.tensor(order).argsort()]                    # column c from field order^-1[c]
    return fields.reshape(packed.shape[0], -1)


def pack_columns(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """unpack_columns' inverse (for tests and tools): [R, C] ints in [0, 2^b) -> [R, C*b/32] int32."""
    per = 32 // bits
    v = values.to(torch.int64).reshape(values.shape[0], -1, per)
    if order is not None:
        v = v[..., list(order)]                                                # field i holds column order[i]
    word = (v << (torch.arange(per) * bits)).sum(-1)
    return (word - (word >= 2 ** 31).long() * 2 ** 32).to(torch.int32)


class AWQ(LinearFormat):
    name = "awq"
    integer_grid = True
    markers = ("qweight",)
    suffixes = ("qweight", "qzeros", "scales")

    def __init__(self, config: dict):
        super().__init__(config)
        self.bits = int(config.get("bits", config.get("w_bit", 4)))
        self.group_size = int(config.get("group_size", config.get("q_group_size", 128)))
        version = str(config.get("version", "gemm")).lower()
        if self.bits != 4 or version != "gemm":
            raise ValueError(f"awq: {self.bits}-bit {version!r} packing is not served (4-bit GEMM is)")
        self.zero_point = bool(config.get("zero_point", True))
        self.skip = tuple(config.get("modules_to_not_convert") or ())

    def ignored(self, prefix: str) -> bool:
        return any(s in prefix for s in self.skip)

    def required(self, prefix):
        return ("qweight", "qzeros", "scales") if self.zero_point else ("qweight", "scales")

    def kernel_kind(self, prefix):
        return "w4"

    def integers(self, prefix, parts):
        q = unpack_columns(parts["qweight"], self.bits, AWQ_ORDER)              # [in, out]
        scales = parts["scales"].float()                                       # [groups, out]
        cols = q.shape[0]
        g = self.group_size if self.group_size > 0 else cols
        if scales.shape != (-(-cols // g), q.shape[1]):
            raise ValueError(f"awq: {prefix}.scales has shape {tuple(scales.shape)}, expected "
                             f"{(-(-cols // g), q.shape[1])} (group size {g})")
        if "qzeros" in parts:
            z = unpack_columns(parts["qzeros"], self.bits, AWQ_ORDER)
        else:
            z = torch.full(scales.shape, 1 << (self.bits - 1), dtype=torch.int64)
        rows = torch.arange(cols, device=q.device) // g
        return (q - z.long()[rows]).t(), scales[rows].t()

    def scheme(self) -> str:
        return f"AWQ W{self.bits}A16 (GEMM packing, group {self.group_size})"
