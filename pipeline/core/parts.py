"""The typed parts start-up makes (pipeline/core/startup.py for a generating model,
pipeline/core/pooling.py for a pooling one) and what both read of the flags."""
from __future__ import annotations

from typing import Any

import attrs
import torch

from gpu.config.pooling import PoolingSpec
from gpu.loader.decoder import LoadedModel
from gpu.parallel import TP
from gpu.tokenizers.harmony import uses_harmony
from gpu.worker.runner import ModelRunner
from gpu.worker.simulate import SimulatedRunner
from pipeline.core.config import EngineConfig
from stages.api.common import ToolSettings
from stages.api.harmony import HARMONY_REASONING_PARSER, HARMONY_TOOL_PARSER
from stages.schedule import Scheduler
from stages.schedule.blocks import BlockManager


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but torch sees no CUDA device")
    return torch.device(name)


@attrs.frozen
class Parsers:
    """The reasoning and tool parsers a model is served with: the flags', or Harmony's."""
    reasoning_parser: str | None
    tools: ToolSettings
    harmony: bool = False

    @classmethod
    def of(cls, cfg: EngineConfig, model_config) -> Parsers:
        """gpt-oss (model_type gpt_oss) speaks only Harmony: --reasoning-parser
        openai_gptoss and --tool-call-parser openai (with auto tool choice) are implied, and
        tool_choice "none" leaves the tools out of the prompt. Those two parsers read
        Harmony tokens, so they serve no other model."""
        if not uses_harmony(model_config):
            if cfg.reasoning_parser == HARMONY_REASONING_PARSER:
                raise ValueError(f"--reasoning-parser {HARMONY_REASONING_PARSER} needs a gpt-oss "
                                 "model (Harmony format)")
            if cfg.tool_call_parser == HARMONY_TOOL_PARSER:
                raise ValueError(f"--tool-call-parser {HARMONY_TOOL_PARSER} needs a gpt-oss "
                                 "model (Harmony format)")
            return cls(cfg.reasoning_parser, ToolSettings(
                cfg.enable_auto_tool_choice, cfg.tool_call_parser,
                cfg.exclude_tools_when_tool_choice_none))
        if cfg.reasoning_parser not in (None, HARMONY_REASONING_PARSER):
            raise ValueError(f"--reasoning-parser {cfg.reasoning_parser}: gpt-oss models speak "
                             f"Harmony; use {HARMONY_REASONING_PARSER} (implied) or leave it out")
        if cfg.tool_call_parser not in (None, HARMONY_TOOL_PARSER):
            raise ValueError(f"--tool-call-parser {cfg.tool_call_parser}: gpt-oss models speak "
                             f"Harmony; use {HARMONY_TOOL_PARSER} (implied) or leave it out")
        return cls(HARMONY_REASONING_PARSER, ToolSettings(True, HARMONY_TOOL_PARSER, True),
                   harmony=True)


@attrs.frozen
class Built:
    """What the synchronous part of start-up makes (in a worker thread)."""

    loaded: LoadedModel
    model_names: tuple[str, ...]
    max_model_len: int
    runner: ModelRunner | SimulatedRunner
    blocks: BlockManager
    scheduler: Scheduler
    parsers: Parsers
    pooling: PoolingSpec | None = None   # a pooling model's behaviour (pipeline/core/pooling.py)
    sleeper: object | None = None        # --enable-sleep-mode: gpu/worker/sleep.py's Sleeper
    loras: Any = None    # --enable-lora: the served adapters (gpu.lora.spec.LoRARegistry)
    kv_connector: Any = None   # --kv-transfer-config: gpu/kv_transfer/connector.py's KVConnector


@attrs.frozen
class RunnerParts:
    """What pipeline/core/startup.py build_runner makes, on every rank."""
    runner: ModelRunner
    cache: Any                  # gpu.layers.attention.KVCache
    num_blocks: int             # full-layer KV blocks
    kv_connector: Any = None    # --kv-transfer-config: this rank's KVConnector
    draft_cost: float | None = None     # a draft model's multiply-adds a token over the target's


@attrs.frozen
class Ranks:
    """This process's place among the tensor-parallel ranks (issue 25)."""
    tp: TP
    plan: Any        # the gloo group each step's inputs are broadcast over (gpu/worker/tp.py)


def step_budget(cfg: EngineConfig) -> int:
    """Tokens one engine step may schedule."""
    return cfg.max_num_batched_tokens or max(2048, cfg.max_num_seqs)
