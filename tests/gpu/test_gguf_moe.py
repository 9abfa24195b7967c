"""A qwen3moe GGUF written with gguf-py's GGUFWriter (the tensors llama.cpp's converter
writes: ffn_gate_inp, the experts stacked as ffn_{gate,up,down}_exps, Q8_0 matrices): our
logits against transformers loading the same file (transformers.from_pretrained(gguf_file=))."""
import gguf
import numpy as np
import pytest
import torch

from gpu.loader.decoder import load_model
from tests.support.hf_models import hf_logits, our_logits
from tests.support.moe_models import make_moe_model

IDS = [3, 17, 42, 99, 5, 150, 7, 63, 21, 88, 130, 1, 64, 9, 33, 120, 77, 2, 45, 101]
Q = gguf.GGMLQuantizationType
_BLOCK = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def _write_qwen3moe(hf, path, qtype=Q.Q8_0, experts=None, arch="qwen3moe"):
    """hf as convert_hf_to_gguf.py writes a Qwen3MoeForCausalLM (no q/k permutation for qwen3),
    or with arch "qwen2moe" a Qwen2MoeForCausalLM (its shared expert and gate: ffn_*_shexp);
    experts: {GGUF tensor kind: (qtype, packed uint8 [E, rows, row_bytes])} written in place of
    hf's (gguf-py cannot quantize K-quants)."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    w.add_name("tiny-qwen3moe")
    w.add_vocab_size(c.vocab_size)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    tensors = []
    for name, t in hf.state_dict().items():
        arr = t.numpy()
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            tensors.append(({"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                             "lm_head.weight": "output.weight"}[name], arr))
            continue
        _, _, layer, rest = name.split(".", 3)
        base, kind = rest.rsplit(".", 1)
        if base == "mlp.experts":      # transformers 5 holds them stacked: [E, 2I, D], [E, D, I]
            if kind == "gate_up_proj":
                gate, up = np.split(arr, 2, axis=1)
                tensors += [(f"blk.{layer}.ffn_gate_exps.weight", gate), (f"blk.{layer}.ffn_up_exps.weight", up)]
            else:
                tensors.append((f"blk.{layer}.ffn_down_exps.weight", arr))
            continue
        tensors.append((f"blk.{layer}.{_BLOCK[base]}.{kind}", arr))
    for gname, arr in tensors:
        kind = gname.split(".")[-2]
        if experts and kind in experts:
            w.add_tensor(gname, experts[kind][1], raw_dtype=experts[kind][0])
        elif arr.ndim >= 2:
            data = gguf.quants.quantize(np.ascontiguousarray(arr), qtype)
            w.add_tensor(gname, data, raw_dtype=qtype)
        else:
            w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_qwen3moe_gguf_matches_transformers_loading_it(tmp_path):
    # moe_intermediate_size 768: transformers' GGUF reader does not read expert_feed_forward_length
    # (it keeps Qwen3MoeConfig's default, 768); ours does
    hf = make_moe_model("qwen3_moe_unnormed", moe_intermediate_size=768, norm_topk_prob=True)
    _write_qwen3moe(hf, tmp_path / "tiny-qwen3moe.Q8_0.gguf")
    import transformers

    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="tiny-qwen3moe.Q8_0.gguf", attn_implementation="eager", dtype=torch.float32).eval()
    loaded = load_model(tmp_path / "tiny-qwen3moe.Q8_0.gguf", dtype="float32", progress=False)
    c = loaded.config
    assert (c.architecture, c.num_experts, c.num_experts_per_tok, c.intermediate_size) == ("qwen3_moe", 8, 2, 768)
    assert c.moe.norm_topk_prob and c.qk_norm
    want = hf_logits(theirs, IDS)
    assert (want - hf_logits(hf, IDS)).abs().max() > 1e-4      # the file's Q8_0 rounding is in both
    torch.testing.assert_close(our_logits(loaded.model, IDS), want, atol=1e-4, rtol=1e-4)
    # the CPU default: attention, experts and LM head kept packed in Q8_0
    packed = load_model(tmp_path / "tiny-qwen3moe.Q8_0.gguf", progress=False)
    assert packed.weights.startswith("GGUF weights kept packed")
    assert "the experts of 2 of 2 mixture layers kept packed, each run on its routed rows only" in packed.weights
    torch.testing.assert_close(our_logits(packed.model, IDS), want, atol=1e-3, rtol=1e-3)


def _k_blocks(qtype, shape, seed):
    """Random K-quant blocks [*shape[:-1], row_bytes] with sane fp16 scales (d, and dmin for
    Q4_K/Q5_K, at their offsets in the block): values of a few hundredths."""
    size = {Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (*shape[:-1], shape[-1] // 256, size), dtype=np.uint8)
    d, dmin = (np.frombuffer(np.float16(v).tobytes(), np.uint8) for v in (0.002, 0.001))
    if qtype == Q.Q6_K:
        blocks[..., 208:210] = d
    else:
        blocks[..., 0:2], blocks[..., 2:4] = d, dmin
    return blocks.reshape(*shape[:-1], -1)


def test_k_quant_experts_stay_packed_and_match_their_dequantized_model(tmp_path):
    """Experts in Q4_K (gate), Q5_K (up) and Q6_K (down), the rest Q8_0: the CPU default keeps
    them packed (views of the file's blocks, one PackedLinear an expert and projection) and runs
    each on its routed rows; logits and the MoE layer's output against the same file loaded
    dequantized to fp32 (--quantization none), with the quant kernels' fp32 tiles."""
    from gpu.kernels.cpu import quant as cpu_quant
    from gpu.layers.moe import moe_reference
    from gpu.quantization.gguf_experts import GGUFExperts

    K = cpu_quant.kernels()
    if K is None:
        pytest.skip("the CPU quant kernels are not built")
    hf = make_moe_model("qwen3_moe_unnormed", hidden_size=256, moe_intermediate_size=256, num_experts=4)
    E, D, I = 4, 256, 256   # noqa: E741
    experts = {"ffn_gate_exps": (Q.Q4_K, _k_blocks(Q.Q4_K, (E, I, D), 1)),
               "ffn_up_exps": (Q.Q5_K, _k_blocks(Q.Q5_K, (E, I, D), 2)),
               "ffn_down_exps": (Q.Q6_K, _k_blocks(Q.Q6_K, (E, D, I), 3))}
    path = tmp_path / "tiny-qwen3moe.Q4_K_M.gguf"
    _write_qwen3moe(hf, path, experts=experts)
    packed = load_model(path, progress=False)
    plain = load_model(path, quantization="none", dtype="float32", progress=False)
    ex = packed.model.layers[1].mlp.experts
    assert isinstance(ex, GGUFExperts) and ex.formats == (int(Q.Q4_K), int(Q.Q5_K), int(Q.Q6_K))
    assert ex.packed_bytes == sum(a.nbytes for _, a in experts.values()) // E * E
    assert "the experts of 2 of 2 mixture layers kept packed" in packed.weights and "Q4_K (experts)" in packed.weights
    assert "dequantized to float32 at load" not in packed.weights.split("experts of")[1]
    gu, down = ex.dense_weights()
    torch.testing.assert_close(gu, plain.model.layers[1].mlp.experts.gate_up_proj, atol=0, rtol=0)
    torch.testing.assert_close(down, plain.model.layers[1].mlp.experts.down_proj, atol=0, rtol=0)
    K.set_int16(0)
    K.set_int16_gemv(0)
    try:
        x = torch.randn(9, D, generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            y, y_ref = packed.model.layers[1].mlp(x), moe_reference(plain.model.layers[1].mlp, x)
            # fp32 sums of 256 products in another order: within 2^-16 of the output's scale
            assert (y - y_ref).abs().max() <= 2 ** -16 * y_ref.abs().max()
            got, want = our_logits(packed.model, IDS), our_logits(plain.model, IDS)
    finally:
        K.set_int16(-1)
        K.set_int16_gemv(-1)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


def test_qwen2moe_shared_expert_and_experts_stay_packed(tmp_path):
    """A qwen2moe GGUF (q/k/v biases, a gated shared expert), Q8_0: the experts and the shared
    expert's linears kept packed, the logits equal to the file dequantized to fp32's."""
    from gpu.kernels.cpu import quant as cpu_quant
    from gpu.quantization.gguf_experts import GGUFExperts

    K = cpu_quant.kernels()
    if K is None:
        pytest.skip("the CPU quant kernels are not built")
    hf = make_moe_model("qwen2_moe", num_hidden_layers=2, decoder_sparse_step=1, shared_expert_intermediate_size=64)
    path = tmp_path / "tiny-qwen2moe.Q8_0.gguf"
    _write_qwen3moe(hf, path, arch="qwen2moe")
    packed = load_model(path, progress=False)
    plain = load_model(path, quantization="none", dtype="float32", progress=False)
    for layer in packed.model.layers:
        assert isinstance(layer.mlp.experts, GGUFExperts)
        assert isinstance(layer.mlp.shared_expert.gate_up_proj, cpu_quant.PackedLinear)
        assert isinstance(layer.mlp.shared_expert.down_proj, cpu_quant.PackedLinear)
    assert "the experts of 2 of 2 mixture layers kept packed" in packed.weights
    K.set_int16(0)
    K.set_int16_gemv(0)
    try:
        got, want = our_logits(packed.model, IDS), our_logits(plain.model, IDS)
    finally:
        K.set_int16(-1)
        K.set_int16_gemv(-1)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
