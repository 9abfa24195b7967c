"""Issue 34's figures: 16 concurrent one-image chats on the tiny LLaVA (tests/support/vision_models.py)
served by `tailrace serve` on the CPU, against transformers' generate batched on the same
work (16 prompts, the same pictures, left-padded), side by side in one run; and the
encoder cache's effect (16 chats of one picture vs 16 different pictures).

    PYTHONPATH=$PWD python scripts/bench_vision.py [--tokens 16] [--port 18934]
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the repo root: tests.support
from tests.support.vision_models import make_llava


def picture(seed: int):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(48, 64, 3) * 255).astype(np.uint8))


def data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def chats(base_url: str, images, tokens: int) -> tuple[list[float], float, int]:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id

    async def one(img):
        t0 = time.perf_counter()
        ttft, n = None, 0
        stream = await client.chat.completions.create(
            model=model, temperature=0, max_tokens=tokens, stream=True,
            extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(img)}},
                {"type": "text", "text": "Describe the picture."}]}])
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft or time.perf_counter() - t0
                n += 1
        return ttft, n

    t0 = time.perf_counter()
    out = await asyncio.gather(*(one(im) for im in images))
    wall = time.perf_counter() - t0
    return [t for t, _ in out], wall, sum(n for _, n in out)


def hf_batched(model, processor, images, tokens: int) -> tuple[float, float]:
    """(seconds to the first token of the batch, seconds for `tokens` tokens each)."""
    import torch

    processor.tokenizer.padding_side = "left"
    text = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "Describe the picture."}]}],
        add_generation_prompt=True)
    inputs = processor(images=list(images), text=[text] * len(images), return_tensors="pt",
                       padding=True)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(**inputs, max_new_tokens=1, do_sample=False)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        whole = time.perf_counter() - t0
    return first, whole


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--port", type=int, default=18934)
    ap.add_argument("--n", type=int, default=16)
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-llava-"))
    model, processor = make_llava(folder)
    distinct = [picture(i) for i in range(args.n)]
    same = [picture(1000)] * args.n
    first, whole = hf_batched(model, processor, distinct, args.tokens)
    print(f"transformers generate, batch {args.n}: first token {first:.3f} s, "
          f"{args.n * args.tokens} tokens in {whole:.3f} s = {args.n * args.tokens / whole:.1f} tok/s")
    proc = subprocess.Popen([sys.executable, "-m", "web.cli", "serve", str(folder), "--port",
                             str(args.port), "--dtype", "float32", "--kv-cache-memory-bytes",
                             "256Mi", "--max-model-len", "1024", "--log-level", "warning"],
                            stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("tailrace: listening on "):
                break
        base = f"http://127.0.0.1:{args.port}/v1"
        asyncio.run(chats(base, [picture(999)], 2))          # warm up
        for label, imgs in (("16 different pictures", distinct),
                            ("one picture 16 times (encoder + prefix cache)", same)):
            ttfts, wall, n = asyncio.run(chats(base, imgs, args.tokens))
            print(f"tailrace, {label}: TTFT p50 {statistics.median(ttfts):.3f} s, "
                  f"max {max(ttfts):.3f} s; {n} tokens in {wall:.3f} s = {n / wall:.1f} tok/s")
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
