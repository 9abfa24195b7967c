"""A qwen3moe GGUF written with gguf-py's GGUFWriter (the tensors llama.cpp's converter
writes: ffn_gate_inp, the experts stacked as ffn_{gate,up,down}_exps, Q8_0 matrices): our
logits against transformers loading the same file (transformers.from_pretrained(gguf_file=))."""
import gguf
import numpy as np
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
}


def _write_qwen3moe(hf, path, qtype=Q.Q8_0):
    """hf as convert_hf_to_gguf.py writes a Qwen3MoeForCausalLM (no q/k permutation for qwen3)."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), "qwen3moe")
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
        if arr.ndim >= 2:
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
    # the CPU default: attention and LM head kept packed in Q8_0, the experts dequantized
    packed = load_model(tmp_path / "tiny-qwen3moe.Q8_0.gguf", progress=False)
    assert packed.weights.startswith("GGUF weights kept packed") and "experts dequantized" in packed.weights
    torch.testing.assert_close(our_logits(packed.model, IDS), want, atol=1e-3, rtol=1e-3)
