"""Pictures through the whole engine under preemption (issue 34): three one-image chats on
the tiny LLaVA, with its CLIP and with a SigLIP tower (and on the tiny Qwen2.5-VL, whose
M-RoPE positions and rope delta must survive the recompute) in a KV cache too small for
them together, prefilled in chunks that cut through the pictures' tokens; each is
preempted and recomputed (its picture's features put back from the encoder cache) and
still gives transformers' greedy tokens."""
from __future__ import annotations

import base64
import io

import numpy as np
import orjson
import torch
import trio

from tests.support.vision_models import llava_dir, qwen_vl_dir


def picture(seed: int):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(40, 52, 3) * 255).astype(np.uint8))


def data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def _preempted_chats(folder, model, processor, blocks: int):
    from pipeline.core.config import EngineConfig
    from pipeline.core.engine import open_engine

    imgs = [picture(s) for s in (11, 12, 13)]
    text = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "Tell me."}]}], add_generation_prompt=True)
    want = []
    for img in imgs:
        inputs = processor(images=[img], text=text, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        want.append(out[0, inputs["input_ids"].shape[1]:].tolist())
    cfg = EngineConfig(model=str(folder), dtype="float32", max_model_len=256, max_num_seqs=3,
                       num_gpu_blocks_override=blocks, block_size=8, max_num_batched_tokens=16,
                       enable_prefix_caching=False)
    got: list = [None] * 3
    async with open_engine(cfg) as engine:
        async def one(i: int) -> None:
            reply = await engine.submit("chat", {
                "model": engine.model_names[0], "temperature": 0, "max_tokens": 12,
                "ignore_eos": True, "return_token_ids": True,
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": data_url(imgs[i])}},
                    {"type": "text", "text": "Tell me."}]}]})
            got[i] = orjson.loads(await reply.read())["choices"][0]["token_ids"]

        async with trio.open_nursery() as reqs:
            for i in range(3):
                reqs.start_soon(one, i)
        assert engine.stats().num_preemptions > 0
    assert got == want


async def test_preempted_image_chats_give_transformers_tokens(tmp_path_factory):
    await _preempted_chats(*llava_dir(tmp_path_factory), blocks=10)


async def test_preempted_qwen2_5_vl_chats_give_transformers_tokens(tmp_path_factory):
    await _preempted_chats(*qwen_vl_dir(tmp_path_factory), blocks=12)


async def test_preempted_siglip_llava_chats_give_transformers_tokens(tmp_path_factory):
    """The same with the LLaVA whose tower is SigLIP's (16 image tokens, none dropped)."""
    await _preempted_chats(*llava_dir(tmp_path_factory, tower="siglip"), blocks=7)
