"""PEFT adapters made in the test (issue 33): the oracle is the adapter merged into the base
weights (W + scale * B A), by peft's own merge_and_unload."""
from __future__ import annotations

import copy
from pathlib import Path

import torch


def make_adapter(hf_model, out_dir: Path, *, r: int, targets: list[str], alpha: float | None = None,
                 use_rslora: bool = False, seed: int = 0, std: float = 0.05,
                 train_ids: list[int] | None = None, steps: int = 0):
    """A PEFT LoRA adapter on a copy of `hf_model`, saved to out_dir; returns the merged model.
    B gets random nonzero values (`std`), and `steps` of SGD on `train_ids` if given, so the
    adapter really changes the outputs."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=alpha if alpha is not None else 2 * r, target_modules=targets,
                     lora_dropout=0.0, use_rslora=use_rslora, init_lora_weights=True)
    peft_model = get_peft_model(copy.deepcopy(hf_model), cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, std)
    if steps and train_ids:
        opt = torch.optim.SGD([p for n, p in peft_model.named_parameters() if "lora_" in n], lr=1e-2)
        ids = torch.tensor([train_ids])
        for _ in range(steps):
            loss = peft_model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
    peft_model.save_pretrained(str(out_dir), safe_serialization=True)
    return peft_model.merge_and_unload().eval()


def hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """n greedy tokens after ids and each one's logprob, through transformers' KV cache."""
    out, lps = [], []
    with torch.inference_mode():
        res = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            lp = torch.log_softmax(res.logits[0, -1].float(), dim=-1)
            tok = int(lp.argmax())
            out.append(tok)
            lps.append(float(lp[tok]))
            res = model(torch.tensor([[tok]]), past_key_values=res.past_key_values, use_cache=True)
    return out, lps


def hf_from_ours(model):
    """transformers' LlamaForCausalLM holding a loaded tailrace CausalLM's weights (fp32): the
    bundled SmolLM2 GGUF as an HF model, q/k/v and gate/up split back out of their merged
    projections."""
    import transformers

    mc = model.config
    assert mc.architecture == "llama" and mc.rope_scaling is None
    config = transformers.LlamaConfig(
        vocab_size=mc.vocab_size, hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
        num_hidden_layers=mc.num_hidden_layers, num_attention_heads=mc.num_attention_heads,
        num_key_value_heads=mc.num_key_value_heads, head_dim=mc.head_dim, rms_norm_eps=mc.rms_norm_eps,
        max_position_embeddings=mc.max_position_embeddings, tie_word_embeddings=mc.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": mc.rope_theta})
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(config)
    state = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight}
    if not mc.tie_word_embeddings:
        state["lm_head.weight"] = model.lm_head.weight
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        for name, w in zip(("q_proj", "k_proj", "v_proj"), attn.qkv_proj.weight.split(attn.split)):
            state[p + f"self_attn.{name}.weight"] = w
        state[p + "self_attn.o_proj.weight"] = attn.o_proj.weight
        gate, up = mlp.gate_up_proj.weight.chunk(2)
        state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"] = gate, up
        state[p + "mlp.down_proj.weight"] = mlp.down_proj.weight
        state[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        state[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
    state = {k: v.detach().float() for k, v in state.items()}   # shared: never written here
    hf.load_state_dict(state, strict=False, assign=True)
    if mc.tie_word_embeddings:
        hf.tie_weights()
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=config)   # off the meta device
    return hf.eval()
