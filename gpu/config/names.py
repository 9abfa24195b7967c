"""The names the command line takes for loading and devices, torch-free: pipeline/core/config.py
parses flags with them in processes that never load a model (the supervisor of
--api-server-count / --data-parallel-size, `tailrace cluster`, `tailrace --help`), which so
skip torch's import (~1.5 s and ~300 MB each). gpu/loader/decoder.py and gpu/worker/simulate.py hold the
objects behind the names and check that they agree."""

LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")
# auto: the checkpoint's own format (gpu/quantization/config.py): a GGUF file's quantized linears
# stay packed on a CPU (gpu/quantization/gguf.py) when the kernels are built and the dtype is
# auto; a quantization_config's method (fp8, compressed-tensors, awq, gptq, mxfp4) as it says;
# gguf: packed GGUF (dtype auto or float32), or an error; none: dequantize at load to the
# dtype; fp8 ... mxfp4: the checkpoint must be in that format (vLLM's names)
QUANTIZATIONS = ("auto", "gguf", "none", "fp8", "compressed-tensors", "awq", "gptq", "mxfp4")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")   # --kv-cache-dtype (gpu/layers/attention.py KVCache.dtype_for)
DTYPE_NAMES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32",
                 "bf16": "bfloat16"}
SIMULATED_GPUS = ("h200",)          # gpu/worker/simulate.py GPUS' keys (--simulate-gpu)
FAULT_KINDS = ("error", "fatal")    # --fault-steps STEP:KIND (stages/gpu_step.py)
