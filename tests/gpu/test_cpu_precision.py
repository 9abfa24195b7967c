"""The CPU's default precision recipe: bf16 weights and GEMMs, an fp32 residual stream and
norms, and the logits near each row's top recomputed in fp32 (gpu/model.exact_top_logits).
scripts/dtype_quality.py measures it against fp32 and HF bf16 (docs/benchmarks.md); here a
small fixed set must decode exactly as fp32 does."""
from __future__ import annotations

import pytest
import torch

from gpu.layers.attention_dense import DenseCausalAttention
from gpu.loader.decoder import choose_residual_dtype
from gpu.models.causal_lm import CausalLM, exact_top_logits
from tests.support.greedy_runs import PROMPTS, greedy_runner

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def recipe_model(smollm):
    model = CausalLM(smollm.config, torch.bfloat16, residual_dtype=torch.float32)
    model.load_state_dict(smollm.model.state_dict())
    return model.eval()


@pytest.fixture(scope="module")
def chat_prompts(smollm_tokenizer):
    tok = smollm_tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True))
            for p in PROMPTS]


def test_residual_stream_is_fp32_and_gemms_bf16(recipe_model):
    layer = recipe_model.layers[0]
    assert layer.mlp.gate_up_proj.weight.dtype == torch.bfloat16
    with torch.inference_mode():
        hidden = recipe_model(torch.tensor([1, 2, 3]), torch.arange(3), DenseCausalAttention())
        logits = recipe_model.compute_logits(hidden)
    assert hidden.dtype == torch.float32 and logits.dtype == torch.float32


def test_recipe_decodes_as_fp32_on_a_fixed_set(smollm, recipe_model, chat_prompts, smollm_tokenizer):
    """The first 4 prompts batched, and the README's question alone (where pure bf16 has
    been seen to answer "L'Étoile, la Marseillaise, ..." on an AMX Xeon)."""
    batch = chat_prompts[:4]
    assert greedy_runner(recipe_model, batch, NEW_TOKENS) == greedy_runner(smollm.model, batch, NEW_TOKENS)
    france = chat_prompts[:1]
    got = greedy_runner(recipe_model, france, NEW_TOKENS)
    assert got == greedy_runner(smollm.model, france, NEW_TOKENS)
    assert "Paris" in smollm_tokenizer.decode(got[0])


def test_exact_top_logits_match_an_fp32_output_gemm():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(500, 64, generator=g) * 0.5
    weight[1] = weight[0] * 1.002       # column 1 beats column 0 by 0.2%: under a bf16 ulp (0.4-0.8%)
    weight = weight.bfloat16()
    hidden = weight[0].float() * 2 + torch.randn(16, 64, generator=g) * 0.1  # columns 0, 1 on top
    exact = hidden @ weight.float().T                                        # an fp32-output GEMM
    logits = (hidden.bfloat16() @ weight.T).float()                          # a bf16-output one
    assert (logits.argmax(-1) != exact.argmax(-1)).any()                     # rounding flips picks
    got = exact_top_logits(logits.clone(), hidden, weight)
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    top = logits.amax(-1, keepdim=True)
    near = logits >= top - top.abs() * 2.0 ** -6
    assert near.sum() < 4 * len(hidden)                                      # a few per row
    torch.testing.assert_close(got[near], exact[near], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[~near], logits[~near])                            # the rest untouched


def test_residual_dtype_choice():
    assert choose_residual_dtype("auto", torch.bfloat16, "cpu")[0] == torch.float32
    assert choose_residual_dtype("auto", torch.float32, "cpu")[0] == torch.float32
    assert choose_residual_dtype("auto", torch.bfloat16, "cuda")[0] == torch.bfloat16
    assert choose_residual_dtype("bfloat16", torch.bfloat16, "cpu")[0] == torch.bfloat16
    assert choose_residual_dtype("bf16", torch.bfloat16, "cpu")[0] == torch.bfloat16
    assert "fp32 residual" in choose_residual_dtype("auto", torch.bfloat16, "cpu")[1]
