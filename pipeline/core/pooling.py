"""Start-up of a pooling server (--runner pooling, issue 32): the pooling model
(gpu/loader/pooling.py), its runner (no KV cache), and the PoolingScheduler.

The block manager is a stand-in that holds no memory: it is sized to the step's token
budget so that admission's capacity rule (a request's longest sequence must fit) reads
as "fits one step", which a pooling sequence must, being never split. The budget is at
least the model's length."""
from __future__ import annotations

import logging
import time

import attrs
import torch

from pipeline.core.config import EngineConfig
from pipeline.core.parts import Built, Parsers, step_budget
from stages.api.common import ToolSettings
from stages.schedule.blocks import BlockManager
from stages.schedule.pooling import PoolingScheduler

log = logging.getLogger("tailrace")


def pooling_budget(cfg: EngineConfig, max_model_len: int) -> int:
    """Tokens one step may take: --max-num-batched-tokens, raised to the model's length."""
    return max(step_budget(cfg), max_model_len)


def build_pooling(cfg: EngineConfig, device: torch.device) -> Built:
    from gpu.loader.decoder import choose_dtype, cpu_threads
    from gpu.loader.pooling import load_pooling_model
    from gpu.worker.pooling_runner import PoolingRunner
    from gpu.tokenizers.files import load_tokenizer

    t0 = time.perf_counter()
    dtype, why = choose_dtype(cfg.dtype, device)
    log.info("dtype %s (%s)%s", str(dtype).removeprefix("torch."), why,
             f"; {cpu_threads()}" if device.type == "cpu" else "")
    loaded = load_pooling_model(cfg.model, convert=cfg.convert, pooler_config=cfg.pooler_config,
                                load_format=cfg.load_format, dtype=dtype, device=str(device), seed=cfg.seed,
                                hf_overrides=cfg.hf_overrides)
    if cfg.tokenizer:
        loaded = attrs.evolve(loaded, tokenizer=load_tokenizer(cfg.tokenizer))
    if cfg.skip_tokenizer_init:
        loaded = attrs.evolve(loaded, tokenizer=None)
    max_model_len = loaded.max_model_len
    if cfg.max_model_len is not None:
        if cfg.max_model_len > loaded.max_model_len:
            log.warning("--max-model-len %d exceeds the pooling model's length %d: %d it is",
                        cfg.max_model_len, loaded.max_model_len, loaded.max_model_len)
        max_model_len = min(cfg.max_model_len, loaded.max_model_len)
    budget = pooling_budget(cfg, max_model_len)
    runner = PoolingRunner(loaded, device=device, use_triton=device.type == "cuda")
    if device.type == "cuda":
        runner.warm_up(budget, cfg.max_num_seqs)
    blocks = BlockManager(-(-budget // cfg.block_size), cfg.block_size, enable_prefix_caching=False)
    scheduler = PoolingScheduler(blocks, max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=budget,
                                 max_model_len=max_model_len, eos_token_ids=())
    names = tuple(cfg.served_model_name) or (loaded.name,)
    spec = loaded.spec
    log.info("loaded %s as a pooling model (%s, %s pooling%s, %d outputs) on %s in %.1fs; up to %d "
             "tokens a step, no KV cache", names[0], spec.task, spec.pooling_type,
             ", normalized" if spec.task == "embed" and spec.normalize else "", spec.output_size, device,
             time.perf_counter() - t0, budget)
    return Built(loaded=loaded, model_names=names, max_model_len=max_model_len, runner=runner,
                 blocks=blocks, scheduler=scheduler, parsers=Parsers(None, ToolSettings()), pooling=spec)
