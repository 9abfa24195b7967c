"""Quantized linears on CUDA: a pre-quantized checkpoint's decoder linears kept in their bytes
and run by the Triton GEMMs (gpu/kernels/triton/wna16_gemm.py, fp8_gemm.py, int8_gemm.py)
instead of being dequantized at load.

Every format arrives here in one of three kernel forms, whichever its tensors were (a
LinearFormat's `kernel_parts`): (kind, q [out, in], scale [out, in] fp32 per element), with
  "w4" / "w8"  q integers (q minus the format's zero point, AWQ's, GPTQ's or compressed-
               tensors'): the W4A16 / W8A16 layout, packed along K, scale and a zero point per
               group of g input columns (the largest g over which every scale is one value;
               the zero point is chosen per group so q + z is in [0, 2^b): any such z gives
               back q exactly). AWQ, GPTQ and pack-quantized W4A16 share it;
  "int8"       q int8, one scale a row (symmetric, per channel): INT8 W8A8;
  "fp8"        q float8_e4m3fn, scale one value a row per 128 input columns (128x128 blocks,
               per-channel or per-tensor scales all fit): the FP8 block-scaled GEMM.
A linear whose scales fit no form (act-order groups, e5m2, per-group FP8 finer than 128) stays
dequantized, and the start-up line counts it.

Tensor parallelism: each HF linear's q and scale are cut to the rank's rows or columns by the
model's own shard_spec before the form is made (a row-parallel cut through a group leaves
finer groups, or a dequantized linear); the merged modules (qkv, gate_up) concatenate their
parts' forms along the output rows.
"""

from __future__ import annotations

import re

import torch
from torch import nn

_GROUPS = (1024, 512, 256, 128, 64, 32, 16, 8)
# the HF linears install() replaces (repack._MERGED's parts)
_INSTALLED = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)")
FP8_GROUP = 128


def _narrow(lm, prefix: str, t: torch.Tensor) -> torch.Tensor:
    spec = lm.shard_spec(prefix + ".weight", 2)
    if not isinstance(spec, tuple):
        return t
    dim, start, stop, full = spec
    return t.narrow(dim, start, stop - start) if t.shape[dim] == full and stop - start != full else t


def wanted(device) -> bool:
    """Whether a load on `device` runs quantized linears by the Triton GEMMs (tests force it
    on a CPU, under the interpreter)."""
    return torch.device(device).type == "cuda"


def _constant_over(scale: torch.Tensor, g: int) -> bool:
    """Whether every run of g columns (the last one may be shorter) holds one value a row."""
    return bool(torch.equal(scale, scale[:, ::g].repeat_interleave(g, 1)[:, :scale.shape[1]]))


def wna16_form(q: torch.Tensor, scale: torch.Tensor, bits: int) -> dict | None:
    """q [out, in] integers, scale [out, in] fp32 -> the W4A16/W8A16 layout, or None."""
    out, cols = q.shape
    per = 32 // bits
    if cols % per:
        return None
    g = next((g for g in (cols,) + _GROUPS if cols % g == 0 and g <= cols and _constant_over(scale, g)), None)
    if g is None:
        return None
    top = (1 << bits) - 1
    qg = q.reshape(out, cols // g, g)
    lo, hi = qg.amin(-1), qg.amax(-1)                                   # [out, groups]
    z = torch.maximum(-lo, torch.clamp(top - hi, max=1 << (bits - 1)))  # the format's offset where it fits
    if bool(((z < -lo) | (z > top - hi) | (z < 0) | (z > top)).any()):
        return None
    u = (qg + z[..., None]).reshape(out, cols).t().contiguous()          # [in, out] in [0, 2^b)
    words = (u.reshape(cols // per, per, out).to(torch.int64) << (torch.arange(per, device=q.device) * bits)[None, :, None]).sum(1)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return dict(kind=f"w{bits}", qweight=words.contiguous(), scales=scale[:, ::g].t().contiguous().float(),
                zeros=z.t().contiguous().to(torch.uint8), group=g, bits=bits)


def int8_form(q: torch.Tensor, scale: torch.Tensor) -> dict | None:
    if q.min() < -128 or q.max() > 127 or not _constant_over(scale, scale.shape[1]):
        return None
    return dict(kind="int8", w=q.to(torch.int8).contiguous(), ws=scale[:, 0].float().contiguous())


def fp8_form(w: torch.Tensor, scale: torch.Tensor) -> dict | None:
    if w.dtype != torch.float8_e4m3fn:
        return None
    out, cols = scale.shape
    if _constant_over(scale, cols):
        return dict(kind="fp8", w=w.contiguous(), ws=scale[:, :1].float().contiguous(), bi=cols)
    if not _constant_over(scale, FP8_GROUP):
        return None   # per-group FP8 finer than 128 columns
    return dict(kind="fp8", w=w.contiguous(), ws=scale[:, ::FP8_GROUP].float().contiguous(), bi=FP8_GROUP)


def make_form(kind: str, q: torch.Tensor, scale: torch.Tensor) -> dict | None:
    scale = scale.float().expand(q.shape)
    if kind in ("w4", "w8"):
        return wna16_form(q, scale, int(kind[1]))
    if kind == "int8":
        return int8_form(q, scale)
    return fp8_form(q, scale)


def merge(forms: list[dict]) -> dict | None:
    """Parts of one merged module (q, k, v or gate, up) -> one form along the output rows."""
    first = forms[0]
    if first is None:
        return None
    keys = [k for k, v in first.items() if not isinstance(v, torch.Tensor)]
    if any(f is None or any(f[k] != first[k] for k in keys) for f in forms):
        return None
    merged = dict((k, first[k]) for k in keys)
    for k, v in first.items():
        if isinstance(v, torch.Tensor):
            dim = 0 if k in ("w", "ws") else 1      # fp8 / int8: [N, ...]; wna16: [..., N]
            merged[k] = torch.cat([f[k] for f in forms], dim).contiguous()
    return merged


class QuantLinear(nn.Module):
    """A linear run by a quantized-weight Triton GEMM (the form's kind); x [.., in] -> [.., out]."""

    def __init__(self, form: dict, in_features: int, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.kind = form["kind"]
        self.params = {k: v for k, v in form.items() if not isinstance(v, torch.Tensor) and k != "kind"}
        for k, v in form.items():
            if isinstance(v, torch.Tensor):
                self.register_buffer(k, v)
        self.in_features = in_features
        self.out_features = (form["w"].shape[0] if "w" in form else form["qweight"].shape[1])
        self.bias = bias
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if x.dtype != self.dtype:
            x = x.to(self.dtype)
        x = x.contiguous()
        if self.kind == "fp8":
            from gpu.kernels.triton.fp8_gemm import fp8_gemm
            y = fp8_gemm(x, self.w, self.ws, (1, self.params["bi"]), bias=self.bias)
        elif self.kind == "int8":
            from gpu.kernels.triton.int8_gemm import int8_gemm
            y = int8_gemm(x, self.w, self.ws, bias=self.bias)
        else:
            from gpu.kernels.triton.wna16_gemm import wna16_gemm
            y = wna16_gemm(x, self.qweight, self.scales, self.zeros, self.params["group"], self.params["bits"],
                           bias=self.bias)
        return y.reshape(*shape[:-1], y.shape[-1])

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] in fp32 as the kernel reads it (tests)."""
        if self.kind == "fp8":
            from gpu.kernels.triton.fp8_gemm import expand_block_scales
            return self.w.float() * expand_block_scales(self.ws, tuple(self.w.shape), (1, self.params["bi"]))
        if self.kind == "int8":
            return self.w.float() * self.ws[:, None]
        from gpu.kernels.triton.wna16_gemm import unpack
        return unpack(self.qweight, self.scales, self.zeros, self.params["group"], self.params["bits"])

    def weight_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return f"{self.kind}, in_features={self.in_features}, out_features={self.out_features}, {self.params}"


class KernelForms:
    """During a CUDA load: each quantized HF linear's kernel form, cut to this rank (take);
    after it, the merged modules replaced by QuantLinears (install)."""

    def __init__(self, lm):
        self.lm = lm
        self.forms: dict[str, dict | None] = {}

    def take(self, prefix: str, parts) -> None:
        if not _INSTALLED.fullmatch(prefix):
            return      # experts, MLA's projections: dequantized at load (no kernel form for them yet)
        if parts is None:
            self.forms[prefix] = None
            return
        kind, q, scale = parts
        scale = scale.float()
        if scale.dim() < 2:
            scale = scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(1, 1)
        scale = scale.expand(q.shape)
        self.forms[prefix] = make_form(kind, _narrow(self.lm, prefix, q), _narrow(self.lm, prefix, scale))

    def install(self) -> tuple[int, int, dict[str, int]]:
        """(linears now quantized, linears left dequantized, count per kind)."""
        from gpu.quantization.repack import _MERGED
        from gpu.models.causal_lm import MLP

        installed = dense = 0
        kinds: dict[str, int] = {}
        for i, layer in enumerate(self.lm.layers):
            for owner_name, module, parts in _MERGED:
                owner = getattr(layer, owner_name, None)
                if owner is None or (owner_name == "mlp" and not isinstance(owner, MLP)):
                    continue
                names = [f"model.layers.{i}.{owner_name}.{p}" for p in parts]
                if not all(n in self.forms for n in names):
                    continue
                form = merge([self.forms.pop(n) for n in names])
                if form is None:
                    dense += 1
                    continue
                linear = getattr(owner, module)
                bias = None if linear.bias is None else linear.bias.detach()
                setattr(owner, module, QuantLinear(form, linear.in_features, bias, linear.weight.dtype))
                installed += 1
                kinds[form["kind"]] = kinds.get(form["kind"], 0) + 1
        self.forms.clear()
        return installed, dense, kinds
