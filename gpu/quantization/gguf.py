"""A GGUF model's linear layers kept in the file's quantized blocks on the CPU (issue 39):
the loader's `--quantization gguf` (the default for GGUF files on a CPU). Each dense linear
whose source tensors are all in a format gpu/kernels/cpu/quant.c takes (Q4_0, Q4_1, Q8_0, Q4_K,
Q5_K, Q6_K) becomes a PackedLinear, and so do a mixture's experts (gpu/quantization/gguf_experts.py:
one PackedLinear an expert and projection, run on the expert's routed rows); anything else
(F32/F16 tensors, other formats) is dequantized and loaded as before. The tied embedding stays an fp32 table for the
row lookups, while the LM head reads the packed copy.

Imports: gguf_packed -> cpu_quant, weights_gguf, model (the loader calls it)."""
from __future__ import annotations

from collections import Counter

import torch

from gpu.kernels.cpu import quant as cpu_quant
from gpu.layers.moe import MoE
from gpu.models.causal_lm import MLP, CausalLM
from gpu.formats.gguf import GGUFFile
from gpu.quantization.base import QuantMethod
from gpu.quantization.gguf_experts import EXPERT_TENSORS, GGUFExperts, packed_experts


class GGUF(QuantMethod):
    """A GGUF file: its tensors are read through gpu/formats/gguf.py, which dequantizes them one
    at a time; with `packed` the dense linears instead keep the file's blocks and run in the
    C kernels (PackedLinear), computing in float32."""

    name = "gguf"

    def __init__(self, packed: bool, why: str = ""):
        self.packed = packed
        self.why = why     # the start-up line's note when not packed

    @classmethod
    def choose(cls, quantization: str, source, load_format: str, dtype, device, tp) -> "GGUF":
        """Whether a GGUF file's linears stay packed; ValueError when --quantization gguf asks
        for what cannot be."""
        if quantization == "none" or load_format == "dummy":
            return cls(False, f"--quantization {quantization}, --dtype {dtype}")
        why = None
        if source.gguf is None:
            why = "the model is not a GGUF file"
        elif torch.device(device).type != "cpu":
            why = "packed GGUF kernels are CPU kernels"
        elif tp.size > 1:
            why = "not with --tensor-parallel-size > 1"
        elif quantization == "auto" and dtype != "auto":
            why = f"--dtype {dtype} asked for: dequantized to it"
        elif dtype not in ("auto", "float32", "fp32", "float", torch.float32):
            why = f"packed GGUF linears compute in float32 (--dtype {dtype} asked)"
        else:
            why = why_not_packed(source.gguf)
        if why is not None and quantization == "gguf":
            raise ValueError(f"--quantization gguf: {why}")
        return cls(why is None, f"--quantization {quantization}, --dtype {dtype}")

    def serving_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if self.packed else dtype

    def forces_fp32(self) -> bool:
        return self.packed

    def prepare(self, lm, source, dtype):
        if not self.packed:
            named, words = super().prepare(lm, source, dtype)
            if source.gguf is not None and lm.embed_tokens.weight.device.type == "cpu":
                words += f" (GGUF dequantized at load: {self.why})"
            return named, words
        taken, formats = pack_linears(lm, source.gguf)
        from gpu.kernels.cpu import layer as cpu_layer
        lm.fused_decode = cpu_layer.FusedDecode.for_model(lm)
        words = describe(formats) + cpu_layer.describe(lm)
        if account := source.gguf.account(taken, "float32"):
            words += f"; {account}"
        if lm.config.num_experts:
            moes = [layer.mlp for layer in lm.layers if isinstance(layer.mlp, MoE)]
            kept = sum(isinstance(m.experts, GGUFExperts) for m in moes)
            words += (f"; the experts of {kept} of {len(moes)} mixture layers kept packed, each run on its routed "
                      f"rows only" + ("" if kept == len(moes) else ", the others' dequantized to float32 at load"))
        return (lambda select=None: source.gguf.named_tensors(select, skip=taken), words)

# (owner attribute path, module name, the GGUF tensors stacked into it, in order)
_LAYER_LINEARS = (
    ("self_attn", "qkv_proj", ("attn_q", "attn_k", "attn_v")),
    ("self_attn", "o_proj", ("attn_output",)),
    ("mlp", "gate_up_proj", ("ffn_gate", "ffn_up")),
    ("mlp", "down_proj", ("ffn_down",)),
)


def _moe_linears(moe: MoE) -> tuple:
    """A mixture layer's packable linears: attention's, and a shared expert's (Qwen2-MoE)."""
    attn = tuple(x for x in _LAYER_LINEARS if x[0] == "self_attn")
    if not isinstance(moe.shared_expert, MLP):
        return attn
    return attn + (("mlp.shared_expert", "gate_up_proj", ("ffn_gate_shexp", "ffn_up_shexp")),
                   ("mlp.shared_expert", "down_proj", ("ffn_down_shexp",)))


def _packed_experts(f: GGUFFile, i: int, c, moe: MoE) -> GGUFExperts | None:
    """Layer i's experts kept packed where the file and the layer allow (SwiGLU experts without
    biases, the whole intermediate on this one rank)."""
    if moe.spec.activation != "swiglu" or moe.spec.expert_bias or moe.experts.gate_up_proj.shape[1] != 2 * c.intermediate_size:
        return None
    return packed_experts(f, i, c.hidden_size, c.intermediate_size)


def why_not_packed(f: GGUFFile) -> str | None:
    """None when the kernels are built and the file has packable linears; else the reason."""
    k = cpu_quant.kernels()
    if k is None:
        return "the CPU quant kernels are not built (no C compiler, or TAILRACE_CPU_KERNELS=0)"
    if not any(f.packed_type(t.name) in cpu_quant.FORMATS for t in f.reader.tensors):
        return "the file has no tensor in a format the kernels take (" + ", ".join(cpu_quant.FORMATS.values()) + ")"
    return None


def pack_linears(lm: CausalLM, f: GGUFFile) -> tuple[frozenset[str], Counter]:
    """Replace lm's linears with PackedLinears over f's blocks; returns the GGUF tensor names
    now held packed (for the dequantizing reader to skip) and a count of packed tensors per
    format name."""
    taken: set[str] = set()
    formats: Counter = Counter()
    for i, layer in enumerate(lm.layers):
        linears = _LAYER_LINEARS
        if isinstance(layer.mlp, MoE):
            linears = _moe_linears(layer.mlp)
            packed = _packed_experts(f, i, lm.config, layer.mlp)
            if packed is not None:
                layer.mlp.experts = packed
                taken.update(f"blk.{i}.{t}.weight" for t in EXPERT_TENSORS)
                formats.update(cpu_quant.FORMATS[fmt] + " (experts)" for fmt in packed.formats)
        for owner_name, module, parts in linears:
            owner = layer.get_submodule(owner_name)
            names = [f"blk.{i}.{p}.weight" for p in parts]
            packed = _packed_linear(f, names, getattr(owner, module))
            if packed is not None:
                setattr(owner, module, packed)
                taken.update(names)
                formats.update(cpu_quant.FORMATS[fmt] for fmt in packed.formats)
    head = "output.weight" if "output.weight" in f.tensors else "token_embd.weight"
    if lm.lm_head is not None and lm.tp.size == 1:
        packed = _packed_linear(f, [head], lm.lm_head)
        if packed is not None:
            lm.lm_head = packed
            formats.update(cpu_quant.FORMATS[fmt] for fmt in packed.formats)
            if head == "output.weight":
                taken.add(head)   # the tied table (token_embd) is still read for the lookups
    return frozenset(taken), formats


def _packed_linear(f: GGUFFile, names: list[str], linear: torch.nn.Module) -> cpu_quant.PackedLinear | None:
    k = cpu_quant.kernels()
    if any(n not in f.tensors for n in names):
        return None
    segments = []
    for n in names:
        t = f.tensors[n]
        fmt = f.packed_type(n)    # Q5_0 repacked as Q8_0 (gpu/formats/gguf.py REPACKED)
        elems, nbytes = k.block(fmt) if fmt in cpu_quant.FORMATS else (0, 0)
        if not elems or len(t.shape) != 2 or int(t.shape[0]) != linear.in_features or t.shape[0] % elems:
            return None
        segments.append((fmt, None))
    segments = [f.packed(n) for n in names]
    if sum(int(w.shape[0]) for _, w in segments) != linear.out_features:
        return None
    bias = None if linear.bias is None else torch.zeros(linear.out_features)
    return cpu_quant.PackedLinear(linear.in_features, segments, bias)


def describe(formats: Counter) -> str:
    """The start-up line's account of what runs."""
    kinds = ", ".join(f"{n} {name}" for name, n in formats.most_common())
    k = cpu_quant.kernels()
    fused = k.fused_max_m if k is not None else 0
    (lo, hi), lo8 = (k.gemm_rows(), k.gemm_rows(8)[0]) if k is not None else ((0, 0), 0)
    # with AVX512_VNNI the GEMM tiles of these formats multiply int16 activations (gpu/kernels/cpu/quant_gemm.c)
    int16 = ("; Q4_0/Q4_1/Q8_0 as int16 VNNI dots, activations rounded to int16 per 32-element block"
             if k is not None and k.int16() else "")
    gemm = (f"into k-major panels for GEMM tiles at {lo}-{hi} rows a call (Q8_0 from {lo8}{int16}), otherwise "
            if hi else "")
    regs = f"in registers for Q4_0/Q4_1/Q8_0 up to {fused} rows, otherwise " if fused else ""
    # without AVX-512: int16 dot products at few rows, every format (gpu/cpu_quant.c i16tile)
    gemv = k.int16_gemv_max_m() if k is not None else 0
    if gemv:
        regs = (f"int16 dot products over blocks unpacked in registers up to {gemv} rows (Q8_0 "
                f"{k.int16_gemv_max_m(8)}, K-quants {k.int16_gemv_max_m(12)}; activations rounded to int16 per "
                f"32-element block), otherwise " + (regs if fused > gemv else ""))
    large = k.large_m if k is not None else cpu_quant.LARGE_M
    return (f"GGUF weights kept packed ({kinds} tensors; activations, residual stream and KV cache float32), "
            f"kernel cpu_quant: fp32 FMA over blocks dequantized {gemm}{regs}"
            f"in L1, up to {large} rows a call, above that dequantize + torch fp32 GEMM; "
            f"ISA {cpu_quant.isa()}")
