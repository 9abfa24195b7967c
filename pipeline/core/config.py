"""One frozen configuration object, validated at construction.

Field names follow vLLM's flags (``--max-num-seqs`` -> ``max_num_seqs``).
"""
from __future__ import annotations

import argparse
import json
import os

import attrs

from gpu.config.names import (DTYPE_ALIASES, DTYPE_NAMES, FAULT_KINDS, KV_CACHE_DTYPES, LOAD_FORMATS,
                              QUANTIZATIONS, SIMULATED_GPUS)
from gpu.config.overrides import check_hf_overrides
from gpu.config.pooling import CONVERTS, RUNNERS, PoolerConfig, detect_runner, parse_pooler_config
from stages.kv_transfer import ABORT_TIMEOUT_ENV, KVTransferConfig
from stages.schedule.drafter import MODEL_METHODS, SpeculativeConfig
from stages.schedule.priority import POLICIES
from stages.parse import REASONING_PARSERS
from pipeline.core.lora_config import LORA_DTYPES, add_lora_arguments, check_lora, lora_modules
from pipeline.core.validators import positive
from stages.api.tool_parsers import TOOL_PARSERS, load_plugin

# Each option list is defined once (where it is used) and shared by the validators
# below and the argparse choices.
DTYPE_CHOICES = ("auto", *DTYPE_NAMES)


FAULT_STEPS_ENV = "TAILRACE_FAULT_STEPS"


def parse_fault_steps(text: str) -> dict[int, str]:
    """``"3,7:fatal"`` -> ``{3: "error", 7: "fatal"}``: the GPU steps the fault hook fails
    (stages/gpu_step.py). For tests; empty means none."""
    faults: dict[int, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        step, _, kind = item.partition(":")
        kind = kind or "error"
        if not step.isdigit() or int(step) <= 0 or kind not in FAULT_KINDS:
            raise ValueError(f"fault_steps: {item!r} is not STEP or STEP:{'|'.join(FAULT_KINDS)}")
        faults[int(step)] = kind
    return faults


def _fault_steps(inst, attribute, value):
    parse_fault_steps(value)


def _at_least_one(inst, attribute, value):
    if value < 1:
        raise ValueError(f"--{attribute.name.replace('_', '-')} must be at least 1, got {value}")


def _mm_limits(instance, attribute, value: dict) -> None:
    for k, v in value.items():
        if k not in ("image",):
            raise ValueError(f"--limit-mm-per-prompt: unsupported modality {k!r}; supported: image")
        if type(v) is not int or v < 0:
            raise ValueError(f"--limit-mm-per-prompt: {k} must be a non-negative integer, got {v!r}")


@attrs.frozen
class EngineConfig:
    model: str | None = None                  # .gguf file or HF directory; None: bundled SmolLM2
    served_model_name: tuple[str, ...] = attrs.field(   # empty: the model's own name
        default=(), converter=lambda names: tuple(names or ()))
    load_format: str = attrs.field(default="auto", validator=attrs.validators.in_(LOAD_FORMATS))
    # the weight format (gpu/quantization/config.py): auto = the checkpoint's own (a GGUF file's
    # linears packed on a CPU, or its quantization_config's method); gguf packs or fails; none
    # dequantizes at load; fp8/compressed-tensors/awq/gptq/mxfp4 must match the checkpoint
    quantization: str = attrs.field(default="auto", validator=attrs.validators.in_(QUANTIZATIONS))
    dtype: str = attrs.field(default="auto", converter=lambda d: DTYPE_ALIASES.get(d, d),
                             validator=attrs.validators.in_(DTYPE_CHOICES))
    # the residual stream's (and norms') dtype; auto: float32 on CPU under bf16/fp16 weights
    residual_dtype: str = attrs.field(default="auto", converter=lambda d: DTYPE_ALIASES.get(d, d),
                                      validator=attrs.validators.in_(DTYPE_CHOICES))
    device: str = "auto"                      # auto | cpu | cuda
    seed: int = 0
    max_model_len: int | None = attrs.field(default=None, validator=positive)
    max_num_seqs: int = attrs.field(default=256, validator=positive)
    max_num_batched_tokens: int | None = attrs.field(default=None, validator=positive)
    block_size: int = attrs.field(default=16, validator=positive)
    num_gpu_blocks_override: int | None = attrs.field(default=None, validator=positive)
    kv_cache_memory_bytes: int | None = attrs.field(default=None, validator=positive)
    # auto: the model's dtype; fp8 (fp8_e4m3): e4m3, half of bf16's bytes, a quarter of fp32's (issue 58)
    kv_cache_dtype: str = attrs.field(default="auto", validator=attrs.validators.in_(KV_CACHE_DTYPES))
    gpu_memory_utilization: float = 0.9
    # None: on, except for a hybrid linear-attention model (pipeline/core/kv_layout.py
    # prefix_caching: its cached prefixes cost a state snapshot a sequence, off as in vLLM)
    enable_prefix_caching: bool | None = None
    # hybrid models (gpt-oss): sliding-window layers in a KV pool of their own, sized to their windows
    disable_hybrid_kv_cache_manager: bool = False
    enforce_eager: bool = False
    # ranks one model is split over (issue 25): rank 0 here, workers 1..N-1 (pipeline/layouts/tp_procs.py)
    tensor_parallel_size: int = attrs.field(default=1, validator=_at_least_one)
    # plan step N+1 while step N runs (as vLLM); None: on unless speculative decoding is,
    # resolved at construction (the combination rule, __attrs_post_init__): never None after
    async_scheduling: bool | None = None
    stream_interval: int = attrs.field(default=1, validator=positive)  # tokens per stream write
    # admission: at most max_num_seqs + max_queued_requests requests admitted at once
    max_queued_requests: int = attrs.field(default=1024, validator=positive)
    # fcfs, or priority: a request's `priority` orders it (lower first), preempting (issue 37)
    scheduling_policy: str = attrs.field(default="fcfs", validator=attrs.validators.in_(POLICIES))
    # POST /sleep, /wake_up, GET /is_sleeping: the runner lets go of its memory (gpu/worker/sleep.py)
    enable_sleep_mode: bool = False
    reasoning_parser: str | None = attrs.field(   # None or one of REASONING_PARSERS (<think> tags)
        default=None, validator=attrs.validators.optional(attrs.validators.in_(REASONING_PARSERS)))
    enable_auto_tool_choice: bool = False      # tool_choice "auto" (needs tool_call_parser)
    tool_call_parser: str | None = None        # one of TOOL_PARSERS (plugins included)
    tool_parser_plugin: str | None = None      # a Python file registering more parsers
    exclude_tools_when_tool_choice_none: bool = False
    event_log: str | None = None              # path for JSON-lines events
    event_log_max_bytes: int = attrs.field(default=0, validator=attrs.validators.ge(0))  # 0: no rotation
    event_log_backup_count: int = attrs.field(default=5, validator=attrs.validators.ge(0))
    chat_template: str | None = None          # Jinja source, or a file holding it
    generation_config: str = "auto"           # auto: the model's; vllm: none; or a folder
    override_generation_config: dict = attrs.field(factory=dict)   # wins over the above
    enable_force_include_usage: bool = False  # every stream: usage chunk + continuous usage
    enable_per_request_metrics: bool = False  # replies carry the request's own timings
    # usage.prompt_tokens_details (cached_tokens, multimodal_tokens) on chat/completions replies
    enable_prompt_tokens_details: bool = False
    # alternatives a token's logprobs may ask for (top_logprobs, logprobs, prompt_logprobs);
    # -1: the whole vocabulary (vLLM's --max-logprobs)
    max_logprobs: int = attrs.field(default=20, validator=attrs.validators.ge(-1))
    # pictures (issue 34, vLLM's flags): where they may be fetched from, how many a prompt
    # takes, and the fetch's bounds (stages/media/fetch.py)
    allowed_media_domains: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    allowed_local_media_path: str | None = None
    limit_mm_per_prompt: dict = attrs.field(factory=dict, validator=_mm_limits)
    media_fetch_timeout: float = attrs.field(default=5.0, validator=attrs.validators.gt(0))
    max_media_bytes: int = attrs.field(default=20 * 1024 * 1024, validator=positive)
    media_max_redirects: int = attrs.field(default=5, validator=attrs.validators.ge(0))
    encoder_cache_size: int = attrs.field(default=64, validator=positive)
    tokenizer: str | None = None              # .gguf file or HF directory; None: the model's
    # auto: the model's tokenizer.json (or GGUF); mistral: its tekken.json or SentencePiece
    # tokenizer.model[.vN] through mistral-common, chats rendered by mistral-common (gpu/tokenizers/mistral.py)
    tokenizer_mode: str = attrs.field(default="auto",
                                      validator=attrs.validators.in_(("auto", "mistral")))
    simulate_gpu: str | None = attrs.field(   # None or one of gpu.worker.simulate.GPUS (gpu.config.names.SIMULATED_GPUS): a timed stand-in
        default=None, validator=attrs.validators.optional(attrs.validators.in_(SIMULATED_GPUS)))
    skip_tokenizer_init: bool = False         # serve token ids only, without a tokenizer
    fault_steps: str = attrs.field(default="", validator=_fault_steps)   # tests only: "3,7:fatal"
    # speculative decoding (n-gram prompt lookup); None: off. The flag's JSON or a dict.
    speculative_config: SpeculativeConfig | None = attrs.field(
        default=None, converter=SpeculativeConfig.parse)
    # the KV connector (issue 36): disaggregated prefill over NIXL; None: off
    kv_transfer_config: KVTransferConfig | None = attrs.field(
        default=None, converter=KVTransferConfig.parse)
    # the stand-in's chance that each draft holds (needs simulate_gpu and speculative_config)
    simulate_draft_acceptance: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(
            [attrs.validators.ge(0.0), attrs.validators.le(1.0)]))
    # pooling models (issue 32), vLLM's flags: which runner serves the model (auto: pooling for
    # an encoder, a classifier or a sentence-transformers folder, or with --convert), a
    # decoder converted to one, and the pooler's settings over the checkpoint's
    runner: str = attrs.field(default="auto", validator=attrs.validators.in_(RUNNERS))
    convert: str = attrs.field(default="auto", validator=attrs.validators.in_(CONVERTS))
    pooler_config: PoolerConfig = attrs.field(
        default=PoolerConfig(), converter=lambda v: v if isinstance(v, PoolerConfig) else parse_pooler_config(
            v if v is None or isinstance(v, str) else json.dumps(v)))
    # --hf-overrides (vLLM's): a JSON object laid over config.json before the family reads it
    hf_overrides: dict = attrs.field(factory=dict, converter=check_hf_overrides)
    # LoRA adapters (issue 33, pipeline/core/lora_config.py): vLLM's flags
    enable_lora: bool = False
    lora_modules: tuple = attrs.field(default=(), converter=lora_modules)   # LoRAModule values
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None          # None: max_loras
    lora_dtype: str = attrs.field(default="auto", validator=attrs.validators.in_(LORA_DTYPES))

    @property
    def pooling(self) -> bool:
        """Served by the pooling runner (gpu/worker/pooling_runner.py): embeddings, scores, classes."""
        if self.runner != "auto":
            return self.runner == "pooling"
        return (self.convert in ("embed", "classify")
                or detect_runner(self.model, self.hf_overrides) == "pooling")

    def __attrs_post_init__(self) -> None:
        if self.runner == "generate" and self.convert in ("embed", "classify"):
            raise ValueError(f"--convert {self.convert} makes a pooling model: it needs --runner pooling "
                             "(or auto)")
        if self.pooling:
            for flag, on in (("--speculative-config", self.speculative_config is not None),
                             ("--tensor-parallel-size", self.tensor_parallel_size > 1),
                             ("--simulate-gpu", self.simulate_gpu is not None)):
                if on:
                    raise ValueError(f"{flag} does not combine with a pooling model (--runner pooling)")
        # A --tool-parser-plugin's names count once it is loaded (engine_config loads it).
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser!r} is not one of "
                             f"{', '.join(sorted(TOOL_PARSERS))}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.enable_sleep_mode and (self.tensor_parallel_size > 1 or self.pooling):
            raise ValueError("--enable-sleep-mode does not combine with --tensor-parallel-size "
                             "or a pooling model (the worker ranks and the pooling runner "
                             "cannot sleep yet)")
        if self.tensor_parallel_size > 1 and self.simulate_gpu is not None:
            raise ValueError("--tensor-parallel-size does not combine with --simulate-gpu (the "
                             "stand-in runs no model to split)")
        # Drafts need each sequence's last token, which an async plan does not know yet: the
        # AsyncScheduler plans a sequence with a step in flight as a floating chunk, which
        # the runner fills (stages/schedule/async_.py): the n-gram lookup, or the draft
        # model's or EAGLE head's DRAFTs, once the step before has run. On by default for
        # n-gram lookup; with a draft model or a head on request (--async-scheduling).
        spec = self.speculative_config
        check_lora(self)
        if (spec is not None and spec.method in MODEL_METHODS and self.tensor_parallel_size > 1):
            raise ValueError(f'--speculative-config: method "{spec.method}" does not combine with '
                             "--tensor-parallel-size (the draft runs on rank 0 alone)")
        if self.kv_transfer_config is not None:
            for flag, on in (("--speculative-config", self.speculative_config is not None),
                             ("--simulate-gpu", self.simulate_gpu is not None),
                             ("a pooling model (--runner pooling)", self.pooling)):
                if on:
                    raise ValueError(f"--kv-transfer-config does not combine with {flag} yet "
                                     "(it moves the target model's KV cache: a draft "
                                     "model's is not moved, and the stand-in and a pooling "
                                     "model have none)")
        if self.async_scheduling is None:
            # on with every method: a draft model's and an EAGLE head's floating chunks
            # overlap the host's work too (docs/benchmarks.md, issue 35)
            object.__setattr__(self, "async_scheduling", True)
        if self.simulate_draft_acceptance is not None and (
                self.simulate_gpu is None or self.speculative_config is None):
            raise ValueError("--simulate-draft-acceptance needs --simulate-gpu and "
                             "--speculative-config")

    @property
    def fault_step_kinds(self) -> dict[int, str]:
        return parse_fault_steps(self.fault_steps)


# -- command-line flags ---------------------------------------------------------------------
_SIZE_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
                  "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def byte_size(text: str) -> int:
    """An int with an optional size suffix: 4000000000, 4G (10**9), 4GiB (2**30)."""
    s = text.strip().lower().removesuffix("b")
    for suffix in sorted(_SIZE_SUFFIXES, key=len, reverse=True):
        if s.endswith(suffix):
            number = s[: -len(suffix)]
            try:
                return int(float(number) * _SIZE_SUFFIXES[suffix])
            except ValueError:
                break
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r}") from None


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _default(name: str):
    return getattr(attrs.fields(EngineConfig), name).default


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that configure the engine, named as vLLM names them (serve and bench share them)."""
    p.add_argument("model", nargs="?", default=None,
                   help="GGUF file or Hugging Face model directory "
                        "(default: the bundled SmolLM2-135M-Instruct).")
    p.add_argument("--model", dest="model_option", default=None, metavar="MODEL",
                   help="The same as the positional MODEL (vLLM's --model).")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="Model name(s) the API accepts and reports; the first is echoed back "
                        "(default: the model's own name).")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="Context length: prompt plus completion tokens "
                        "(default: the model's max_position_embeddings).")
    p.add_argument("--max-num-seqs", type=int, default=_default("max_num_seqs"),
                   help="Most sequences in one engine step (default: %(default)s).")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="Most tokens in one engine step (default: max(2048, --max-num-seqs)).")
    p.add_argument("--dtype", default=_default("dtype"),
                   choices=(*DTYPE_CHOICES, *DTYPE_ALIASES),
                   help="Weight and activation dtype; auto: bfloat16 on CUDA, and on a CPU "
                        "with native bf16 (AVX512_BF16 or AMX), else float32 "
                        "(default: %(default)s).")
    p.add_argument("--residual-dtype", default=_default("residual_dtype"),
                   choices=(*DTYPE_CHOICES, *DTYPE_ALIASES),
                   help="dtype of the residual stream and norms; auto: float32 on a CPU under "
                        "bfloat16/float16 weights (the GEMMs stay in the weights' dtype: "
                        "docs/benchmarks.md, CPU precision recipe), else the weights' dtype "
                        "(default: %(default)s).")
    p.add_argument("--seed", type=int, default=_default("seed"),
                   help="Random seed for sampling (default: %(default)s).")
    p.add_argument("--device", default=_default("device"),
                   help="auto, cpu or cuda[:N] (default: %(default)s: cuda when available).")
    p.add_argument("--load-format", default=_default("load_format"),
                   choices=LOAD_FORMATS,
                   help="Weight format; dummy: random weights of the model's shape "
                        "(default: %(default)s).")
    p.add_argument("--quantization", "-q", default=_default("quantization"), choices=QUANTIZATIONS,
                   help="The weight format. auto: the checkpoint's own: a GGUF file's quantized "
                        "blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) kept packed on a CPU with --dtype "
                        "auto (computing in float32), or config.json's quantization_config (fp8, "
                        "compressed-tensors, awq, gptq, mxfp4: run by the Triton GEMMs on CUDA and the "
                        "packed C kernels on a CPU where they can be, else dequantized at load to --dtype); gguf: packed GGUF or an error; none: dequantize at "
                        "load; fp8, compressed-tensors, awq, gptq, mxfp4: the checkpoint must be "
                        "in that format (default: %(default)s).")
    p.add_argument("--block-size", type=int, default=_default("block_size"),
                   help="Tokens per KV cache block (default: %(default)s).")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="Use exactly this many KV cache blocks, ignoring memory sizing.")
    p.add_argument("--kv-cache-dtype", default=_default("kv_cache_dtype"), choices=KV_CACHE_DTYPES,
                   help="KV cache dtype: auto (the model's) or fp8 (e4m3, with the checkpoint's per-layer "
                        "k/v scales or 1.0; CPU, and CUDA from compute capability 8.9): fewer bytes a "
                        "token, so more tokens in the same memory (default: %(default)s).")
    p.add_argument("--kv-cache-memory-bytes", type=byte_size, default=None, metavar="BYTES",
                   help="KV cache size in bytes, e.g. 2GiB or 2000000000 (default on CPU: "
                        "1 GiB or what --max-num-seqs full-length sequences need).")
    p.add_argument("--gpu-memory-utilization", type=float,
                   default=_default("gpu_memory_utilization"),
                   help="Fraction of GPU memory the server may use, KV cache included "
                        "(default: %(default)s).")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=_default("enable_prefix_caching"),
                   help="Reuse the KV blocks of shared prompt prefixes (default: on, off for a "
                        "hybrid linear-attention model such as Qwen3-Next or Qwen3.5, whose "
                        "cached prefixes need a state snapshot a sequence: as vLLM).")
    p.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   default=_default("disable_hybrid_kv_cache_manager"),
                   help="Keep sliding-window layers' K/V for every position, in the full layers' "
                        "blocks, instead of a smaller pool that frees what the window has passed.")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   default=_default("async_scheduling"),
                   help="Plan the next engine step while the current one runs, so the GPU "
                        "never waits for the host between steps (default: on). With speculation a "
                        "step with drafts is planned ahead too: the runner fills its "
                        "drafts once the step before has run.")
    p.add_argument("--stream-interval", type=int, default=_default("stream_interval"),
                   help="Write a streaming reply to its client every N tokens (the first at "
                        "once, the rest with the reply's end), which cuts the host cost of "
                        "many streams; every SSE event is kept (default: %(default)s).")
    p.add_argument("--tensor-parallel-size", "-tp", type=int,
                   default=_default("tensor_parallel_size"), metavar="N",
                   help="Split the model over N ranks (tensor parallelism): this process is "
                        "rank 0, and starts N-1 worker processes, one per GPU (cuda:1..N-1) or "
                        "on the CPU; MASTER_ADDR/MASTER_PORT and LOCAL_WORLD_SIZE spread them "
                        "over several hosts (docs/scaling.md) (default: %(default)s).")
    p.add_argument("--enforce-eager", action="store_true",
                   help="Never capture CUDA graphs; run every step eagerly.")
    p.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="Split <think>...</think> into the reply's reasoning (qwen3, deepseek_r1, "
                        "glm45, kimi_k2, deepseek_v3, minimax_m2; minimax_m2_append_think "
                        "keeps it in the content), or "
                        "read Harmony's channels (openai_gptoss, implied for gpt-oss) "
                        "(default: off).")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="Serve tool_choice \"auto\": the --tool-call-parser finds the calls "
                        "in what the model writes.")
    p.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help=f"How the model writes tool calls: {', '.join(sorted(TOOL_PARSERS))}, "
                        "or a name from --tool-parser-plugin (default: none).")
    p.add_argument("--tool-parser-plugin", default=None, metavar="PATH",
                   help="A Python file whose @register_tool_parser classes add parser names.")
    p.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="With tool_choice \"none\", leave the tools out of the prompt.")
    p.add_argument("--event-log", default=None, metavar="PATH",
                   help="Write every stage's events as JSON lines to PATH, for `tailrace "
                        "replay` (docs/events.md). Credentials are never written.")
    p.add_argument("--event-log-max-bytes", type=byte_size, default=_default("event_log_max_bytes"),
                   metavar="BYTES",
                   help="Rotate the event log when it would pass BYTES (e.g. 100MiB): PATH "
                        "becomes PATH.1 (older files shift to PATH.2 ...). 0: never (default).")
    p.add_argument("--event-log-backup-count", type=int,
                   default=_default("event_log_backup_count"), metavar="N",
                   help="Rotated event-log files to keep, PATH.1 ... PATH.N; older ones are "
                        "deleted (default: %(default)s).")
    p.add_argument("--chat-template", default=None, metavar="PATH_OR_STRING",
                   help="A chat template (a file, or the Jinja source itself) replacing the "
                        "model's; a request's own chat_template still wins.")
    p.add_argument("--generation-config", default=_default("generation_config"),
                   metavar="auto|vllm|FOLDER",
                   help="Sampling defaults: auto, the model's generation_config.json; vllm, "
                        "none (the server's own defaults); or a folder holding a "
                        "generation_config.json (default: %(default)s).")
    p.add_argument("--override-generation-config", type=_json_object, default={},
                   metavar="JSON",
                   help="JSON object of generation-config values that win over "
                        "--generation-config's, e.g. '{\"temperature\": 0.5}'. Its "
                        "max_new_tokens is a ceiling on every request's max tokens.")
    p.add_argument("--enable-force-include-usage", action="store_true",
                   help="Every stream reports usage: on each chunk (usage so far) and in a "
                        "final usage chunk, whatever its stream_options say.")
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="Start without a tokenizer: prompts are token ids (completions, or "
                        "chat's kv_transfer_params.prompt_token_ids) and replies carry token "
                        "ids, no text.")
    p.add_argument("--enable-per-request-metrics", action="store_true",
                   help="Each reply carries a `metrics` object with the request's own timings "
                        "(on the body, or on the usage chunk of a stream; not when n > 1).")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="Tokenizer to use instead of the model's: a .gguf file or a Hugging "
                        "Face directory with tokenizer.json.")
    p.add_argument("--tokenizer-mode", default="auto", choices=("auto", "mistral"),
                   help="auto: the model's tokenizer.json (or its GGUF's); mistral: a Mistral "
                        "model's tekken.json, else its SentencePiece tokenizer.model.vN "
                        "or tokenizer.model (in the model folder, or the file --tokenizer "
                        "names) through mistral-common, whose request encoding renders chats "
                        "(no chat template), as vLLM's --tokenizer-mode mistral.")
    p.add_argument("--simulate-gpu", default=None, choices=SIMULATED_GPUS,
                   help="Replace the model's forward with a timed wait from a cost model of "
                        "this GPU running the model in bf16, and sample random ordinary tokens; "
                        "everything else runs for real (docs/benchmarks.md).")
    p.add_argument("--max-queued-requests", "--max-waiting", type=int,
                   default=_default("max_queued_requests"), metavar="N",
                   help="Requests admitted beyond the --max-num-seqs that run; more get a 503 "
                        "with Retry-After before their reply starts (default: %(default)s). "
                        "--max-waiting is an alias.")
    p.add_argument("--scheduling-policy", default=_default("scheduling_policy"), choices=POLICIES,
                   help="fcfs: requests run in arrival order; priority: by each request's "
                        "`priority` (lower first, ties by arrival), and a waiting request "
                        "short of KV blocks preempts a running one of lower priority "
                        "(default: %(default)s).")
    p.add_argument("--enable-sleep-mode", action="store_true",
                   help="Serve POST /sleep?level=1|2, POST /wake_up and GET /is_sleeping: "
                        "level 1 drops the KV cache and keeps the weights in host memory, "
                        "level 2 drops both (waking reloads the weights from the checkpoint); "
                        "requests while asleep get 503 (docs/api.md).")
    p.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   help='The KV connector for disaggregated prefill (vLLM\'s flag), e.g. '
                        '\'{"kv_connector": "NixlConnector", "kv_role": "kv_both", '
                        '"kv_buffer_device": "cpu"}\': requests with kv_transfer_params '
                        'do_remote_decode hold their prompt blocks for a decode instance, those '
                        'with do_remote_prefill read them over NIXL (docs/scaling.md). The '
                        'side channel listens on VLLM_NIXL_SIDE_CHANNEL_HOST:'
                        'VLLM_NIXL_SIDE_CHANNEL_PORT (default 127.0.0.1:5600); held blocks are '
                        f'freed after {ABORT_TIMEOUT_ENV} seconds (default 480) if never read.')
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="Speculative decoding, as vLLM spells it: '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": K, \"prompt_lookup_min\": A, "
                        "\"prompt_lookup_max\": B}' drafts up to K tokens by prompt lookup and "
                        "verifies them in one forward pass; outputs are unchanged. Turns async "
                        "scheduling off (docs/cli.md) (default: off).")
    p.add_argument("--simulate-draft-acceptance", type=float, default=None, metavar="P",
                   help="With --simulate-gpu and --speculative-config: every decode verifies "
                        "K drafts, each accepted with probability P while the ones before it "
                        "were (the stand-in's tokens are random, so lookup alone finds few).")
    # Test-only: the GPU steps to fail (stages/gpu_step.py), e.g. "3,7:fatal".
    p.add_argument("--runner", default=_default("runner"), choices=RUNNERS,
                   help="generate or pooling (embeddings, scores, classes); auto: pooling for an "
                        "encoder, a classifier or a sentence-transformers folder, or with --convert")
    p.add_argument("--convert", default=_default("convert"), choices=CONVERTS,
                   help="serve a decoder as an embedding model (embed: last-token pooling) or a "
                        "classifier (classify); implies --runner pooling")
    p.add_argument("--hf-overrides", default={}, metavar="JSON",
                   help="JSON object laid over the model's config.json before it is read "
                        "(nested objects key by key), as vLLM's: e.g. '{\"is_matryoshka\": "
                        "true}' or '{\"matryoshka_dimensions\": [64, 32]}' to serve "
                        "`dimensions` on a pooling model")
    p.add_argument("--pooler-config", default=None, metavar="JSON",
                   help='the pooler, over the checkpoint\'s: {"pooling_type": "MEAN|CLS|LAST", '
                        '"normalize": bool, "dimensions": int, "use_activation": bool}')
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="Chat and completions usage carries prompt_tokens_details: "
                        "cached_tokens, and multimodal_tokens ({\"image\": N}) when the prompt "
                        "had pictures. Off: the key is absent, as in vLLM.")
    p.add_argument("--max-logprobs", type=int, default=_default("max_logprobs"), metavar="N",
                   help="Most logprob alternatives a request may ask per token (top_logprobs, "
                        "logprobs, prompt_logprobs); -1: the whole vocabulary, which a request "
                        "asks with -1 (default: %(default)s, as vLLM).")
    p.add_argument("--allowed-media-domains", nargs="+", default=[], metavar="HOST",
                   help="Fetch http(s) images only from these hosts (redirects included); "
                        "default: any host.")
    p.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="Allow file:// image URLs beneath DIR (default: file:// is refused).")
    p.add_argument("--limit-mm-per-prompt", type=_json_object, default={}, metavar="JSON",
                   help="At most this many items per modality in one prompt, e.g. "
                        "'{\"image\": 2}' (default: 999 images).")
    p.add_argument("--media-fetch-timeout", type=float, default=_default("media_fetch_timeout"),
                   metavar="SECONDS",
                   help="The whole fetch of one image URL, however slowly its server sends "
                        "(vLLM's VLLM_IMAGE_FETCH_TIMEOUT; default: %(default)s).")
    p.add_argument("--max-media-bytes", type=byte_size, default=_default("max_media_bytes"),
                   metavar="BYTES", help="The largest image (fetched, data: or file://) "
                                         "accepted (default: 20MiB).")
    p.add_argument("--media-max-redirects", type=int, default=_default("media_max_redirects"),
                   metavar="N", help="Redirects an image fetch follows (default: %(default)s).")
    p.add_argument("--encoder-cache-size", type=int, default=_default("encoder_cache_size"),
                   metavar="N", help="Pictures whose vision-encoder output the runner keeps "
                                     "(by content hash; default: %(default)s).")
    add_lora_arguments(p)
    p.add_argument("--fault-steps", default=os.environ.get(FAULT_STEPS_ENV, ""),
                   help=argparse.SUPPRESS)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """Every EngineConfig field from the flag of the same name (add_engine_arguments), once
    --tool-parser-plugin's file has registered its parsers (the config, a value, runs no
    code). Raises ValueError (or TypeError) for a bad combination of flags."""
    if args.tool_parser_plugin:
        load_plugin(args.tool_parser_plugin)
    option = getattr(args, "model_option", None)
    if option is not None:
        if args.model is not None and args.model != option:
            raise ValueError(f"two models: {args.model!r} and --model {option!r}; give one")
        args.model = option
    return EngineConfig(**{f.name: getattr(args, f.name) for f in attrs.fields(EngineConfig)})
