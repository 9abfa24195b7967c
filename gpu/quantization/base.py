"""A weight format as a method (vLLM's QuantizeMethodBase, issue 54's quantization/): which
checkpoint tensors make a linear, how they load and shard, and how the linear runs.

The loader (gpu/loader/decoder.py) asks gpu/quantization/config.py for the checkpoint's method,
then calls it at four points:
  plan(names)            before anything is built: every tensor name is checked against the
                         format (a mismatch is a ValueError naming the tensor);
  serving_dtype(dtype)   the dtype the model is built in (GGUF packed linears: float32);
  prepare(lm, source)    after the model is built: repack linears in place (GGUF), and say in
                         words what holds the weights (the start-up line);
  weights(named)         the checkpoint stream -> the HF names CausalLM.load_weights takes: a
                         quantized linear's tensors (qweight, scales, ...) become its `weight`.

Tensor parallelism: a quantized linear's tensors are read whole (`select` answers None for
them) and dequantized; CausalLM.load_weights then cuts the dense weight to the rank's rows or
columns as it cuts any other (dequantize-then-shard: exact, and every format shards alike).
"""

from __future__ import annotations

import functools
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

Named = Iterable[tuple[str, torch.Tensor]]


class QuantMethod(ABC):
    """The base: a format whose linears are dense `weight` (+ `bias`) tensors as the model
    holds them, so every hook passes through."""

    name: str = "none"
    # checkpoint tensor suffixes (after the linear's name) that only this format writes
    suffixes: tuple[str, ...] = ()
    # MXFP4 experts (NAME_blocks / NAME_scales): kept packed on CUDA (gpu/quantization/mxfp4.py)
    mxfp4_experts: bool = False

    def plan(self, names: Sequence[str]) -> None:
        """Check the checkpoint's tensor names against the format before loading."""

    def kv_scales(self) -> dict[int, tuple[float, float]]:
        """Layer -> (k_scale, v_scale) the checkpoint carries for an fp8 KV cache (none: {})."""
        return {}

    def serving_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype

    def defers_weights(self) -> bool:
        """Whether the model is built with its linears' weights on the meta device (gpu/layers/ops.py
        weights_deferred), for prepare to give storage to those that stay dense."""
        return False

    def forces_fp32(self) -> bool:
        """Whether activations and the residual stream must be float32 (packed CPU kernels)."""
        return False

    def prepare(self, lm, source, dtype: torch.dtype) -> tuple[Callable, str]:
        """(the reader to load from: (select) -> named tensors, the start-up line's words)."""
        return source.named_tensors, f"{_dtype_name(dtype)} weights"

    def select(self, checkpoint_slices: Callable) -> Callable:
        """A tensor-parallel reader's `select`: the parts of each tensor to read."""
        return checkpoint_slices

    def weights(self, named: Named, dtype: torch.dtype, device) -> Iterator[tuple[str, torch.Tensor]]:
        yield from named

    def finish(self, lm, words: str) -> str:
        """After the weights are in: repack what the format runs packed; the start-up words."""
        return words

    def packs_experts(self, experts: str, config, device, dummy: bool) -> bool:
        """Whether a mixture-of-experts model keeps MXFP4 experts packed (gpu/layers/moe.py):
        --experts packed, or auto on CUDA for an MXFP4 checkpoint or a dummy load."""
        if not config.num_experts or experts == "dequantized":
            return False
        if experts == "auto" and config.moe.activation != "clamped_swiglu":
            return False    # MXFP4 experts: gpt-oss's alone
        if experts == "packed":
            return True
        fits = config.hidden_size % 32 == 0 and config.intermediate_size % 32 == 0
        return torch.device(device).type == "cuda" and fits and (self.mxfp4_experts or dummy)


class LinearFormat(QuantMethod):
    """A format whose linears are several checkpoint tensors, dequantized at load to the
    serving dtype (on CPU and, until its kernels exist, on CUDA). A subclass says which
    suffixes mark a quantized linear (`markers`), which it needs (`required`) and how they
    make the dense weight (`dequantize`)."""

    # suffixes any one of which marks NAME as a quantized linear
    markers: tuple[str, ...] = ()
    # whether its linears are integers times a scale (`integers`): then, on a CPU serving
    # float32, they may run in the packed GGUF kernels (gpu/quantization/repack.py)
    integer_grid: bool = False

    def __init__(self, config: dict):
        self.config = config
        self.quantized: set[str] = set()   # HF linear names (model.layers.0.self_attn.q_proj)
        self.count = 0
        self.pack = False                  # repack exact linears into GGUF blocks (use_packed_kernels)
        self.blocks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}   # prefix -> repack.block_form
        self.expected: set[str] = set()    # the model's HF weight names (prepare)
        self.gpu_kernels = False           # run the linears by the Triton GEMMs (CUDA)
        self.kv: dict[int, dict[str, float]] = {}   # layer -> {"k"|"v"|"kv": scale} (checkpoint KV scales)
        self.forms = None                  # cuda_linear.KernelForms while loading on CUDA

    @abstractmethod
    def required(self, prefix: str) -> tuple[str, ...]:
        """The suffixes linear `prefix` cannot be dequantized without."""

    def kernel_kind(self, prefix: str) -> str | None:
        """An integer-grid linear's Triton GEMM on CUDA (gpu/quantization/cuda_linear.py): "w4"
        or "w8" (weights only), "int8" (W8A8), or None (dequantized)."""
        return None

    def kernel_parts(self, prefix: str, parts: dict[str, torch.Tensor]):
        """(kind, q [out, in], scale broadcastable to [out, in], the static activation scale or
        None) for cuda_linear, or None."""
        kind = self.kernel_kind(prefix)
        return None if kind is None else (kind, *self.integers(prefix, parts), self.input_scale(prefix, parts))

    def static_activations(self, prefix: str) -> bool:
        """Whether linear `prefix`'s activations are quantized by the checkpoint's NAME.input_scale
        (then a required tensor) instead of per token."""
        return False

    def input_scale(self, prefix: str, parts: dict[str, torch.Tensor]) -> torch.Tensor | None:
        if not self.static_activations(prefix):
            return None
        s = parts["input_scale"]
        if s.numel() != 1:
            raise ValueError(f"{self.name}: {prefix + '.input_scale'!r} has {s.numel()} values; a static "
                             "activation scale is one per tensor")
        return s.float().reshape(1)

    def integers(self, prefix: str, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An integer-grid format's linear as (n [out, in] integers, scale broadcastable to
        [out, in] fp32) with w = n * scale; None for other formats."""
        return None

    def dequantize(self, prefix: str, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The linear's tensors (by suffix) -> its dense weight [out, in] in dtype (one fp32
        product per element, then one rounding to dtype)."""
        n, scale = self.integers(prefix, parts)
        if self.pack:
            from gpu.quantization.repack import block_form
            if (form := block_form(n, scale)) is not None:
                self.blocks[prefix] = form
        return (n.float() * scale.float()).to(dtype)

    def use_packed_kernels(self, dtype, device, tp, quantization: str) -> None:
        """Repack integer-grid linears for the packed CPU kernels where exact: on a CPU, one
        process, --dtype auto or float32 (they compute in float32), --quantization not none,
        and the kernels built."""
        from gpu.config.names import DTYPE_ALIASES
        name = dtype if not isinstance(dtype, str) else DTYPE_ALIASES.get(dtype, dtype)
        from gpu.quantization import cuda_linear
        self.gpu_kernels = cuda_linear.wanted(device) and quantization != "none"
        if (not self.integer_grid or quantization == "none" or tp.size > 1
                or torch.device(device).type != "cpu" or name not in ("auto", "float32", torch.float32)):
            return
        from gpu.kernels.cpu import quant as cpu_quant
        self.pack = cpu_quant.kernels() is not None

    def serving_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if self.pack else dtype

    def defers_weights(self) -> bool:
        return self.gpu_kernels

    def forces_fp32(self) -> bool:
        return self.pack

    def finish(self, lm, words: str) -> str:
        if self.forms is not None:
            installed, dense, kinds = self.forms.summary()
            what = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "none"
            rest = (f"; {dense} dequantized at load (scales no kernel form takes: act-order groups, e5m2, "
                    "FP8 groups finer than 128)" if dense else "")
            acts = ""
            if {"fp8", "int8"} & set(kinds):
                static = self.forms.static
                acts = (" (activations quantized per token in the kernel" +
                        (f"; in {static} by the checkpoint's static input_scale)" if static else ")"))
            return (f"{words.split(';')[0]}; {self.scheme()}: {installed} of {installed + dense} decoder linears "
                    f"kept quantized and run by the Triton GEMMs ({what}){acts}{rest}; the rest dense")
            self.forms = None
        if not self.pack:
            return words
        from gpu.kernels.cpu import layer as cpu_layer
        from gpu.kernels.cpu import quant as cpu_quant
        from gpu.quantization.repack import pack_model
        packed, dense, formats = pack_model(lm, self.blocks)
        self.blocks.clear()
        if packed:
            lm.fused_decode = cpu_layer.FusedDecode.for_model(lm)
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(formats.items()))
        fused = "; a decode step's layers in one C call" if lm.fused_decode is not None else ""
        rest = (f"; {dense} dequantized at load to float32 (act-order groups, or scales that are not "
                "fp16 values: no exact block form)" if dense else "")
        return (f"float32 activations and residual stream; {self.scheme()}: {packed} of "
                f"{packed + dense} decoder linears repacked exactly into GGUF blocks ({kinds or 'none'} "
                f"tensors) for the packed CPU kernels (cpu_quant, ISA {cpu_quant.isa()}){fused}{rest}")

    def scheme(self) -> str:
        """The format's parameters, in words (the start-up line)."""
        return self.name

    def ignored(self, prefix: str) -> bool:
        """Whether the config keeps linear `prefix` dense (its ignore list)."""
        return False

    def plan(self, names: Sequence[str]) -> None:
        have: dict[str, set[str]] = {}
        for n in names:
            prefix, _, suffix = n.rpartition(".")
            have.setdefault(prefix, set()).add(suffix)
        for prefix, suffixes in have.items():
            marked = [s for s in self.markers if s in suffixes]
            if not marked:
                continue
            if self.ignored(prefix):
                raise ValueError(f"{self.name}: {prefix + '.' + marked[0]!r} is a quantized tensor, but the "
                                 f"quantization_config's ignore list keeps {prefix} dense")
            lacking = [s for s in self.required(prefix) if s not in suffixes]
            if lacking:
                raise ValueError(f"{self.name}: the checkpoint has {prefix + '.' + marked[0]!r} but not "
                                 f"{prefix + '.' + lacking[0]!r}")
            self.quantized.add(prefix)
        if not self.quantized:
            raise ValueError(f"{self.name}: no tensor of the checkpoint is quantized (no name ends in "
                             f"{' or '.join('.' + m for m in self.markers)}): is --quantization right?")

    def kv_scales(self) -> dict[int, tuple[float, float]]:
        return {layer: (s.get("k", s.get("kv", 1.0)), s.get("v", s.get("kv", 1.0))) for layer, s in self.kv.items()}

    def owns(self, name: str) -> bool:
        prefix, _, suffix = name.rpartition(".")
        return prefix in self.quantized and suffix in self.suffixes

    def select(self, checkpoint_slices: Callable) -> Callable:
        def select(name: str, shape):
            return None if self.owns(name) else checkpoint_slices(name, shape)
        return select

    def prepare(self, lm, source, dtype: torch.dtype) -> tuple[Callable, str]:
        self.expected = set(lm.hf_weight_names())
        if self.gpu_kernels:
            from gpu.quantization.cuda_linear import KernelForms
            self.forms = KernelForms(lm)
            self.forms.reserve(self.quantized)
        where = "CPU" if lm.embed_tokens.weight.device.type == "cpu" else "GPU"
        return source.named_tensors, (
            f"{_dtype_name(dtype)} weights; {len(self.quantized)} {self.scheme()} linears dequantized "
            f"once at load to {_dtype_name(dtype)} (no {self.name} kernel on the {where} yet: "
            f"the weights' bytes in memory are {_dtype_name(dtype)}'s)")

    def weights(self, named: Named, dtype: torch.dtype, device) -> Iterator[tuple[str, torch.Tensor]]:
        """Each quantized linear's tensors gathered (in any order, any distance apart) and
        replaced by NAME.weight, dequantized on `device` once its required tensors are in;
        an optional tensor after that (an input_scale read later) is dropped."""
        pending: dict[str, dict[str, torch.Tensor]] = {}
        done: set[str] = set()
        for name, tensor in named:
            if (kv := kv_scale_name(name)) is not None:
                layer, which = kv
                if tensor.numel() != 1:
                    raise ValueError(f"{self.name}: the checkpoint's {name!r} has {tensor.numel()} values; a KV "
                                     "cache scale is one per layer (per-head scales are not served)")
                self.kv.setdefault(layer, {})[which] = float(tensor.float().reshape(()))
                continue
            if not self.owns(name):
                if (name.endswith(".bias") and name not in self.expected and name.removesuffix(".bias") in self.quantized
                        and not tensor.any()):
                    continue      # GPTQ/AWQ writers save a zero bias for linears that have none
                yield name, dense(name, tensor, self.name)
                continue
            prefix, _, suffix = name.rpartition(".")
            if prefix in done:
                continue
            parts = pending.setdefault(prefix, {})
            parts[suffix] = tensor.to(device)
            if all(s in parts for s in self.required(prefix)):
                del pending[prefix]
                done.add(prefix)
                self.count += 1
                if self.forms is not None:
                    kept, formed = self.forms.take(prefix, functools.partial(self.kernel_parts, prefix, parts))
                    yield from formed     # its module fell back to a dense weight: the parts formed before
                    if kept:
                        continue          # in its kernel form: never expanded to a dense weight
                yield prefix + ".weight", self.dequantize(prefix, parts, dtype)
        for prefix, parts in pending.items():
            lacking = [s for s in self.required(prefix) if s not in parts]
            raise ValueError(f"{self.name}: the checkpoint has {prefix + '.' + next(iter(parts))!r} but not "
                             f"{prefix + '.' + lacking[0]!r}")


class Unquantized(QuantMethod):
    """bf16 / fp16 / fp32 checkpoints: dense `weight` tensors, loaded as they are. A tensor
    that only a quantized format writes is a start-up error that names it."""

    name = "none"

    def weights(self, named: Named, dtype: torch.dtype, device) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named:
            yield name, dense(name, tensor, "a dense checkpoint")

    def plan(self, names: Sequence[str]) -> None:
        for n in names:
            suffix = n.rpartition(".")[2]
            if suffix in QUANTIZED_SUFFIXES:
                raise ValueError(f"the checkpoint's {n!r} is a quantized format's tensor, but config.json "
                                 "has no quantization_config (or --quantization none asked for a dense "
                                 "checkpoint); pass --quantization with the checkpoint's format")


class MXFP4(QuantMethod):
    """gpt-oss's quantization_config ({"quant_method": "mxfp4"}) or NAME_blocks / NAME_scales
    expert tensors: the experts' pairs pass to CausalLM.load_weights, which keeps them packed
    (gpu/layers/moe.py PackedExperts, run by gpu/kernels/triton/mxfp4_moe.py) or dequantizes
    them (mxfp4.dequantize_pairs); every other tensor is dense."""

    name = "mxfp4"
    suffixes = ("_blocks", "_scales")    # gpu/quantization/mxfp4.py BLOCKS_SUFFIX, SCALES_SUFFIX
    mxfp4_experts = True

    def __init__(self, config: dict | None = None):
        self.config = config or {}


# every suffix the formats below write besides `weight` and `bias` (Unquantized refuses them)
QUANTIZED_SUFFIXES = frozenset({
    "weight_scale", "weight_scale_inv", "input_scale", "weight_zero_point", "input_zero_point",
    "weight_packed", "weight_shape", "weight_g_idx", "qweight", "qzeros", "scales", "g_idx",
})


# a checkpoint's KV cache scales: vLLM's and compressed-tensors' self_attn.k_scale / v_scale,
# older FP8 checkpoints' self_attn.kv_scale (one for both) and k_proj / v_proj.output_scale
_KV_SCALE = re.compile(r"layers\.(\d+)\.(?:[\w.]*\.)?(?:(k|v|kv)_scale|(k|v)_proj\.output_scale)$")


def kv_scale_name(name: str) -> tuple[int, str] | None:
    """(layer, "k" | "v" | "kv") when `name` is a KV cache scale, else None."""
    m = _KV_SCALE.search(name)
    return None if m is None else (int(m.group(1)), m.group(2) or m.group(3))


def dense(name: str, tensor: torch.Tensor, what: str) -> torch.Tensor:
    """A tensor loaded as it is: refused when its dtype holds quantized values (an fp8 or int
    weight whose scale the checkpoint lacks would otherwise be cast as if it were a number)."""
    if tensor.dtype in _QUANTIZED_DTYPES and not name.endswith(("_blocks", "_scales")):
        raise ValueError(f"{what}: the checkpoint's {name!r} is {_dtype_name(tensor.dtype)}, a quantized "
                         "value with no scale tensor beside it (e.g. NAME.weight_scale) to dequantize it by")
    return tensor


_QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.uint8, torch.int32)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
