"""The tiny Qwen2.5-VL (tests/support/vision_models.py) against transformers (issue 34): our
patches, grids and placeholder counts against Qwen2VLImageProcessor and the Qwen2.5-VL
processor on several sizes and aspect ratios (and with mm_processor_kwargs), the vision
tower's features and the decoder's logits (M-RoPE) against
Qwen2_5_VLForConditionalGeneration's on the same pictures and prompt, and the runner's
chunked prefill through a picture against transformers' generate."""
from __future__ import annotations

from gpu.models.registry import config_from_hf

import numpy as np
import pytest
import torch

from tests.support.vision_models import qwen_vl_dir
from tests.support.hf_models import our_logits


def picture(h: int, w: int, seed: int):
    from PIL import Image

    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(h, w, 3) * 255).astype(np.uint8))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return qwen_vl_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def loaded(qwen):
    from gpu.loader.decoder import load_model

    return load_model(qwen[0], dtype="float32", progress=False)


# square, wide, tall, tiny (scaled up to min_pixels), large (scaled down to max_pixels),
# a 1:12 strip, sizes that round either way
SIZES = [(40, 57), (57, 40), (32, 32), (5, 9), (300, 210), (12, 150), (45, 19), (100, 100)]


def test_patches_and_placeholders_match_the_hf_processor(qwen, loaded):
    from stages.media.images import qwen_patches
    from stages.media.prompt import image_tokens

    out, _, processor = qwen
    spec = loaded.vision_spec
    assert spec.architecture == "qwen2_5_vl" and spec.image_token == "<|image_pad|>"
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
        add_generation_prompt=True)
    for i, (h, w) in enumerate(SIZES):
        img = picture(h, w, i)
        ref = processor(images=[img], text=text, return_tensors="np")
        ours, grid = qwen_patches(img, spec.processing)
        assert grid == tuple(ref["image_grid_thw"][0]), (h, w)
        np.testing.assert_allclose(ours, ref["pixel_values"], rtol=0, atol=1e-6)
        n = int((ref["input_ids"] == spec.image_token_id).sum())
        assert n == image_tokens(spec, grid) == grid[1] * grid[2] // 4
    # a grey and an RGBA picture convert to RGB as the processor does
    for img in (picture(20, 33, 9).convert("L"), picture(33, 20, 10).convert("RGBA")):
        ref = processor.image_processor(img, return_tensors="np")["pixel_values"]
        np.testing.assert_allclose(qwen_patches(img, spec.processing)[0], ref, atol=1e-6)
    # mm_processor_kwargs: min_pixels / max_pixels as the processor takes them
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    for opts in ({"max_pixels": 24 * 24}, {"min_pixels": 40 * 40, "max_pixels": 64 * 64}):
        proc = spec.processing.with_options(opts)
        hf = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, **opts)
        img = picture(40, 57, 3)
        ref = hf(img, return_tensors="np")
        ours, grid = qwen_patches(img, proc)
        assert grid == tuple(ref["image_grid_thw"][0])
        np.testing.assert_allclose(ours, ref["pixel_values"], atol=1e-6)
    for bad in ({"max_pixels": 0}, {"min_pixels": 10_000, "max_pixels": 100}, {"fps": 2},
                {"max_pixels": "many"}, {"max_pixels": 8}):
        with pytest.raises(ValueError):
            spec.processing.with_options(bad)


def test_features_and_logits_match_transformers(qwen, loaded):
    from gpu.layers.attention_dense import DenseCausalAttention
    from gpu.models.qwen_vision import mrope_positions
    from gpu.interface import ImageInput
    from stages.media.images import qwen_patches

    out, model, processor = qwen
    spec = loaded.vision_spec
    assert loaded.vision is not None and loaded.config.mrope_section == (2, 3, 3)
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"},
                                      {"type": "image"}]}], add_generation_prompt=True)
    imgs = [picture(40, 57, 1), picture(50, 31, 2)]   # 5x7 and 6x4 merged: several windows
    inputs = processor(images=imgs, text=text, return_tensors="pt")
    with torch.inference_mode():
        ref = model(**inputs).logits[0].float()
        ref_feats = model.model.get_image_features(
            inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    ids = inputs["input_ids"][0].tolist()
    patches = [qwen_patches(i, spec.processing) for i in imgs]
    with torch.inference_mode():
        feats = [loaded.vision(torch.from_numpy(p), g) for p, g in patches]
    for ours, want in zip(feats, ref_feats):
        torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)
    rows = [i for i, t in enumerate(ids) if t == spec.image_token_id]
    starts = [r for r in rows if ids[r - 1] != spec.image_token_id]
    images = [ImageInput(s, f.shape[0], "", None, g) for s, f, (_, g) in zip(starts, feats, patches)]
    pos, delta = mrope_positions(len(ids), images, 2)
    want_pos, want_delta = model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"])
    np.testing.assert_array_equal(pos, want_pos[:, 0].numpy())
    assert delta == int(want_delta) and delta < 0
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(ids), torch.from_numpy(pos), DenseCausalAttention(None),
                              embeds=(torch.tensor(rows), torch.cat(feats)))
        ours = loaded.model.compute_logits(hidden)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    # the picture matters: without it (placeholder embeddings, 1D positions) the logits differ
    plain = our_logits(loaded.model, ids)
    assert (plain - ref).abs().max() > 1e-2


def test_runner_chunks_through_a_picture_with_mrope(qwen, loaded):
    """A prefill in chunks of 7 tokens cuts through the picture's tokens: each chunk gets
    its M-RoPE positions and its part of the features, decode positions are p + delta,
    and the greedy tokens are transformers' generate's; the same picture again is not
    encoded again."""
    from gpu.layers.attention import KVCache
    from gpu.interface import SamplingOptions, SeqChunk, SeqStart, StepPlan
    from gpu.worker.runner import ModelRunner
    from stages.media.images import content_hash, qwen_patches
    from stages.media.prompt import expand

    out, model, processor = qwen
    spec, mc = loaded.vision_spec, loaded.config
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image"},
                                      {"type": "text", "text": "what is it?"}]}],
        add_generation_prompt=True)
    img = picture(45, 33, 5)
    inputs = processor(images=[img], text=text, return_tensors="pt")
    with torch.inference_mode():
        want = model.generate(**inputs, max_new_tokens=6, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    pixels, grid = qwen_patches(img, spec.processing)
    short = [t for i, t in enumerate(inputs["input_ids"][0].tolist())
             if t != spec.image_token_id or inputs["input_ids"][0][i - 1] != spec.image_token_id]
    ids, images = expand(short, spec, [(pixels, content_hash(pixels, grid), grid)], "messages")
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
        while len(got) < len(want):
            res = runner.execute(StepPlan(step, (SeqChunk(sid, (got[-1],), pos, table, True),)))
            got += res.token_ids
            pos, step = pos + 1, step + 1
        return got

    assert run("a", (0, 1, 2, 3, 4), 0) == want.tolist()
    assert runner.encoder_cache.encoded == 1
    assert run("b", (5, 6, 7, 8, 9), 100) == want.tolist()
    assert runner.encoder_cache.encoded == 1          # the same picture: from the cache


def test_transformers_4_layout_config_and_names():
    """transformers 4's Qwen2.5-VL config.json (the decoder's fields at the top level,
    rope_scaling {"type": "mrope"}) and 5's weight names (model.language_model.*,
    model.visual.*) read as the tiny model's."""
    from gpu.config.model import ModelConfig
    from gpu.models.qwen_vision import split_checkpoint
    from gpu.config.vision import is_vision_config, text_config

    flat = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
            "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
            "rope_theta": 1e6, "max_position_embeddings": 512,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
            "vision_config": {"depth": 2}}
    assert is_vision_config(flat)
    c = config_from_hf(text_config(flat))
    assert c.architecture == "qwen2" and c.attention_bias and c.mrope_section == (2, 3, 3)
    assert c.rope_theta == 1e6 and c.rope_scaling_dict.get("rope_type", "default") == "default"
    assert config_from_hf({**text_config(flat), "model_type": "qwen2",
                                "rope_scaling": None}).mrope_section is None
    vision: list = []
    names = [n for n, _ in split_checkpoint(
        [("model.language_model.layers.0.self_attn.q_proj.weight", 0),
         ("model.language_model.embed_tokens.weight", 0), ("lm_head.weight", 0),
         ("model.visual.blocks.0.attn.qkv.weight", 0), ("visual.merger.ln_q.weight", 0)], vision)]
    assert names == ["model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight",
                     "lm_head.weight"]
    assert [n for n, _ in vision] == ["blocks.0.attn.qkv.weight", "merger.ln_q.weight"]


def test_mm_processor_kwargs_are_checked_before_any_fetch(loaded):
    """A bad option is a MediaError (the 400) naming mm_processor_kwargs before the
    picture's URL is fetched; LLaVA's CLIP processor takes no options."""
    import attrs

    from gpu.config.vision import ImageProcessing
    from stages.media.fetch import MediaError, MediaSettings
    from stages.media.prompt import load_images

    parts = [{"type": "image", "image_url": "http://unreachable.invalid/a.png",
              "param": "messages[0].content[0].image_url"}]
    settings = MediaSettings(fetch_timeout_s=30.0)
    for spec, opts, words in (
            (loaded.vision_spec, {"max_pixels": 0}, "positive integer"),
            (loaded.vision_spec, {"size": {"longest_edge": 9}}, "unknown option 'size'"),
            (attrs.evolve(loaded.vision_spec, processing=ImageProcessing()), {"max_pixels": 100},
             "takes no options")):
        with pytest.raises(MediaError) as e:
            load_images(parts, spec, settings, opts)
        assert e.value.param == "mm_processor_kwargs" and words in e.value.message
