"""Pictures and the chats that carry them, for the vision tests over HTTP (tests/e2e/
test_e2e_vision.py, tests/procs/test_vision_frontends.py): two random pictures, as PNG and
as data URLs; a user turn with image_url parts (ours) and the same turn as llava-hf templates
take it (transformers'); and transformers' greedy tokens for it, the oracle."""
from __future__ import annotations

import base64
import io

import numpy as np
import torch

def picture(h: int, w: int, seed: int):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype(np.uint8))


def png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def data_url(img) -> str:
    return "data:image/png;base64," + base64.b64encode(png(img)).decode()


IMG_A, IMG_B = picture(40, 57, 1), picture(50, 31, 2)


def hf_generate(llava, messages: list[dict], images: list, max_new_tokens: int = 8):
    """transformers' greedy tokens and the processor's prompt length for the messages
    (content parts as the template takes them: {"type": "image"} / text)."""
    _, model, processor = llava
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(images=images or None, text=text, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    n = inputs["input_ids"].shape[1]
    return out[0, n:].tolist(), n


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def ask(text: str, *urls: str) -> list[dict]:
    return [{"role": "user", "content": [*map(image_part, urls), {"type": "text", "text": text}]}]


def hf_ask(text: str, n_images: int) -> list[dict]:
    return [{"role": "user", "content": [*([{"type": "image"}] * n_images),
                                         {"type": "text", "text": text}]}]
