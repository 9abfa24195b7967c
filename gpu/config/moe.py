"""How a mixture-of-experts layer routes and what its experts compute: one frozen spec per
model (ModelConfig.moe), read by gpu/layers/moe.py. Torch-free, as the rest of gpu/config.

The default is gpt-oss's (the first MoE tailrace ran): softmax over each token's top-k logits,
a router bias, experts with biases and a clamped SwiGLU. A family module sets the rest:

    Qwen3-MoE, Qwen2-MoE   softmax over all experts, top-k, renormalised when norm_topk_prob
    Mixtral                softmax, top-k, always renormalised (= softmax over the top-k logits)
    DeepSeek-V3, Kimi K2,  sigmoid scores; the choice adds e_score_correction_bias and keeps the
    GLM-4.5                topk_group best of n_group groups (a group's score: its two best);
                           the chosen scores renormalised, times routed_scaling_factor
    Llama 4                top-k logits, sigmoid, the score multiplies the expert's input

Shared experts (a dense SwiGLU MLP every token runs, optionally times a sigmoid gate) add to
the routed experts' sum; dense_layers lists the layers whose MLP is a plain dense one.
"""
from __future__ import annotations

import attrs

SCORINGS = ("softmax", "sigmoid")
ACTIVATIONS = ("swiglu", "clamped_swiglu")


@attrs.frozen
class MoESpec:
    scoring: str = "softmax"
    norm_topk_prob: bool = True          # renormalise the chosen k weights to sum to one
    router_bias: bool = True             # gpt-oss's router has a bias
    correction_bias: bool = False        # DeepSeek-V3's e_score_correction_bias (choice only)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    weight_on_input: bool = False        # Llama 4: the routing weight scales the expert's input
    activation: str = "clamped_swiglu"   # gpt-oss's (alpha, limit: ModelConfig.swiglu_*)
    expert_bias: bool = True             # biases on the experts' gate_up and down
    shared_intermediate_size: int = 0    # 0: no shared expert
    shared_gate: bool = False            # sigmoid(x w_g) times the shared expert (Qwen2-MoE)
    dense_layers: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    dense_intermediate_size: int = 0     # the dense layers' MLP (0: ModelConfig.intermediate_size)

    def __attrs_post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"unsupported MoE scoring {self.scoring!r}; supported: {', '.join(SCORINGS)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unsupported MoE activation {self.activation!r}; supported: {', '.join(ACTIVATIONS)}")
        if self.n_group < 1 or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group must be in 1..n_group ({self.n_group}), got {self.topk_group}")
        if self.n_group > 1 and self.scoring != "sigmoid":
            raise ValueError("grouped top-k (n_group > 1) is supported with sigmoid scoring only")


def dense_layers_from_hf(d: dict, num_layers: int) -> tuple[int, ...]:
    """The layers a config.json gives a dense MLP: DeepSeek-V3/GLM-4.5's first_k_dense_replace,
    Qwen-MoE's mlp_only_layers and decoder_sparse_step (a layer is sparse when (i + 1) % step
    == 0), Llama 4's moe_layers / interleave_moe_layer_step."""
    dense = set(d.get("mlp_only_layers") or ())
    dense |= set(range(min(int(d.get("first_k_dense_replace") or 0), num_layers)))
    step = int(d.get("decoder_sparse_step") or 1)
    dense |= {i for i in range(num_layers) if (i + 1) % step}
    if d.get("moe_layers") is not None:
        dense |= set(range(num_layers)) - set(d["moe_layers"])
    return tuple(sorted(i for i in dense if 0 <= i < num_layers))
