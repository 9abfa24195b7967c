"""Gemma 2 and Gemma 3 from HF folders against transformers, on tiny random checkpoints
(tests/support/hf_models.py TINY_GEMMA2/3): logits, the Gemma 3 text model inside a
Gemma3ForConditionalGeneration checkpoint, and greedy tokens through the engine with
chunked prefill and preemption against transformers' greedy generation."""
from __future__ import annotations

import orjson
import pytest
import torch
import trio

from gpu.layers.attention import KVCache
from gpu.loader.decoder import load_model
from tests.support.hf_models import hf_logits, make_hf_model, our_logits
from pipeline.core.config import EngineConfig
from pipeline.core.engine import open_engine

IDS = [3, 17, 42, 99, 5, 150, 7, 63, 21, 88, 130, 1, 64, 9, 33, 120, 77, 2, 45, 101] * 2  # 40 tokens


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_logits_match_transformers(arch, tmp_path):
    hf = make_hf_model(arch, tmp_path)
    loaded = load_model(tmp_path, dtype="float32", progress=False)
    c = loaded.config
    assert c.architecture == arch and c.hidden_act == "gelu_pytorch_tanh" and c.sandwich_norms
    assert c.layer_types == tuple(hf.config.layer_types)
    expected, got = hf_logits(hf, IDS), our_logits(loaded.model, IDS)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    if arch == "gemma2":    # the caps bite: logits within +-2, unlike the raw head's
        assert got.abs().max() < 2.0 and c.attn_logit_softcapping == 0.5


def test_gemma2_defaults_its_soft_caps_when_config_json_has_none():
    from gpu.models.registry import config_from_hf

    d = make_hf_model("gemma2").config.to_dict()
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "layer_types"):
        d.pop(key)
    c = config_from_hf(d)
    assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (50.0, 30.0)
    assert c.layer_types == ("sliding_attention", "full_attention", "sliding_attention")


def test_gemma3_text_model_of_a_conditional_generation_checkpoint(tmp_path):
    """Gemma3ForConditionalGeneration saved by transformers 5 (model.language_model.*, a
    SigLIP tower and a projector beside it): its text model is served, the rest skipped."""
    import transformers

    text = make_hf_model("gemma3").config
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                       mm_tokens_per_image=4, image_token_index=5, boi_token_index=6,
                                       eoi_token_index=7)
    torch.manual_seed(1)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    hf.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, dtype="float32", progress=False)
    assert loaded.config.architecture == "gemma3" and loaded.config.num_hidden_layers == 7
    with torch.inference_mode():
        expected = hf(input_ids=torch.tensor([IDS])).logits[0].float()
    torch.testing.assert_close(our_logits(loaded.model, IDS), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
async def test_engine_greedy_matches_transformers_with_chunks_and_preemption(arch, tmp_path):
    """Three requests at once, prefilled in chunks of 16 in a cache too small for them all
    (preemptions), their sliding layers on the sliding pool: transformers' greedy tokens."""
    hf = make_hf_model(arch, tmp_path, seed=3)
    prompts = [[(i * k + 5) % 150 + 3 for i in range(50)] for k in (3, 5, 7)]
    n = 48      # 98 tokens: 7 blocks a sequence, more than the 14 (Gemma 2) or 18 full-layer blocks
    with torch.inference_mode():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    c = hf.config
    per_block = KVCache.bytes_per_block(c.num_hidden_layers, 16, c.num_key_value_heads, c.head_dim, torch.float32)
    cfg = EngineConfig(model=str(tmp_path), dtype="float32", max_model_len=128, max_num_seqs=3,
                       max_num_batched_tokens=16, kv_cache_memory_bytes=12 * per_block)
    outs = [None] * 3
    async with open_engine(cfg) as engine:
        async def one(i):
            body = {"prompt": prompts[i], "max_tokens": n, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}
            reply = await engine.submit("completions", {"model": engine.model_names[0], **body})
            outs[i] = orjson.loads(await reply.read())["choices"][0]["token_ids"]
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(one, i)
        stats = engine.stats()
        sliding = engine.blocks.sliding
    assert stats.num_preemptions > 0 and sliding is not None and sliding.num_slots == 11
    assert outs == want
