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


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after ids (no KV cache tricks: one full forward per token)."""
    out = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]
