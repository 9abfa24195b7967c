"""The shared SmolLM2 (the smollm fixture) behind a running engine, as the engine tests drive it:
``async with engine_of(smollm) as engine``, a non-streamed request's reply, and a dense
forward's logprobs to check the engine's against."""
from __future__ import annotations

import orjson
import torch

from gpu.layers.attention_dense import DenseCausalAttention
from pipeline.core.config import EngineConfig
from pipeline.core.engine import Engine, open_engine

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def engine_of(smollm, **cfg):
    """The shared SmolLM2 behind a running engine: ``async with engine_of(smollm) as engine``."""
    return open_engine(EngineConfig(**{"max_model_len": 512, "max_num_seqs": 8, **cfg}), loaded=smollm)


async def complete(engine: Engine, api: str = "completions", **body) -> dict:
    reply = await engine.submit(api, {"model": engine.model_names[0], "temperature": 0, **body})
    return orjson.loads(await reply.read())


def dense_logprobs(smollm, ids: list[int]) -> torch.Tensor:
    """log_softmax of a plain dense forward over the whole prompt: row p scores token p+1."""
    with torch.inference_mode():
        hidden = smollm.model(torch.tensor(ids), torch.arange(len(ids)), DenseCausalAttention())
        return torch.log_softmax(smollm.model.compute_logits(hidden).float(), dim=-1)
