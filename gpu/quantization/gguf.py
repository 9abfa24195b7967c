"""A GGUF model's linear layers kept in the file's quantized blocks on the CPU (issue 39):
the loader's `--quantization gguf` (the default for GGUF files on a CPU). Each dense linear
whose source tensors are all in a format gpu/kernels/cpu/quant.c takes (Q4_0, Q4_1, Q5_1, Q8_0,
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K; Q5_0 repacked losslessly as Q8_0) becomes a PackedLinear (Phi-3's
fused attn_qkv and ffn_up: their rows split into the merged linear's segments), and so do a
mixture's experts (gpu/quantization/gguf_experts.py: one PackedLinear an expert and projection,
run on the expert's routed rows); anything else (F32/F16 tensors, other formats) is dequantized
and loaded as before. The embedding table stays in its blocks too (PackedEmbedding: rows
dequantized as they are looked up), sharing them with a tied LM head.

Imports: gguf_packed -> cpu_quant, weights_gguf, model (the loader calls it)."""
from __future__ import annotations

from collections import Counter

import torch

from gpu.formats.gguf import GGUFFile
from gpu.kernels.cpu import quant as cpu_quant
from gpu.layers.moe import MoE
from gpu.models.causal_lm import MLP, CausalLM
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
    def choose(cls, quantization: str, source, load_format: str, dtype, device, tp) -> GGUF:
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
            if source.gguf is not None:
                quantized = Counter(t.tensor_type.name for t in source.gguf.reader.tensors
                                    if int(t.tensor_type) not in (0, 1, 30))   # F32, F16, BF16
                kinds = ", ".join(f"{n} {k}" for k, n in quantized.most_common()) or "no quantized"
                where = "" if lm.embed_tokens.weight.device.type == "cpu" else " (the packed kernels are CPU kernels)"
                words += (f" (GGUF: {kinds} tensors dequantized to {str(dtype).removeprefix('torch.')} at load,"
                          f" one at a time: {self.why}{where})")
            return named, words
        taken, formats = pack_linears(lm, source.gguf)
        from gpu.kernels.cpu import layer as cpu_layer
        from gpu.kernels.cpu import layer_gemma
        lm.fused_decode = cpu_layer.FusedDecode.for_model(lm) or layer_gemma.GemmaDecode.for_model(lm)
        words = describe(formats) + cpu_layer.describe(lm)
        if isinstance(lm.embed_tokens, cpu_quant.PackedEmbedding):
            shared = " (the tied head's)" if lm.lm_head is not None and getattr(lm.lm_head, "packed0", None) is lm.embed_tokens.packed else ""
            words += f"; the embedding table's rows dequantized as they are looked up from its {cpu_quant.FORMATS[lm.embed_tokens.fmt]} blocks{shared}"
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
# Phi-3's files keep q/k/v in one tensor and [gate; up] in ffn_up: the same rows as the merged
# linears, split into their parts' segments (views of the blocks: nothing dequantized)
_PHI3_LINEARS = (
    ("self_attn", "qkv_proj", ("attn_qkv",)),
    ("self_attn", "o_proj", ("attn_output",)),
    ("mlp", "gate_up_proj", ("ffn_up",)),
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
    """Replace lm's linears (and its embedding table) with PackedLinears (a PackedEmbedding) over
    f's blocks; returns the GGUF tensor names now held packed (for the dequantizing reader to
    skip) and a count of the packed tensors per the file's type name (Q5_0 among them: held as
    Q8_0, account says so)."""
    taken: set[str] = set()
    formats: Counter = Counter()
    c = lm.config
    linears, splits = _LAYER_LINEARS, {}
    if f.arch == "phi3":
        linears = _PHI3_LINEARS
        splits = {"qkv_proj": (c.q_size, c.kv_size, c.kv_size), "gate_up_proj": (c.intermediate_size,) * 2}
    for i, layer in enumerate(lm.layers):
        layer_linears = linears
        if isinstance(layer.mlp, MoE):
            layer_linears = _moe_linears(layer.mlp)
            packed = _packed_experts(f, i, lm.config, layer.mlp)
            if packed is not None:
                layer.mlp.experts = packed
                taken.update(f"blk.{i}.{t}.weight" for t in EXPERT_TENSORS)
                formats.update(cpu_quant.FORMATS[fmt] + " (experts)" for fmt in packed.formats)
        for owner_name, module, parts in layer_linears:
            owner = layer.get_submodule(owner_name)
            if owner_name == "mlp" and not isinstance(owner, MLP):
                continue   # a mixture without packed experts: dequantized (gpu/layers/moe.py)
            names = [f"blk.{i}.{p}.weight" for p in parts]
            packed = _packed_linear(f, names, getattr(owner, module), splits.get(module))
            if packed is not None:
                setattr(owner, module, packed)
                taken.update(names)
                formats.update(f.tensors[n].tensor_type.name for n in names)
    head = "output.weight" if "output.weight" in f.tensors else "token_embd.weight"
    if lm.lm_head is not None and lm.tp.size == 1:
        packed = _packed_linear(f, [head], lm.lm_head)
        if packed is not None:
            lm.lm_head = packed
            formats[f.tensors[head].tensor_type.name] += 1
            if head == "output.weight":
                taken.add(head)   # a tied table is taken with the lookups' below
    table = _packed_embedding(f, lm, lm.lm_head if head == "token_embd.weight" else None)
    if table is not None:
        lm.embed_tokens = table
        if head != "token_embd.weight" or not isinstance(lm.lm_head, cpu_quant.PackedLinear):
            formats[f.tensors["token_embd.weight"].tensor_type.name] += 1   # not counted with the head
        taken.add("token_embd.weight")
    return frozenset(taken), formats


def _packable(f: GGUFFile, name: str, in_features: int) -> bool:
    """Whether tensor name is a 2-D [*, in_features] weight in a format the kernels take."""
    k, t = cpu_quant.kernels(), f.tensors.get(name)
    fmt = f.packed_type(name) if t is not None else None    # Q5_0 repacked as Q8_0 (gpu/formats/gguf.py REPACKED)
    if fmt not in cpu_quant.FORMATS or len(t.shape) != 2 or int(t.shape[0]) != in_features:
        return False
    return int(t.shape[0]) % k.block(fmt)[0] == 0


def _packed_linear(f: GGUFFile, names: list[str], linear: torch.nn.Module,
                   split: tuple[int, ...] | None = None) -> cpu_quant.PackedLinear | None:
    """A PackedLinear over the tensors names stacked in order; split: the rows of one tensor cut
    into the merged linear's parts (Phi-3's attn_qkv, ffn_up), each a segment."""
    if not all(_packable(f, n, linear.in_features) for n in names):
        return None
    segments = [f.packed(n) for n in names]
    if split is not None:
        (fmt, w), = segments
        if sum(split) != w.shape[0]:
            return None
        segments = [(fmt, part) for part in w.split(list(split))]
    if sum(int(w.shape[0]) for _, w in segments) != linear.out_features:
        return None
    bias = None if linear.bias is None else torch.zeros(linear.out_features)
    return cpu_quant.PackedLinear(linear.in_features, segments, bias)


def _packed_embedding(f: GGUFFile, lm: CausalLM, tied: cpu_quant.PackedLinear | None) -> cpu_quant.PackedEmbedding | None:
    """token_embd kept in its blocks for the lookups, sharing the tied head's (tied: its
    PackedLinear); None where it cannot be (another format, tensor parallelism, a table that
    is not an nn.Embedding of the vocabulary)."""
    D = lm.config.hidden_size
    if lm.tp.size != 1 or not isinstance(lm.embed_tokens, torch.nn.Embedding) or not _packable(f, "token_embd.weight", D):
        return None
    if isinstance(tied, cpu_quant.PackedLinear) and len(tied.formats) == 1:
        fmt, w = next(iter(tied._segments()))
    else:
        fmt, w = f.packed("token_embd.weight")
    if w.shape[0] != lm.embed_tokens.num_embeddings:
        return None
    return cpu_quant.PackedEmbedding(fmt, w, D)


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
                f"{k.int16_gemv_max_m(8)}, K-quants {k.int16_gemv_max_m(12)}, Q2_K/Q3_K {k.int16_gemv_max_m(10)}; "
                f"activations rounded to int16 per "
                f"32-element block), otherwise " + (regs if fused > gemv else ""))
    large = k.large_m if k is not None else cpu_quant.LARGE_M
    return (f"GGUF weights kept packed ({kinds} tensors; activations, residual stream and KV cache float32), "
            f"kernel cpu_quant: fp32 FMA over blocks dequantized {gemm}{regs}"
            f"in L1, up to {large} rows a call, above that dequantize + torch fp32 GEMM; "
            f"ISA {cpu_quant.isa()}")
