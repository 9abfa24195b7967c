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

import torch
from torch import nn

_GROUPS = (1024, 512, 256, 128, 64, 32, 16, 8)
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
    if first is None or any(("xs" in f) != ("xs" in first) for f in forms if f is not None):
        return None
    keys = [k for k, v in first.items() if not isinstance(v, torch.Tensor)]
    if any(f is None or any(f[k] != first[k] for k in keys) for f in forms):
        return None
    merged = dict((k, first[k]) for k in keys)
    for k, v in first.items():
        if k == "xs":     # one activation scale for the parts' one input: the largest (vLLM's choice)
            merged[k] = torch.stack([f[k] for f in forms]).amax(0)
        elif isinstance(v, torch.Tensor):
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
        # a parameter (load_weights fills it by name, in the storage the dense linear's bias had)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if x.dtype != self.dtype:
            x = x.to(self.dtype)
        x = x.contiguous()
        if self.kind == "fp8":
            from gpu.kernels.triton.fp8_gemm import fp8_gemm
            y = fp8_gemm(x, self.w, self.ws, (1, self.params["bi"]), bias=self.bias, xs=getattr(self, "xs", None))
        elif self.kind == "int8":
            from gpu.kernels.triton.int8_gemm import int8_gemm
            y = int8_gemm(x, self.w, self.ws, bias=self.bias, xs=getattr(self, "xs", None))
        else:
            from gpu.kernels.triton.wna16_gemm import wna16_gemm
            y = wna16_gemm(x, self.qweight, self.scales, self.zeros, self.params["group"], self.params["bits"],
                           bias=self.bias)
        return y.reshape(*shape[:-1], y.shape[-1])

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] in fp32 as the kernel reads it (tests)."""
        return form_weight(dict(kind=self.kind, **self.params, **dict(self.named_buffers())))

    def weight_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return f"{self.kind}, in_features={self.in_features}, out_features={self.out_features}, {self.params}"


class KernelForms:
    """A CUDA load that never holds the model expanded: the decoder linears whose every part is
    quantized were built with no dense weight (gpu/layers/ops.py weights_deferred: on the meta
    device); each part's kernel form is made from its checkpoint tensors as they arrive (cut to
    this rank), and a merged module becomes a QuantLinear as soon as its last part's form is in.
    At most one part is expanded at a time (its integers and scales, while its form is made).
    A module whose scales fit no form gets its dense weight then (the parts already formed are
    dequantized into it from their forms) and loads as any dense linear."""

    def __init__(self, lm):
        from gpu.models.causal_lm import MLP, Attention
        from gpu.quantization.repack import _MERGED

        self.lm = lm
        self.modules: dict[str, tuple[nn.Module, str, tuple[str, ...]]] = {}   # HF part -> its module
        self.forms: dict[str, dict] = {}          # parts formed, their module not yet complete
        self.installed, self.dense, self.kinds, self.static = 0, 0, {}, 0
        self.candidates = []
        for i, layer in enumerate(lm.layers):
            for owner_name, module, parts in _MERGED:
                owner = getattr(layer, owner_name, None)
                if isinstance(owner, Attention if owner_name == "self_attn" else MLP):
                    self.candidates.append((owner, module, tuple(f"model.layers.{i}.{owner_name}.{p}" for p in parts)))

    def reserve(self, quantized: set[str]) -> None:
        """Keep the weights of the modules all of whose parts are in `quantized` without storage;
        give every other deferred weight its storage."""
        kept = set()
        for owner, module, names in self.candidates:
            if all(n in quantized for n in names):
                kept.add(id(getattr(owner, module)))
                for n in names:
                    self.modules[n] = (owner, module, names)
        device = self.lm.embed_tokens.weight.device
        for mod in self.lm.modules():
            if id(mod) not in kept:
                for name, p in mod._parameters.items():
                    if p is not None and p.is_meta:
                        mod._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                             requires_grad=p.requires_grad)

    def take(self, prefix: str, kernel_parts) -> tuple[bool, list[tuple[str, torch.Tensor]]]:
        """Linear `prefix`'s tensors (kernel_parts(): the format's (kind, q, scale), or None) ->
        (whether it is kept in its kernel form, not to be loaded dense; the dense weights to load
        for parts formed earlier whose module has just fallen back, cut to this rank)."""
        entry = self.modules.get(prefix)
        if entry is None:
            return False, []   # experts, MLA's projections, partly quantized modules: dequantized at load
        owner, module, names = entry
        if not getattr(owner, module).weight.is_meta:
            return False, []   # its module already fell back to a dense weight
        parts = kernel_parts()
        form = None
        if parts is not None:
            kind, q, scale, *static = parts
            scale = scale.float()
            if scale.dim() < 2:
                scale = scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(1, 1)
            scale = scale.expand(q.shape)
            form = make_form(kind, _narrow(self.lm, prefix, q), _narrow(self.lm, prefix, scale))
            if form is not None and static and static[0] is not None and kind in ("fp8", "int8"):
                form["xs"] = static[0].float().reshape(1).to(q.device)
            del parts, q, scale
        if form is None:
            return False, self._fall_back(owner, module, names)
        self.forms[prefix] = form
        if all(n in self.forms for n in names):
            merged = merge([self.forms[n] for n in names])
            if merged is None:
                return True, self._fall_back(owner, module, names)
            for n in names:
                del self.forms[n]
            linear = getattr(owner, module)
            setattr(owner, module, QuantLinear(merged, linear.in_features, linear.bias, linear.weight.dtype))
            self.installed += 1
            self.static += "xs" in merged
            self.kinds[merged["kind"]] = self.kinds.get(merged["kind"], 0) + 1
        return True, []

    def _fall_back(self, owner: nn.Module, module: str, names: tuple[str, ...]) -> list[tuple[str, torch.Tensor]]:
        """Give the module its dense weight's storage; the parts formed so far, dequantized."""
        linear = getattr(owner, module)
        meta = linear.weight
        linear.weight = nn.Parameter(torch.empty(meta.shape, dtype=meta.dtype, device=self.lm.embed_tokens.weight.device),
                                     requires_grad=meta.requires_grad)
        self.dense += 1
        return [(n + ".weight", form_weight(self.forms.pop(n)).to(meta.dtype)) for n in names if n in self.forms]

    def summary(self) -> tuple[int, int, dict[str, int]]:
        """(linears now quantized, linears left dequantized, count per kind)."""
        if self.forms:
            raise ValueError(f"the checkpoint lacks part of a quantized module: {min(self.forms)!r} has no "
                             "sibling (q/k/v or gate/up) beside it")
        return self.installed, self.dense, self.kinds


def form_weight(form: dict) -> torch.Tensor:
    """A kernel form's weight [out, in] in fp32, as its kernel reads it."""
    if form["kind"] == "fp8":
        from gpu.kernels.triton.fp8_gemm import expand_block_scales
        return form["w"].float() * expand_block_scales(form["ws"], tuple(form["w"].shape), (1, form["bi"]))
    if form["kind"] == "int8":
        return form["w"].float() * form["ws"][:, None]
    from gpu.kernels.triton.wna16_gemm import unpack
    return unpack(form["qweight"], form["scales"], form["zeros"], form["group"], form["bits"])
