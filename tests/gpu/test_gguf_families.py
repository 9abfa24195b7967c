"""GGUF files of the families issue 55 adds, written with gguf-py's GGUFWriter as llama.cpp's
convert_hf_to_gguf.py writes them, from tiny random transformers checkpoints:
- Llama 3.x: llama3 RoPE scaling as a `rope_freqs` tensor (one factor a frequency), against
  the HF checkpoint it was written from (transformers' GGUF loader drops rope_freqs);
- Gemma 2 and Gemma 3: their norm names, (1 + w) norms, a SentencePiece vocabulary with byte
  fallback and runs of spaces; tokens and logits against transformers loading the same file.
"""
from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch

from gpu.formats.gguf import _GEMMA_BLOCK, _PER_BLOCK, _TOP_LEVEL
from gpu.loader.decoder import load_model
from tests.support.hf_models import hf_logits, make_hf_model, our_logits
from tests.support.gguf_writing import _finish, _gguf_name, _llama_cpp_permute, _spm_vocab, _writer

IDS = [2, 17, 42, 99, 5, 150, 7, 63, 21, 88, 130, 1, 64, 9, 33, 120, 77, 2, 45, 101]


def _llama3_rope_factors(theta: float, dim: int, factor: float, low: float, high: float, old: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors: 1 for short wavelengths,
    `factor` for long ones, 1 / ((1 - s) / factor + s) between."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_freqs_read_as_llama3_scaling(tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    hf = make_hf_model("llama", rope_parameters=rope, head_dim=16)
    c = hf.config
    path = tmp_path / "tiny-llama3.gguf"
    w = _writer(path, "llama", c)
    w.add_rope_freq_base(10000.0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_tensor("rope_freqs.weight", _llama3_rope_factors(10000.0, 16, 8.0, 1.0, 4.0, 16))
    for name, t in hf.state_dict().items():
        data = t.numpy()
        if name.endswith("q_proj.weight"):
            data = _llama_cpp_permute(data, c.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            data = _llama_cpp_permute(data, c.num_key_value_heads)
        w.add_tensor(_gguf_name(name, _PER_BLOCK), data)
    _finish(w)
    loaded = load_model(path, dtype="float32", progress=False)
    assert loaded.config.rope_scaling_dict["rope_type"] == "llama3"
    ids = IDS * 3      # 60 positions: past the original 16, where the scaling shows
    torch.testing.assert_close(our_logits(loaded.model, ids), hf_logits(hf, ids), atol=1e-4, rtol=1e-4)
    plain = make_hf_model("llama", head_dim=16)    # the same weights without the scaling differ
    assert not torch.allclose(hf_logits(plain, ids), hf_logits(hf, ids), atol=1e-3)


GEMMA_CASES = {
    "gemma2": dict(head_dim=256, num_hidden_layers=3, sliding_window=6, query_pre_attn_scalar=256,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma3": dict(head_dim=256, num_hidden_layers=7, sliding_window=6, query_pre_attn_scalar=256,
                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
}
TEXTS = ["Hello world", "The quick brown fox sat on the mat.", "  the  cat\n\nsat   on it",
         "<start_of_turn>user\nhello<end_of_turn>\n", "héllo wörld ✓", ""]


@pytest.mark.parametrize("arch", list(GEMMA_CASES))
def test_gemma_gguf_tokens_and_logits_match_transformers(arch, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = make_hf_model(arch, vocab_size=400, **GEMMA_CASES[arch])
    c = hf.config
    path = tmp_path / f"tiny-{arch}.gguf"
    w = _writer(path, arch, c)
    w.add_rope_freq_base(1e6 if arch == "gemma3" else 10000.0)
    w.add_sliding_window(c.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    tokens, types = _spm_vocab(c.vocab_size)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([-1000.0 if t == 3 else -float(i) for i, t in enumerate(types)])
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight":
            continue    # tied
        data = t.numpy() + (1.0 if name.endswith("norm.weight") else 0.0)   # as convert_hf_to_gguf stores Gemma's norms
        w.add_tensor(_gguf_name(name, _GEMMA_BLOCK), data.astype(np.float32))
    _finish(w)

    loaded = load_model(path, dtype="float32", progress=False)
    ref_tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in TEXTS:
        assert loaded.tokenizer.encode(text, add_special_tokens=True) == ref_tok(text).input_ids, text
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    assert loaded.config.layer_types == tuple(ref.config.layer_types)
    ids = ref_tok(TEXTS[1] + " " + TEXTS[0]).input_ids * 2
    torch.testing.assert_close(our_logits(loaded.model, ids), hf_logits(ref, ids), atol=1e-4, rtol=1e-4)
    # the file's weights are the checkpoint's: transformers' GGUF load gives its logits too
    torch.testing.assert_close(hf_logits(ref, ids), hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_q5_0_repacked_as_q8_0_holds_the_same_values():
    """K_M files' Q5_0 tensors (the fallback for rows not a multiple of 256) stay packed as
    Q8_0: the same fp16 scale, the 5-bit codes minus 16 as int8; gguf-py dequantizes both to
    the same floats."""
    from gpu.formats.gguf import q5_0_as_q8_0

    x = np.random.default_rng(0).standard_normal((6, 640)).astype(np.float32) * 3
    q5 = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q5_0)
    q8 = q5_0_as_q8_0(q5)
    assert q8.shape == (6, 640 // 32 * 34)
    np.testing.assert_array_equal(gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0),
                                  gguf.quants.dequantize(q5, gguf.GGMLQuantizationType.Q5_0))


def test_phi3_gguf_fused_tensors_match_transformers(tmp_path):
    """Phi-3's GGUF names (attn_qkv, ffn_up holding gate and up), against transformers loading
    the same file."""
    from transformers import AutoModelForCausalLM

    hf = make_hf_model("phi3", head_dim=16)
    c = hf.config
    path = tmp_path / "tiny-phi3.gguf"
    w = _writer(path, "phi3", c)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(16)
    w.add_vocab_size(c.vocab_size)    # a file without a vocabulary: transformers reads the size here
    w.add_pad_token_id(0)             # (Phi3Config's default, 32000, is past this vocabulary)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    to_gguf = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
    for name, t in hf.state_dict().items():
        base, kind = name.rsplit(".", 1)
        layer_part = next((g for h, g in to_gguf.items() if base.endswith(h)), None)
        gname = (f"blk.{base.split('.')[2]}.{layer_part}.{kind}" if layer_part
                 else _gguf_name(name, _PER_BLOCK))
        w.add_tensor(gname, t.numpy())
    _finish(w)
    loaded = load_model(path, dtype="float32", progress=False)
    assert loaded.config.architecture == "phi3"
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    torch.testing.assert_close(our_logits(loaded.model, IDS), hf_logits(ref, IDS), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(our_logits(loaded.model, IDS), hf_logits(hf, IDS), atol=1e-4, rtol=1e-4)
