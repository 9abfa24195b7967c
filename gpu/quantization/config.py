"""Which quantization method loads a checkpoint: `--quantization` (vLLM's names) checked
against config.json's quantization_config, or inferred from it as vLLM does.

  auto / none   the checkpoint's own format: its quantization_config's quant_method, MXFP4
                experts by their tensor names, a GGUF file's blocks (auto: packed on a CPU,
                none: dequantized), else dense (Unquantized);
  gguf          a GGUF file's linears kept packed on a CPU, or an error saying why not;
  fp8, compressed-tensors, awq, gptq, mxfp4
                the checkpoint must say the same in its quantization_config (a mismatch, or
                no quantization_config, is a start-up error).
"""

from __future__ import annotations

from gpu.config.names import QUANTIZATIONS
from gpu.quantization.base import LinearFormat, QuantMethod, Unquantized

# the formats a quantization_config can name -> the module and class that serve it
CHECKPOINT_METHODS = {
    "fp8": ("gpu.quantization.fp8", "FP8"),
    "compressed-tensors": ("gpu.quantization.compressed_tensors", "CompressedTensors"),
    "awq": ("gpu.quantization.awq", "AWQ"),
    "gptq": ("gpu.quantization.gptq", "GPTQ"),
    "mxfp4": ("gpu.quantization.base", "MXFP4"),
}
assert set(CHECKPOINT_METHODS) < set(QUANTIZATIONS)


def checkpoint_format(quantization_config: dict | None) -> str | None:
    """config.json's quantization_config -> the method's name (vLLM's spelling), or None."""
    if not quantization_config:
        return None
    name = str(quantization_config.get("quant_method", "")).lower().replace("_", "-")
    if name in CHECKPOINT_METHODS:
        return name
    raise ValueError(f"config.json's quantization_config has quant_method {name or None!r}, which is not "
                     f"served; served: {', '.join(CHECKPOINT_METHODS)} and GGUF files")


def select_method(quantization: str, source, *, load_format: str, dtype, device, tp) -> QuantMethod:
    """The method that loads `source` (gpu/loader/decoder.py's Source); ValueError when
    --quantization and the checkpoint disagree."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unsupported quantization {quantization!r}; choose from {', '.join(QUANTIZATIONS)}")
    if source.gguf is not None or quantization == "gguf":
        if quantization in CHECKPOINT_METHODS:
            raise ValueError(f"--quantization {quantization}: the model is a GGUF file (its own blocks; "
                             "--quantization auto, gguf or none)")
        from gpu.quantization.gguf import GGUF
        return GGUF.choose(quantization, source, load_format, dtype, device, tp)
    if load_format == "dummy":
        return Unquantized()
    found = checkpoint_format(source.quantization_config)
    if found is None and source.mxfp4_experts:
        found = "mxfp4"
    if quantization in CHECKPOINT_METHODS and found != quantization:
        says = (f"config.json's quantization_config says {found!r}" if source.quantization_config
                else "the checkpoint is not quantized (config.json has no quantization_config; online "
                     "quantization of a dense checkpoint is not served)")
        raise ValueError(f"--quantization {quantization}, but {says}")
    if found is None:
        method: QuantMethod = Unquantized()
    else:
        import importlib

        module, cls = CHECKPOINT_METHODS[found]
        method = getattr(importlib.import_module(module), cls)(source.quantization_config or {})
        if isinstance(method, LinearFormat):
            method.use_packed_kernels(dtype, device, tp, quantization)
    method.plan(source.tensor_names)
    return method


def stand_in_format(quantization_config: dict | None) -> str:
    """The cost of a checkpoint's decoder linears for the GPU stand-in (gpu/worker/simulate.py
    WEIGHT_BYTES): bf16, fp8, w4a16, w8a16 or w8a8, as the CUDA GEMMs read them."""
    name = checkpoint_format(quantization_config)
    qc = quantization_config or {}
    if name == "fp8":
        return "fp8"
    if name == "awq":
        return "w4a16"
    if name == "gptq":
        return {4: "w4a16", 8: "w8a16"}.get(int(qc.get("bits", 4)), "bf16")
    if name == "compressed-tensors":
        group = next(iter((qc.get("config_groups") or {}).values()), {})
        w, acts = group.get("weights") or {}, group.get("input_activations")
        if w.get("type") == "float":
            return "fp8"
        bits = int(w.get("num_bits", 8))
        return "w8a8" if bits == 8 and acts else {4: "w4a16", 8: "w8a16"}.get(bits, "bf16")
    return "bf16"
