"""load_model: a GGUF file or a HF directory (or just a config, with random weights) -> LoadedModel.
The tokenizer alone (no torch): gpu/tokenizers/files.py.

Imports run one way inside gpu/: loader -> tokenizer_files -> weights_gguf -> tokenizer ->
weights_hf (and loader -> tokenizer)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs
import torch
from tqdm import tqdm

from gpu.models.registry import config_from_hf, model_class
from gpu.formats import hf as weights_hf
from gpu.config.model import ModelConfig
from gpu.config.overrides import apply_hf_overrides
from gpu.models.causal_lm import CausalLM
from gpu.layers.ops import weights_deferred
from gpu.parallel import SINGLE, TP
from gpu.tokenizers.tokenizer import Tokenizer, tokenizer_from_hf_dir
from gpu.tokenizers.files import default_model_path
from gpu.config.vision import (VisionSpec, is_vision_config, text_config, vision_architecture,
                               vision_spec)
from gpu.config.names import DTYPE_ALIASES, DTYPE_NAMES, LOAD_FORMATS, QUANTIZATIONS  # noqa: F401 (re-exported)
from gpu.formats.gguf import GGUFFile
from gpu.quantization.config import select_method, stand_in_format

EXPERT_FORMATS = ("auto", "packed", "dequantized")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
assert tuple(DTYPES) == DTYPE_NAMES


@attrs.frozen
class LoadedModel:
    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer | None
    generation_config: dict
    name: str
    path: str
    max_model_len: int
    # Every id that ends a sequence: the tokenizer's eos_token, then config.json's, then
    # generation_config.json's (e.g. Qwen's <|im_end|> and <|endoftext|>). Merged here only.
    eos_token_ids: tuple[int, ...] = ()
    # what holds the weights, in words (the start-up line): packed GGUF formats and kernel
    weights: str = ""
    # a vision-language model (issue 34): gpu/models/llava_vision.py's LlavaVision, and what render needs
    vision: Any = None
    vision_spec: VisionSpec | None = None
    # layer -> (k_scale, v_scale) from the checkpoint, for --kv-cache-dtype fp8 (none: 1.0)
    kv_scales: dict = attrs.Factory(dict)
    # the decoder linears' format, for the GPU stand-in's cost (gpu/quantization/config.py stand_in_format)
    weight_format: str = "bf16"


# CPU features under which torch computes bf16 matmuls natively (oneDNN's bf16 kernels):
# torch.cpu.get_capabilities() names them. Without one of them bf16 is emulated and about
# 7x slower than fp32 (measured on an AVX2-only EPYC); with AVX512_BF16 it is 2.5x faster.
CPU_BF16_FEATURES = ("amx_bf16", "avx512_bf16")


def cpu_has_native_bf16(capabilities=None) -> tuple[bool, str]:
    """(whether this CPU computes bf16 natively, the reason in words)."""
    caps = torch.cpu.get_capabilities() if capabilities is None else capabilities
    have = [f.upper() for f in CPU_BF16_FEATURES if caps.get(f)]
    if have:
        return True, f"the CPU has {' and '.join(have)}"
    return False, ("the CPU has neither AMX_BF16 nor AVX512_BF16, so bf16 matmuls would be "
                   "emulated (several times slower than float32)")


def choose_dtype(dtype: str | torch.dtype, device: str | torch.device,
                 capabilities=None) -> tuple[torch.dtype, str]:
    """The dtype to load in, and why. auto: bfloat16 on accelerators; on CPU bfloat16 when
    the CPU computes it natively (AMX or AVX512_BF16), else float32. fp16 is never a CPU
    default (no native fp16 matmul on these CPUs)."""
    if isinstance(dtype, torch.dtype):
        return dtype, "asked for"
    if dtype == "auto":
        if torch.device(device).type != "cpu":
            return torch.bfloat16, "auto on an accelerator"
        native, why = cpu_has_native_bf16(capabilities)
        return (torch.bfloat16 if native else torch.float32), f"auto on CPU: {why}"
    name = DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose from auto, {', '.join(DTYPES)}")
    return DTYPES[name], f"--dtype {dtype}"


def choose_residual_dtype(residual: str | torch.dtype | None, dtype: torch.dtype,
                          device: str | torch.device) -> tuple[torch.dtype, str]:
    """The residual stream's dtype (CausalLM's residual_dtype), and why. auto: float32 on a
    CPU under 16-bit weights, where the GEMMs stay 16-bit but their outputs add into fp32
    sums (the recipe measured in docs/benchmarks.md); elsewhere the weights' dtype (the
    CUDA kernels take one dtype)."""
    if isinstance(residual, torch.dtype):
        return residual, "asked for"
    if residual in (None, "auto"):
        if torch.device(device).type == "cpu" and dtype != torch.float32:
            return torch.float32, CPU_RECIPE
        return dtype, "the weights' dtype"
    return choose_dtype(residual, device)[0], f"--residual-dtype {residual}"


# Why auto keeps the residual stream in fp32 on CPU (scripts/dtype_quality.py, docs/benchmarks.md).
CPU_RECIPE = ("bf16 GEMMs into an fp32 residual stream, exact top logits: KL from fp32 "
              "0.45x HF bf16's, 19/24 greedy chats as fp32's against HF bf16's 16, ~6% slower than "
              "pure bf16; docs/benchmarks.md")


def cpu_threads() -> str:
    """The CPU thread settings the step runs under, in words (for the start-up line)."""
    import os

    env = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_PROC_BIND",
                                      "KMP_AFFINITY", "ONEDNN_MAX_CPU_ISA") if k in os.environ}
    from gpu.kernels.cpu import ops as cpu_kernels

    onednn = "oneDNN" if torch.backends.mkldnn.is_available() else "no oneDNN"
    return (f"{torch.get_num_threads()} intra-op threads ({torch.get_num_interop_threads()} inter-op), "
            f"{onednn}, {' '.join(f'{k}={v}' for k, v in env.items()) or 'OMP_NUM_THREADS unset'}; "
            f"{cpu_kernels.describe()}")


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device) -> torch.dtype:
    """choose_dtype without the reason."""
    return choose_dtype(dtype, device)[0]


def load_model(
    model: str | Path | None = None,
    *,
    load_format: str = "auto",
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    seed: int = 0,
    progress: bool = True,
    experts: str = "auto",
    residual_dtype: str | torch.dtype | None = "auto",
    tp: TP = SINGLE,
    quantization: str = "auto",
    hf_overrides: dict | None = None,
) -> LoadedModel:
    """experts (mixture-of-experts models): "packed" keeps MXFP4 experts as the checkpoint stores
    them (a dummy load draws random packed experts), "dequantized" expands them to dtype; "auto"
    packs on CUDA when the checkpoint's experts are MXFP4 (or for a dummy load).

    tp: this rank's place in a tensor-parallel group (gpu/parallel.py). The model holds its
    shard only: safetensors are read in part (get_slice); GGUF tensors are dequantised one at a
    time, only the rank's rows of the ones cut by rows. Every rank calls load_model with the
    same arguments and its own tp.

    quantization (QUANTIZATIONS): the weight format, checked against the checkpoint's
    (gpu/quantization/config.py): e.g. whether a GGUF file's quantized linears stay packed on a
    CPU (they compute in fp32: activations, residual stream and KV cache fp32), or which of
    fp8, compressed-tensors, awq, gptq the checkpoint's quantization_config must name.

    hf_overrides (--hf-overrides): laid over the config dict before the family reads it
    (gpu/config/overrides.py)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unsupported load_format {load_format!r}; choose from {', '.join(LOAD_FORMATS)}")
    if experts not in EXPERT_FORMATS:
        raise ValueError(f"unsupported experts {experts!r}; choose from {', '.join(EXPERT_FORMATS)}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unsupported quantization {quantization!r}; choose from {', '.join(QUANTIZATIONS)}")
    path = Path(model).expanduser() if model is not None else default_model_path()
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    torch_dtype = resolve_dtype(dtype, device)   # a bad --dtype fails before the file is read
    source = open_source(path, load_format, hf_overrides)
    # the weight format (gpu/quantization/): which tensors make a linear, how they load, how it runs
    method = select_method(quantization, source, load_format=load_format, dtype=dtype, device=device, tp=tp)
    torch_dtype = method.serving_dtype(torch_dtype)

    config = source.config
    with weights_deferred(method.defers_weights()):    # the quantized linears: no dense copy on CUDA
        lm = model_class(config)(config, torch_dtype, device,
                      packed_experts=method.packs_experts(experts, config, device, load_format == "dummy"),
                      residual_dtype=torch.float32 if method.forces_fp32() else choose_residual_dtype(residual_dtype, torch_dtype, device)[0],
                      tp=tp)
    named_tensors, weights = method.prepare(lm, source, torch_dtype)
    if source.gguf is not None:
        weights += f"; {source.gguf.template_note}"
    vision = None
    if source.vision_config is not None:
        if tp.size > 1:
            raise ValueError("a vision-language model is not served with --tensor-parallel-size > 1")
        vision = build_vision(source.vision_config, config.hidden_size, torch_dtype, device)
    if load_format == "dummy":
        _init_random(lm, seed)
        if vision is not None:
            _init_random_module(vision, seed + 1)
    else:
        select = method.select(lm.checkpoint_slices) if tp.size > 1 else None
        named = named_tensors(select)
        vision_tensors: list = []
        if vision is not None:
            named = vision.split_checkpoint(named, vision_tensors)
        tensors = tqdm(named, total=source.num_tensors, desc=f"loading {source.name}",
                       unit="tensor", delay=0.5,
                       # a bar on a terminal only (rank 0's): a log file (or --log-format json) gets no bar
                       disable=None if progress and tp.first else True)
        lm.load_weights(method.weights(tensors, torch_dtype, lm.embed_tokens.weight.device))
        if vision is not None:
            vision.load_weights(vision_tensors)
        weights = method.finish(lm, weights)
    lm.eval()
    if vision is not None:
        vision.eval()
    return LoadedModel(config=config, model=lm, tokenizer=source.tokenizer, generation_config=source.generation_config,
                       name=source.name, path=str(path), max_model_len=config.max_position_embeddings,
                       eos_token_ids=merge_eos_ids(source.tokenizer, config, source.generation_config),
                       weights=weights, vision=vision, vision_spec=source.vision_spec, kv_scales=method.kv_scales())


def build_vision(config: dict, text_hidden: int, dtype, device):
    """A vision-language model's vision side: Qwen2.5-VL's tower and merger
    (gpu/models/qwen_vision.py) or LLaVA's CLIP or SigLIP tower and projector (gpu/models/llava_vision.py); its
    `split_checkpoint` picks its tensors out of the checkpoint's."""
    if vision_architecture(config) == "qwen2_5_vl":
        from gpu.models.qwen_vision import QwenVision
        return QwenVision(config, text_hidden, dtype, device)
    from gpu.models.llava_vision import LlavaVision
    return LlavaVision(config, text_hidden, dtype, device)


def device_type(device: str | torch.device) -> str:
    return torch.device(device).type


def load_shell(model: str | Path | None = None, *, load_format: str = "auto",
               dtype: torch.dtype = torch.bfloat16, hf_overrides: dict | None = None) -> LoadedModel:
    """Everything but the weights: config, tokenizer, generation config, EOS ids, and the
    model built on the meta device (shapes, no memory). For a simulated GPU."""
    path = Path(model).expanduser() if model is not None else default_model_path()
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    source = open_source(path, "dummy" if load_format == "auto" else load_format, hf_overrides)
    config = source.config
    return LoadedModel(config=config, model=model_class(config)(config, dtype, "meta"), tokenizer=source.tokenizer,
                       generation_config=source.generation_config, name=source.name, path=str(path),
                       max_model_len=config.max_position_embeddings,
                       eos_token_ids=merge_eos_ids(source.tokenizer, config, source.generation_config),
                       vision_spec=source.vision_spec, weight_format=stand_in_format(source.quantization_config))


def merge_eos_ids(tokenizer: Tokenizer | None, config: ModelConfig, generation_config: dict) -> tuple[int, ...]:
    """The one place EOS ids are merged: tokenizer, then config.json, then generation_config.json."""
    tok = tokenizer.eos_token_ids if tokenizer is not None else ()
    return tuple(dict.fromkeys((*tok, *config.eos_token_ids,
                                *_as_tuple(generation_config.get("eos_token_id")))))


@attrs.frozen
class Source:
    """What a checkpoint provides, independent of its format."""

    config: ModelConfig
    tokenizer: Tokenizer | None
    generation_config: dict
    name: str
    num_tensors: int
    # (select) -> Iterator[tuple[str, torch.Tensor]]; select(name, shape) -> the slices of the
    # tensor wanted, or None for all of it (a hint: a reader may ignore it and yield it whole)
    named_tensors: Any
    mxfp4_experts: bool = False  # the checkpoint stores NAME_blocks / NAME_scales pairs
    # config.json's quantization_config (gpu/quantization/config.py), and every tensor's name
    quantization_config: dict | None = None
    tensor_names: tuple[str, ...] = ()
    gguf: GGUFFile | None = None  # the open file, for a GGUF source
    vision_config: dict | None = None     # a vision-language model's whole config.json
    vision_spec: VisionSpec | None = None


def open_source(path: Path, load_format: str, hf_overrides: dict | None = None) -> Source:
    """The checkpoint's parts; `hf_overrides` (--hf-overrides) laid over its config dict
    (config.json, or the one GGUF's metadata makes) before the family reads it."""
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1 and load_format in ("auto", "gguf", "dummy"):
            path = ggufs[0]
    if path.is_file() and path.suffix == ".gguf":
        if load_format == "safetensors":
            raise ValueError(f"{path} is a GGUF file, not a safetensors checkpoint")
        return _gguf_source(path, hf_overrides)
    if load_format == "gguf":
        raise ValueError(f"load_format='gguf' needs a .gguf file, got {path}")
    if path.is_file() and path.name.endswith(".json"):
        if load_format != "dummy":
            raise ValueError(f"{path} is a config file; it can only be loaded with load_format='dummy'")
        path = path.parent
    return _hf_source(path, need_weights=load_format != "dummy", hf_overrides=hf_overrides)


def _gguf_source(path: Path, hf_overrides: dict | None = None) -> Source:
    f = GGUFFile.open(path)
    config = config_from_hf(apply_hf_overrides(f.config_dict(), hf_overrides))
    return Source(config=config, tokenizer=f.tokenizer(), generation_config=f.generation_config(),
                   name=f.name, num_tensors=len(f.tensors), named_tensors=f.named_tensors, gguf=f)


def _hf_source(model_dir: Path, need_weights: bool, hf_overrides: dict | None = None) -> Source:
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json (expected a HF model directory or a .gguf file)")
    generation_config = weights_hf.read_json(model_dir / "generation_config.json")
    raw = apply_hf_overrides(weights_hf.read_json(model_dir / "config.json"), hf_overrides)
    vision = is_vision_config(raw)
    config = config_from_hf(text_config(raw) if vision else raw)
    tokenizer = (tokenizer_from_hf_dir(model_dir)
                 if (model_dir / "tokenizer.json").is_file() else None)
    spec = vision_spec(model_dir, raw, tokenizer) if vision else None
    files = weights_hf.safetensors_files(model_dir) if need_weights else []
    names = weights_hf.tensor_names(files)
    return Source(config=config, tokenizer=tokenizer, generation_config=generation_config, name=model_dir.resolve().name,
                   num_tensors=len(names), named_tensors=lambda select=None: weights_hf.named_tensors(files, select),
                   mxfp4_experts=any(n.endswith("_blocks") for n in names),
                   quantization_config=raw.get("quantization_config") or (
                       text_config(raw).get("quantization_config") if vision else None),
                   tensor_names=tuple(names),
                   vision_config=raw if vision else None, vision_spec=spec)


def _as_tuple(value: int | Iterable[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


@torch.no_grad()
def _init_random(model: CausalLM, seed: int) -> None:
    """Deterministic random weights: N(0, 0.02) matrices, zero biases, unit norm weights; packed
    experts draw uniform codes at a scale of the same size. A tensor-parallel rank gets its
    shard of the very weights a single process draws (each drawn whole, one at a time, and
    cut by load_weights), so a dummy model answers alike at every --tensor-parallel-size."""
    if model.tp.size == 1:
        params = dict(model.named_parameters())
        for name, w in _random_weights(model, seed):
            params[name].copy_(w)
        return
    model.load_weights(_as_checkpoint(model, _random_weights(model, seed)))


@torch.no_grad()
def _init_random_module(module: torch.nn.Module, seed: int) -> None:
    """A vision tower's dummy weights: N(0, 0.02), zero biases, unit norms."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in module.named_parameters():
        if name.endswith("bias"):
            p.zero_()
        elif "norm" in name:
            p.fill_(1.0)
        else:
            p.copy_(torch.empty(p.shape).normal_(0.0, 0.02, generator=gen))


def draw_device(model: CausalLM) -> torch.device:
    """Where dummy weights are drawn: on a CUDA model's own GPU (one kernel a tensor, instead
    of one CPU thread: about 10 s for Qwen3-0.6B), elsewhere on the CPU. CUDA's generator
    draws other numbers than the CPU's, so a seed gives one model on the CPU (every CPU test's
    figures) and another on CUDA; on CUDA the same one on every GPU of one kind, whichever
    its index (the draw's grid follows the kind's SM count), so every rank of a
    tensor-parallel group draws the same whole tensors, at any size."""
    dev = next(model.parameters()).device
    return dev if dev.type == "cuda" else torch.device("cpu")


def _random_weights(model: CausalLM, seed: int):
    """(our parameter name, weight) in the order and at the shapes of a single process's model,
    drawn in fp32 (rounded to the model's dtype by the copy) on draw_device(model)."""
    whole = model_class(model.config)(model.config, model.dtype, "meta", packed_experts=model.packed_experts)
    dev = draw_device(model)
    gen = torch.Generator(device=dev).manual_seed(seed)
    for name, p in whole.named_parameters():
        if p.dtype == torch.uint8:  # packed MXFP4 experts: every code, scale 2^-8 (|w| <= 0.023)
            yield name, (torch.full(p.shape, 119, dtype=torch.uint8, device=dev) if name.endswith("_scales") else
                         torch.randint(0, 256, p.shape, generator=gen, dtype=torch.uint8, device=dev))
        elif name.endswith("bias"):
            yield name, torch.zeros(p.shape, device=dev)
        elif "norm" in name:
            yield name, torch.ones(p.shape, device=dev)
        else:
            yield name, torch.empty(p.shape, device=dev).normal_(0.0, 0.02, generator=gen)


def _as_checkpoint(model: CausalLM, weights):
    """Our merged weights as the HF checkpoint names them (what load_weights takes)."""
    c = model.config
    for name, w in weights:
        prefix, _, kind = name.rpartition(".")
        parent, _, module = prefix.rpartition(".")
        hf = "model." + parent + "."
        if module == "qkv_proj":
            for part, t in zip(("q_proj", "k_proj", "v_proj"), w.split([c.q_size, c.kv_size, c.kv_size])):
                yield f"{hf}{part}.{kind}", t
        elif module == "gate_up_proj" and kind in ("weight", "bias") and not parent.endswith("experts"):
            for part, t in zip(("gate_proj", "up_proj"), w.chunk(2)):
                yield f"{hf}{part}.{kind}", t
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")) and c.moe.activation == "clamped_swiglu":
            yield "model." + name, w.transpose(1, 2)  # transformers' gpt-oss [E, in, out]
        else:
            yield (name if name.startswith("lm_head") else "model." + name), w
