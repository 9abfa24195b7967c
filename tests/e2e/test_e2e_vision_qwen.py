"""A Qwen2.5-VL over HTTP (issue 34): the tiny random-weight model (tests/support/vision_models.py)
served by one `tailrace serve` with prefills chunked through the pictures, driven by the
openai client, against transformers' generate and the Qwen2.5-VL processor on the same
weights and pictures: greedy tokens, prompt and image token counts (dynamic resolution,
M-RoPE), the prefix cache, mm_processor_kwargs, and Responses' input_image."""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from tests.support.vision_models import QWEN_MAX_PIXELS, QWEN_MIN_PIXELS, qwen_vl_dir


def picture(h: int, w: int, seed: int):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype(np.uint8))


def data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


IMG_WIDE, IMG_TALL = picture(40, 57, 1), picture(50, 31, 2)   # 35 and 24 image tokens


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return qwen_vl_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def vl(qwen, tmp_path_factory, serve_with_flags):
    import openai

    for server in serve_with_flags(
            tmp_path_factory.mktemp("e2e-qwen-vl-server"), str(qwen[0]),
            # steps of 16 tokens: every prefill is chunked, cutting through the pictures
            "--max-num-batched-tokens", "16", "--enable-prompt-tokens-details"):
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)
        yield server, client, client.models.list().data[0].id


def hf_generate(qwen, text: str, images: list, max_new_tokens: int = 8, **proc_kw):
    """transformers' greedy tokens and the processor's prompt and image token counts."""
    _, model, processor = qwen
    messages = [{"role": "user", "content": [*([{"type": "image"}] * len(images)),
                                             {"type": "text", "text": text}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    size = {"shortest_edge": QWEN_MIN_PIXELS, "longest_edge": QWEN_MAX_PIXELS, **proc_kw}
    inputs = processor(images=images, text=prompt, size=size, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    n = inputs["input_ids"].shape[1]
    image_id = model.config.image_token_id
    return out[0, n:].tolist(), n, int((inputs["input_ids"] == image_id).sum())


def ask(text: str, *imgs) -> list[dict]:
    return [{"role": "user", "content": [
        *({"type": "image_url", "image_url": {"url": data_url(i)}} for i in imgs),
        {"type": "text", "text": text}]}]


def chat(client, model, messages, **extra):
    return client.chat.completions.create(model=model, messages=messages, temperature=0,
                                          max_tokens=8,
                                          extra_body={"return_token_ids": True, **extra})


def test_greedy_tokens_usage_and_the_prefix_cache(vl, qwen):
    _, client, model = vl
    want, n_prompt, n_image = hf_generate(qwen, "What is this?", [IMG_WIDE])
    r = chat(client, model, ask("What is this?", IMG_WIDE))
    assert r.choices[0].token_ids == want
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.prompt_tokens_details.multimodal_tokens == {"image": n_image} == {"image": 35}
    # two pictures of other sizes and shapes: the positions after each follow its grid
    want2, n2, img2 = hf_generate(qwen, "Compare them.", [IMG_TALL, IMG_WIDE])
    r2 = chat(client, model, ask("Compare them.", IMG_TALL, IMG_WIDE))
    assert r2.choices[0].token_ids == want2
    assert r2.usage.prompt_tokens == n2
    assert r2.usage.prompt_tokens_details.multimodal_tokens == {"image": img2} == {"image": 59}
    # the same picture again reuses its KV (and answers alike); another one does not
    again = chat(client, model, ask("What is this?", IMG_WIDE))
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].token_ids == want
    other = chat(client, model, ask("What is this?", picture(40, 57, 3)))
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def test_mm_processor_kwargs_and_responses_input_image(vl, qwen):
    import httpx

    server, client, model = vl
    want, n_prompt, n_image = hf_generate(qwen, "What is this?", [IMG_WIDE],
                                          longest_edge=24 * 24)
    r = chat(client, model, ask("What is this?", IMG_WIDE),
             mm_processor_kwargs={"max_pixels": 24 * 24})
    assert r.choices[0].token_ids == want
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.prompt_tokens_details.multimodal_tokens == {"image": n_image} == {"image": 6}
    for bad, words in (({"max_pixels": -1}, "positive integer"),
                       ({"min_pixels": 9000, "max_pixels": 100}, "more than max_pixels"),
                       ({"fps": 2}, "unknown option 'fps'"), ("big", "")):
        body = {"model": model, "max_tokens": 2, "messages": ask("hi", IMG_WIDE),
                "mm_processor_kwargs": bad}
        resp = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=30)
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert words in err["message"] and "mm_processor_kwargs" in err["param"], err
    # Responses' input_image (with mm_processor_kwargs): the chat answer and count
    extra = {"mm_processor_kwargs": {"max_pixels": 24 * 24}}
    ref = chat(client, model, ask("What is this?", IMG_TALL), **extra)
    out = client.responses.create(model=model, temperature=0, max_output_tokens=8, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(IMG_TALL)},
                                     {"type": "input_text", "text": "What is this?"}]}],
        extra_body=extra)
    assert out.output_text == ref.choices[0].message.content
    assert out.usage.input_tokens == ref.usage.prompt_tokens

def test_tokenize_takes_pictures(vl, qwen):
    """/tokenize with a picture: the prompt's tokens with its placeholders expanded, the
    Hugging Face processor's ids (mm_processor_kwargs too)."""
    import httpx

    server, _, model = vl
    _, hf_model, processor = qwen
    prompt = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What is this?"}]}], add_generation_prompt=True)
    base = server.base_url.removesuffix("/v1")
    for opts, size in (({}, {}), ({"max_pixels": 24 * 24}, {"longest_edge": 24 * 24})):
        want = processor(images=[IMG_WIDE], text=prompt, return_tensors="np", size={
            "shortest_edge": QWEN_MIN_PIXELS, "longest_edge": QWEN_MAX_PIXELS, **size})
        r = httpx.post(f"{base}/tokenize", timeout=30, json={
            "model": model, "messages": ask("What is this?", IMG_WIDE),
            **({"mm_processor_kwargs": opts} if opts else {})})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == want["input_ids"][0].tolist()
        assert r.json()["count"] == want["input_ids"].shape[1]
