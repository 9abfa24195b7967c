"""Beam search through the whole engine (eight stages, SmolLM2 fp32) against transformers'
beam search on the same weights (the loaded model's fp32 weights in transformers'
LlamaForCausalLM, tests/support/lora_adapters.py; transformers' own GGUF conversion of the
bundled file took 16 s; tests/gpu/test_gguf.py holds the loader to convert_hf_to_gguf's
layout).

The two searches agree under these settings, which the test uses:
- `ignore_eos` here and `eos_token_id=None` there: no hypothesis finishes early, so
  transformers' `early_stopping` and the two ways of scoring a finished hypothesis
  (transformers: generated length; vLLM, and so tailrace: prompt + generated length) do
  not come in; every beam runs max_tokens (8) rounds;
- so every returned beam has the same length, and both rank them by cumulative logprob
  (a length penalty divides every score by the same number);
- each round both keep the `n` best of the live beams' continuations (transformers'
  top 2n over all beams is a subset of the union of each beam's top 2n that vLLM takes).
transformers' `sequences_scores` is cum_logprob / 8 ** length_penalty, from which the
cumulative logprob is compared with the sum of the returned per-token logprobs.
"""
from __future__ import annotations

import orjson
import pytest
import torch
import trio

from tests.support.smollm_engine import engine_of

PROMPT = "The capital of France is"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def hf_model(smollm):
    pytest.importorskip("transformers")
    from tests.support.lora_adapters import hf_from_ours

    return hf_from_ours(smollm.model)


def hf_beams(model, ids, width, length_penalty):
    """transformers' beams (output token ids) and their cumulative logprobs."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]), num_beams=width, num_return_sequences=width, do_sample=False,
            max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, length_penalty=length_penalty,
            early_stopping=False, eos_token_id=None, pad_token_id=0, output_scores=True,
            return_dict_in_generate=True)
    return ([tuple(s[len(ids):].tolist()) for s in out.sequences],
            [float(x) * MAX_TOKENS ** length_penalty for x in out.sequences_scores])


async def test_beams_equal_transformers_beam_search(smollm, hf_model):
    ids = smollm.tokenizer.encode(PROMPT)
    async with engine_of(smollm) as engine:     # one engine for both cases
        for width, length_penalty in ((3, 1.0), (2, 0.6)):
            want, want_cum = hf_beams(hf_model, ids, width, length_penalty)
            reply = await engine.submit("completions", {
                "model": engine.model_names[0], "prompt": ids, "max_tokens": MAX_TOKENS,
                "n": width, "use_beam_search": True, "length_penalty": length_penalty,
                "ignore_eos": True, "logprobs": 0, "return_token_ids": True})
            body = orjson.loads(await reply.read())
            assert engine.stats().kv_blocks_used == 0       # every beam's blocks came back
            got = [tuple(c["token_ids"]) for c in body["choices"]]
            assert got == want
            for c, cum in zip(body["choices"], want_cum):
                assert sum(c["logprobs"]["token_logprobs"]) == pytest.approx(cum, abs=2e-3)
                assert c["finish_reason"] == "length"
            assert [c["index"] for c in body["choices"]] == list(range(width))
            # as vLLM: the prompt once, the completion tokens of every returned beam
            assert body["usage"]["prompt_tokens"] == len(ids)
            assert body["usage"]["completion_tokens"] == width * MAX_TOKENS
        # a client that goes away mid-search: every beam's blocks are freed
        reply = await engine.submit("completions", {
            "model": engine.model_names[0], "prompt": "Once upon", "max_tokens": 200, "n": 3,
            "use_beam_search": True, "stream": True})
        with trio.move_on_after(2):
            async for _ in reply:
                pass
        await reply.aclose()
        with trio.fail_after(60):
            while engine.stats().kv_blocks_used or engine.stats().num_running:
                await trio.sleep(0.05)
