"""A GGUF file's Q5_1, Q2_K and Q3_K tensors and Phi-3's fused linears kept packed on the CPU
(issue 55): a tiny Phi-3 written with gguf-py's GGUFWriter, its fused attn_qkv in Q3_K, ffn_up
([gate; up]) in Q2_K, attn_output and ffn_down in Q5_1, the embedding and head in Q8_0. Loaded
with the default (packed) method, nothing of it is dequantized at load: the fused tensors are
their merged linears' segments, the embedding table is looked up in its blocks, and the
start-up line names each type. Logits against transformers loading the same file (it
dequantizes with gguf-py, in fp32): the prompt's rows take the fp32 tiles over exactly gguf-py's
values (1e-4); one decode row takes the int16 GEMV tiles where the build has them (their
x-rounding bound, tests/gpu/test_gguf_packed.py; 2e-3 on these logits)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from gpu.formats.gguf import _PER_BLOCK
from gpu.kernels.cpu import quant as cpu_quant
from gpu.loader.decoder import load_model
from tests.support.gguf_writing import _finish, _gguf_name, _writer
from tests.support.hf_models import hf_logits, make_hf_model, our_logits

Q = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(cpu_quant.kernels() is None, reason="the CPU quant kernels are not built")
IDS = [2, 17, 42, 99, 5, 150, 7, 63, 21, 88, 130, 1]
# (bytes a block, where its fp16 d is, whether a dmin follows it)
_K_BLOCKS = {Q.Q2_K: (84, 80, True), Q.Q3_K: (110, 108, False)}


def _k_blocks(qtype, rows: int, cols: int, rng) -> np.ndarray:
    """Random K-quant blocks (gguf-py cannot quantize them) with small fp16 scales."""
    bb, at, dmin = _K_BLOCKS[qtype]
    blocks = rng.integers(0, 256, (rows, cols // 256, bb), dtype=np.uint8)
    blocks[..., at:at + 2] = np.frombuffer(np.float16(0.004).tobytes(), np.uint8)
    if dmin:
        blocks[..., at + 2:at + 4] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


@pytest.fixture(scope="module")
def phi3_lowbit(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp("phi3-lowbit")
    hf = make_hf_model("phi3", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                       num_key_value_heads=4, head_dim=64)
    c, rng = hf.config, np.random.default_rng(0)
    path = tmp / "tiny-phi3-lowbit.gguf"
    w = _writer(path, "phi3", c)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(64)
    w.add_vocab_size(c.vocab_size)
    w.add_pad_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    fused = {"self_attn.qkv_proj": ("attn_qkv", Q.Q3_K), "mlp.gate_up_proj": ("ffn_up", Q.Q2_K),
             "self_attn.o_proj": ("attn_output", Q.Q5_1), "mlp.down_proj": ("ffn_down", Q.Q5_1)}
    for name, t in hf.state_dict().items():
        base, kind = name.rsplit(".", 1)
        part = next((v for h, v in fused.items() if base.endswith(h)), None)
        if part is None:
            gname = _gguf_name(name, _PER_BLOCK)
            qtype = Q.Q8_0 if gname in ("token_embd.weight", "output.weight") else None
        else:
            gname, qtype = f"blk.{base.split('.')[2]}.{part[0]}.{kind}", part[1]
        x = t.numpy()
        if qtype in _K_BLOCKS:
            w.add_tensor(gname, _k_blocks(qtype, *x.shape, rng), raw_dtype=qtype)
        elif qtype is not None:
            w.add_tensor(gname, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, x)
    _finish(w)
    ref = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=path.name, dtype=torch.float32).eval()
    return load_model(path, progress=False), ref


def test_lowbit_and_fused_tensors_stay_packed(phi3_lowbit):
    loaded, _ = phi3_lowbit
    lm, c = loaded.model, loaded.config
    attn, mlp = lm.layers[0].self_attn, lm.layers[0].mlp
    assert attn.qkv_proj.formats == (int(Q.Q3_K),) * 3 and attn.qkv_proj.rows == (c.q_size, c.kv_size, c.kv_size)
    assert mlp.gate_up_proj.formats == (int(Q.Q2_K),) * 2 and mlp.gate_up_proj.rows == (512, 512)
    assert attn.o_proj.formats == mlp.down_proj.formats == (int(Q.Q5_1),)
    assert isinstance(lm.embed_tokens, cpu_quant.PackedEmbedding) and isinstance(lm.lm_head, cpu_quant.PackedLinear)
    words = loaded.weights
    for kind in ("2 Q3_K", "2 Q2_K", "4 Q5_1", "2 Q8_0"):
        assert kind in words, words
    assert "at load" not in words, words   # nothing dequantized to fp32 at load


def test_packed_blocks_dequantize_as_gguf_py(phi3_lowbit):
    """Every quantized tensor of the GGUFWriter-made file: the blocks the packed linears hold
    (gpu/formats/gguf.py GGUFFile.packed), dequantized by the kernels, equal gguf-py's
    dequantization of the file's data, bit for bit."""
    from gpu.formats.gguf import GGUFFile

    f, k = GGUFFile(phi3_lowbit[0].path), cpu_quant.kernels()
    seen = set()
    for t in f.reader.tensors:
        if int(t.tensor_type) in cpu_quant.FORMATS:
            fmt, blocks = f.packed(t.name)
            cols = int(t.shape[0])
            want = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(-1, cols)
            assert np.array_equal(k.dequantize(fmt, blocks, cols).numpy(), want), t.name
            seen.add(t.tensor_type.name)
    assert seen == {"Q2_K", "Q3_K", "Q5_1", "Q8_0"}


def test_lowbit_logits_match_transformers(phi3_lowbit):
    loaded, ref = phi3_lowbit
    want = hf_logits(ref, IDS)
    torch.testing.assert_close(our_logits(loaded.model, IDS), want, atol=1e-4, rtol=1e-4)
    # one row: the decode path's tiles (the int16 GEMV tiles on an AVX2 build)
    one = our_logits(loaded.model, IDS[:1])
    assert (one - want[:1]).abs().max().item() < 2e-3


@pytest.fixture(scope="module")
def llama_lowbit(tmp_path_factory):
    """A tiny Llama GGUF whose qkv_proj mixes three of the formats (attn_q Q3_K, attn_k Q2_K,
    attn_v Q5_1), gate/up Q2_K/Q3_K, down Q5_1: the C decode stack's segments of mixed formats."""
    from tests.support.gguf_writing import _llama_cpp_permute

    tmp = tmp_path_factory.mktemp("llama-lowbit")
    hf = make_hf_model("llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, vocab_size=512)   # _run's prompts: ids 300-360
    c, rng = hf.config, np.random.default_rng(1)
    path = tmp / "tiny-llama-lowbit.gguf"
    w = _writer(path, "llama", c)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(64)
    w.add_vocab_size(c.vocab_size)
    kinds = {"attn_q": Q.Q3_K, "attn_k": Q.Q2_K, "attn_v": Q.Q5_1, "attn_output": Q.Q5_1,
             "ffn_gate": Q.Q2_K, "ffn_up": Q.Q3_K, "ffn_down": Q.Q5_1}
    for name, t in hf.state_dict().items():
        gname = _gguf_name(name, _PER_BLOCK)
        x = t.numpy()
        if ".attn_q." in gname or ".attn_k." in gname:   # llama.cpp's row order (the reader undoes it)
            x = _llama_cpp_permute(x, c.num_attention_heads if ".attn_q." in gname else c.num_key_value_heads)
        qtype = kinds.get(gname.split(".")[2]) if gname.startswith("blk.") else None
        if gname in ("token_embd.weight", "output.weight"):
            qtype = Q.Q8_0
        if qtype in _K_BLOCKS:
            w.add_tensor(gname, _k_blocks(qtype, *x.shape, rng), raw_dtype=qtype)
        elif qtype is not None:
            w.add_tensor(gname, gguf.quants.quantize(np.ascontiguousarray(x), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, x)
    _finish(w)
    return load_model(path, progress=False)


def test_c_decode_stack_takes_the_lowbit_formats(llama_lowbit):
    """A decode step in the C stack (gpu/kernels/cpu/layer.c) over mixed Q3_K/Q2_K/Q5_1 segments
    against the per-layer path: the same greedy tokens, logits within 5e-3 with the int16 GEMV
    tiles and with the fp32 ones (measured 1.0e-3 and 2.3e-3 on logits up to 6; the same model
    requantized to Q8_0 gives 6.5e-4: the C stack's norms, attention and SiLU against torch's on
    these random blocks' activations; the per-layer path is within 1e-5 of transformers)."""
    from tests.support.cpu_layer_runs import _Counting, _run

    lm = llama_lowbit.model
    assert lm.fused_decode is not None
    assert lm.layers[0].self_attn.qkv_proj.formats == (int(Q.Q3_K), int(Q.Q2_K), int(Q.Q5_1))
    counting = _Counting(lm.fused_decode._fn)
    lm.fused_decode._fn = counting
    k = cpu_quant.kernels()
    try:
        for gemv in (-1, 0):
            k.set_int16_gemv(gemv)
            counting.rcs.clear()
            got_tokens, got_logits, _ = _run(lm, True, 2, steps=2)
            assert counting.rcs == [0, 0]      # both decode steps ran in the C stack
            want_tokens, want_logits, _ = _run(lm, False, 2, steps=2)
            assert got_tokens == want_tokens
            scale = max(b.abs().max().item() for b in want_logits)
            err = max((a - b).abs().max().item() for a, b in zip(got_logits, want_logits))
            print(f"int16 GEMV {gemv}: max |logits - per-layer path's| {err:.2e}, logits up to {scale:.1f}")
            assert err < 5e-3
    finally:
        k.set_int16_gemv(-1)
        del lm.fused_decode._fn
