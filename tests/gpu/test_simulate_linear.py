"""The GPU stand-in's price of a hybrid linear-attention model (gpu/worker/simulate_linear.py)
on Qwen3-Next-80B-A3B's published config: the Gated DeltaNet layers' states read and written
per sequence a step, their projections' weights, the delta rule's fp32 FLOPs by chunk, K/V and
attention of the 12 full-attention layers only, eager kernels, the state pool taken from
the KV budget."""
from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
import torch

import gpu
from gpu.layers.linear_attention import StatePool
from gpu.models.registry import config_from_hf, model_class
from gpu.worker.simulate import GPUS, CostModel, kernels_per_step
from gpu.worker.simulate_linear import CHUNK

NEXT = config_from_hf(json.loads((Path(gpu.__file__).parent / "configs/qwen3-next-80b-a3b/config.json").read_text()))
H200 = GPUS["h200"]


def test_the_published_config_reads_as_36_linear_and_12_full_layers():
    assert (NEXT.num_linear_layers, NEXT.num_kv_layers) == (36, 12)
    cost = CostModel.of(NEXT, H200)
    # K/V of the full-attention layers only: 12 x 2 x 2 heads x 256 x bf16
    assert cost.kv_bytes_per_token == 12 * 2 * 2 * 256 * 2
    assert cost.num_layers == 12
    # the stand-in's state a sequence is the engine's StatePool slot (bf16 conv, fp32 recurrent)
    assert cost.linear.state_bytes == StatePool.bytes_per_slot(NEXT, torch.bfloat16)
    assert cost.linear.state_bytes == 36 * (32 * 128 * 128 * 4 + 8192 * 3 * 2)
    # every nn.Linear of the model built on the meta device (experts aside: stacked tensors)
    dense = attrs.evolve(NEXT, num_experts=0, num_experts_per_tok=0, intermediate_size=512,
                         moe=attrs.evolve(NEXT.moe, shared_intermediate_size=0, shared_gate=False))
    model = model_class(dense)(dense, torch.bfloat16, "meta")
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert CostModel.of(dense, H200).matmul_params == linear
    assert 79e9 < cost.matmul_params < 80e9          # the 80B's weights, the embedding aside


def test_a_decode_step_reads_and_writes_each_sequences_state():
    cost = CostModel.of(NEXT, H200)
    state = cost.linear.state_bytes
    one, many = (cost.step_seconds([1] * n, [100] * n, n) for n in (1, 255))
    # 254 more sequences: their states in and out (at the state efficiency) dominate the
    # extra KV, logits and expert weights
    assert many - one >= 254 * 2 * state / (H200.bandwidth * H200.state_efficiency)
    assert cost.linear.seconds([1] * 256, 1.0, 1e30) == 256 * 2 * state
    # eager: the CUDA path captures no graphs for a hybrid model
    forward, outside = kernels_per_step(NEXT, decode=True)
    assert (forward, outside) == kernels_per_step(NEXT, decode=False) == cost.eager_kernels
    assert cost.launch_seconds([1] * 8) == pytest.approx((forward + outside) * 6e-6 + 50e-6)


def test_a_prefill_costs_the_delta_rules_flops_by_chunk():
    lin = CostModel.of(NEXT, H200).linear
    assert lin.flops(2) == lin.flops(CHUNK) and lin.flops(CHUNK + 1) == 2 * lin.flops(CHUNK)
    assert lin.flops(1) == 36 * 32 * 7 * 128 * 128
    # a long prefill's mixers are the fp32 arithmetic, not the state's bytes
    t = lin.seconds([8192], H200.bandwidth, H200.fp32_flops)
    assert t == pytest.approx(lin.flops(8192) / 67e12) and t > 2 * 2 * lin.state_bytes / H200.bandwidth


def test_the_state_pool_comes_out_of_the_kv_budget():
    cost = CostModel.of(NEXT, H200, weights="fp8")
    block = cost.kv_bytes_per_token * 16
    free, pooled = cost.kv_blocks(16, 0.9), cost.kv_blocks(16, 0.9, state_slots=512)
    assert free - pooled == pytest.approx(512 * cost.linear.state_bytes / block, abs=1)
