"""The tiny llava-hf LLaVA (tests/support/vision_models.py) against transformers (issue 34): our
pixel values and placeholder counts against its processor on several sizes and aspect
ratios, and our logits against LlavaForConditionalGeneration's on the same picture and
prompt."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.vision_models import llava_dir
from tests.support.hf_models import our_logits


def picture(h: int, w: int, seed: int):
    from PIL import Image

    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(h, w, 3) * 255).astype(np.uint8))


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return llava_dir(tmp_path_factory)


SIZES = [(40, 57), (57, 40), (30, 30), (12, 100), (301, 17), (8, 8), (64, 64)]


def test_pixel_values_and_placeholders_match_the_hf_processor(llava):
    from gpu.tokenizers.tokenizer import tokenizer_from_hf_dir
    from gpu.config.vision import vision_spec
    from gpu.formats.hf import read_json
    from stages.media.images import pixel_values

    out, _, processor = llava
    spec = vision_spec(out, read_json(out / "config.json"), tokenizer_from_hf_dir(out))
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
        add_generation_prompt=True)
    for i, (h, w) in enumerate(SIZES):
        img = picture(h, w, i)
        ref = processor(images=[img], text=text, return_tensors="np")
        ours = pixel_values(img, spec.processing)
        assert ours.shape == ref["pixel_values"][0].shape
        np.testing.assert_allclose(ours, ref["pixel_values"][0], rtol=0, atol=1e-6)
        assert int((ref["input_ids"] == spec.image_token_id).sum()) == spec.tokens_per_image
    # a grey and an RGBA picture convert to RGB as the processor does
    for img in (picture(20, 33, 9).convert("L"), picture(33, 20, 10).convert("RGBA")):
        ref = processor.image_processor(img, return_tensors="np")["pixel_values"][0]
        np.testing.assert_allclose(pixel_values(img, spec.processing), ref, atol=1e-6)


def test_logits_match_transformers(llava):
    from gpu.loader.decoder import load_model
    from stages.media.images import pixel_values

    out, model, processor = llava
    loaded = load_model(out, dtype="float32", progress=False)
    spec = loaded.vision_spec
    assert spec.tokens_per_image == 25 and loaded.vision is not None
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"},
                                      {"type": "image"}]}], add_generation_prompt=True)
    imgs = [picture(40, 57, 1), picture(50, 31, 2)]
    inputs = processor(images=imgs, text=text, return_tensors="pt")
    with torch.inference_mode():
        ref = model(**inputs).logits[0].float()
    ids = inputs["input_ids"][0].tolist()
    pixels = torch.from_numpy(np.stack([pixel_values(i, spec.processing) for i in imgs]))
    with torch.inference_mode():
        feats = loaded.vision(pixels)                                   # [2, 25, D]
    rows = torch.tensor([i for i, t in enumerate(ids) if t == spec.image_token_id])
    assert len(rows) == 50
    from gpu.layers.attention_dense import DenseCausalAttention
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), DenseCausalAttention(None),
                              embeds=(rows, feats.reshape(-1, feats.shape[-1])))
        ours = loaded.model.compute_logits(hidden)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    # the picture matters: without it (placeholder embeddings) the logits differ
    plain = our_logits(loaded.model, ids)
    assert (plain - ref).abs().max() > 1e-2


def test_runner_chunks_through_a_picture_and_encodes_it_once(llava):
    """A prefill in chunks of 7 tokens cuts through the 25 image tokens: the runner puts
    each chunk's part of the picture's features in place, and its greedy tokens are
    transformers'; a second sequence with the same picture is not encoded again."""
    from gpu.layers.attention import KVCache
    from gpu.interface import SamplingOptions, SeqChunk, SeqStart, StepPlan
    from gpu.loader.decoder import load_model
    from gpu.worker.runner import ModelRunner
    from stages.media.images import content_hash, pixel_values
    from stages.media.prompt import expand

    out, model, processor = llava
    loaded = load_model(out, dtype="float32", progress=False)
    spec, mc = loaded.vision_spec, loaded.config
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image"},
                                      {"type": "text", "text": "what is it?"}]}],
        add_generation_prompt=True)
    img = picture(45, 33, 5)
    inputs = processor(images=[img], text=text, return_tensors="pt")
    with torch.inference_mode():
        want = model.generate(**inputs, max_new_tokens=4, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    pixels = pixel_values(img, spec.processing)
    short = [t for i, t in enumerate(inputs["input_ids"][0].tolist())
             if t != spec.image_token_id or inputs["input_ids"][0][i - 1] != spec.image_token_id]
    ids, images = expand(short, spec, [(pixels, content_hash(pixels), None)], "messages")
    assert ids == inputs["input_ids"][0].tolist()
    cache = KVCache(mc.num_hidden_layers, 16, 16, mc.num_key_value_heads, mc.head_dim,
                    torch.float32, "cpu")
    runner = ModelRunner(loaded.model, cache, device=torch.device("cpu"), vision=loaded.vision)
    greedy = SamplingOptions(temperature=0.0)

    def run(sid: str, table: tuple[int, ...], step0: int) -> list[int]:
        got, pos, step = [], 0, step0
        new = (SeqStart(sid, tuple(ids), greedy, images=images),)
        while pos < len(ids):
            chunk = ids[pos:pos + 7]
            res = runner.execute(StepPlan(step, (SeqChunk(sid, tuple(chunk), pos, table,
                                                          pos + len(chunk) == len(ids)),), new))
            new, pos, step = (), pos + len(chunk), step + 1
        got += res.token_ids
        while len(got) < 4:
            res = runner.execute(StepPlan(step, (SeqChunk(sid, (got[-1],), pos, table, True),)))
            got += res.token_ids
            pos, step = pos + 1, step + 1
        return got

    assert run("a", (0, 1, 2, 3), 0) == want.tolist()
    assert runner.encoder_cache.encoded == 1
    assert run("b", (4, 5, 6, 7), 100) == want.tolist()
    assert runner.encoder_cache.encoded == 1          # the same picture: from the cache
