"""The GPU stand-in (--simulate-gpu): its cost model's arithmetic, and tokens that are
real text. (The engine serving on it: tests/engine/test_engine_simulate.py.)"""
from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
import torch

import gpu
from gpu.models.registry import config_from_hf
from gpu.config.model import ModelConfig
from gpu.models.causal_lm import CausalLM
from gpu.interface import SamplingOptions, SeqChunk, SeqStart, StepPlan
from gpu.worker.simulate import GPUS, CostModel, SimulatedRunner, ordinary_token_ids

QWEN3 = config_from_hf(json.loads(
    (Path(gpu.__file__).parent / "configs/qwen3-0.6b/config.json").read_text()))
H200 = GPUS["h200"]


def test_weights_and_kv_sizes_of_qwen3_0_6b():
    cost = CostModel.of(QWEN3, H200)
    # counted independently: every nn.Linear weight of the model built on the meta device
    model = CausalLM(QWEN3, torch.bfloat16, "meta")
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert cost.matmul_params == linear == 595_984_384
    assert cost.weight_bytes == 1_191_968_768
    assert cost.kv_bytes_per_token == 28 * 2 * 8 * 128 * 2 == 114_688


def test_a_decode_step_reads_weights_once_and_every_sequences_kv():
    cost = CostModel.of(QWEN3, H200)
    step = cost.step_seconds([1] * 256, [1000] * 256, 256)
    weights, kv, logits = 1_191_968_768, 256 * 1000 * 114_688, 2 * 2 * 256 * 151_936
    # 260 kernels in the graph, 10 eager outside it, the copies and the sync
    launches = 260 * 2.5e-6 + 10 * 6e-6 + 50e-6
    assert step == pytest.approx((weights + kv / 0.6 + logits) / 4.8e12 + launches)
    assert 11e-3 < step < 11.5e-3
    # one sequence: the captured graph splits its KV (a combine kernel a layer more)
    assert cost.step_seconds([1], [1], 1) == pytest.approx(
        (weights + 114_688 / 0.6 + 4 * 151_936) / 4.8e12 + (260 + 28) * 2.5e-6 + 10 * 6e-6 + 50e-6)


def test_kernels_are_counted_from_the_models_structure():
    from gpu.worker.simulate import kernels_per_step
    # per layer: 2 norms, qkv and o GEMMs, the fused q/k-norm+rope+KV-write kernel, attention,
    # gate_up, silu_and_mul, down = 9; + embedding and final norm; + 6 graph input copies
    assert kernels_per_step(QWEN3, decode=True) == (2 + 28 * 9 + 6, 10)
    assert kernels_per_step(QWEN3, decode=False) == (2 + 28 * 9, 10)
    assert kernels_per_step(QWEN3, decode=True, kv_splits=True)[0] == 2 + 28 * 10 + 6
    # unfused: two reshape copies, two norms, rope and write_kv: about the 400 of issue 26
    assert kernels_per_step(QWEN3, decode=True, fused_qkv=False)[0] == 2 + 28 * 14 + 6 == 400
    llama = attrs.evolve(QWEN3, qk_norm=False)
    assert kernels_per_step(llama, decode=True, fused_qkv=False)[0] == 2 + 28 * 10 + 6


def test_a_verify_step_replays_its_graph_when_there_are_verify_graphs():
    """Speculative decoding with K = 3: a verify step of up to 4 tokens a sequence replays
    gpu/worker/cuda_graphs.py VerifyGraphs (254 kernels + 11 copies and fills in the graph); one
    with a longer chunk, or without verify graphs (--enforce-eager), launches eagerly."""
    from gpu.worker.simulate import kernels_per_step
    assert kernels_per_step(QWEN3, decode=False, verify=True) == (2 + 28 * 9 + 11, 10)
    eager, graphed = CostModel.of(QWEN3, H200), attrs.evolve(CostModel.of(QWEN3, H200), verify_tokens=4)
    fixed = 50e-6 + 10 * 6e-6
    assert graphed.launch_seconds([4, 2, 1]) == pytest.approx(265 * 2.5e-6 + fixed)
    assert graphed.launch_seconds([5, 1]) == eager.launch_seconds([4, 1]) == pytest.approx(254 * 6e-6 + fixed)
    assert graphed.launch_seconds([1, 1]) == eager.launch_seconds([1, 1])   # decode graphs either way
    # one stream, K = 3: the verify step now costs about what a decode step does
    decode, verify = graphed.step_seconds([1], [300], 1), graphed.step_seconds([4], [303], 4)
    assert verify < 1.05 * decode < eager.step_seconds([4], [303], 4) / 1.5


def test_a_long_prefill_is_compute_bound():
    cost = CostModel.of(QWEN3, H200)
    flops = 2 * 595_984_384 * 2048 + 4 * 28 * 16 * 128 * 2048 * 2048
    eager = (254 + 10) * 6e-6 + 50e-6          # every kernel launched from Python
    assert cost.step_seconds([2048], [2048], 1) == pytest.approx(flops / 989e12 + eager)


def test_kv_cache_is_sized_from_the_gpus_memory():
    cost = CostModel.of(QWEN3, H200)
    expected = (141e9 * 0.9 - 1_191_968_768 - 2**31) // (114_688 * 16)
    assert cost.kv_blocks(16, 0.9) == expected == 67_335


def test_simulated_tokens_are_ordinary_and_detokenize(smollm_tokenizer):
    tok = smollm_tokenizer
    ordinary = ordinary_token_ids(tok, 49152)
    assert not set(ordinary.tolist()) & set(tok.all_special_ids)
    assert len(ordinary) > 49_000
    runner = SimulatedRunner(CostModel.of(QWEN3, H200), 16, ordinary, seed=1)
    greedy = SamplingOptions(temperature=0.0)
    prompts = {"a": tuple(range(100, 140)), "b": tuple(range(200, 217))}
    plan = StepPlan(1, tuple(SeqChunk(s, p, 0, (0, 1, 2) if s == "a" else (3, 4), True)
                             for s, p in prompts.items()),
                    tuple(SeqStart(s, p, greedy) for s, p in prompts.items()))
    out = {s: [] for s in prompts}
    waits = 0.0
    for step in range(2, 12):
        result = runner.execute(plan)
        q = [len(c.token_ids) for c in plan.chunks]
        ctx = [c.start_pos + n for c, n in zip(plan.chunks, q)]
        waits += runner.cost.step_seconds(q, ctx, len(q))
        assert result.duration_s >= runner.cost.step_seconds(q, ctx, len(q))
        for sid, t in zip(result.seq_ids, result.token_ids):
            out[sid].append(t)
        plan = StepPlan(step, tuple(SeqChunk(s, (out[s][-1],), len(p) + len(out[s]) - 1,
                                             (0, 1, 2, 3) if s == "a" else (4, 5), True)
                                    for s, p in prompts.items()))
    assert runner.waited_s == pytest.approx(waits) and runner.steps == 10
    # the host's share, split: back late from the waits, and the gaps between one wait's
    # end and the next execute (this loop's own work: nine gaps)
    assert runner.late_s >= 0 and runner.starved_s > 0
    assert runner.states["a"].output_ids == out["a"]
    for toks in out.values():
        assert set(toks) <= set(ordinary.tolist())
        assert len(tok.decode(toks)) >= len(toks)   # ordinary tokens are at least a character


def test_a_draft_models_forwards_are_priced_as_gpu_draft_runs_them(smollm_tokenizer):
    """method draft_model on the stand-in: Qwen3-0.6B drafting for Qwen3-8B. A drafting
    step adds the draft's forwards: the first catches the draft KV up (the whole prompt the
    first time) with the first draft, then one decode forward a further draft; the next
    drafting step catches up only what the verify kept. Under --enforce-eager (no verify
    graphs) each is launched eagerly; with graphs, as gpu/worker/spec_decode/draft.py runs them, the decode
    forwards and a catch-up of at most K + 1 tokens a sequence replay the draft's own graphs
    (a prompt's catch-up is eager). The gate's bound comes from the configs; a draft of
    another vocabulary is refused."""
    from gpu.worker.spec_decode.draft import DraftError
    from gpu.worker.simulate import StandInDraft

    configs = Path(gpu.__file__).parent / "configs"
    target = config_from_hf(json.loads((configs / "qwen3-8b/config.json").read_text()))
    spec = attrs.make_class("Spec", ["method", "model"])("draft_model", str(configs / "qwen3-0.6b"))
    draft = StandInDraft.of(spec, target, H200)
    assert draft.cost == pytest.approx(QWEN3.macs_per_token / target.macs_per_token) and 0.05 < draft.cost < 0.1
    assert StandInDraft.of(attrs.evolve(spec, method="ngram"), target, H200) is None
    with pytest.raises(DraftError, match="vocabulary"):
        StandInDraft.of(attrs.evolve(spec, model=str(configs / "gpt-oss-tiny")), target, H200)

    for graphs in (False, True):
        cost = attrs.evolve(CostModel.of(target, H200), verify_tokens=4 if graphs else 0)
        runner = SimulatedRunner(cost, 16, ordinary_token_ids(smollm_tokenizer, 151936),
                                 seed=1, draft_acceptance=1.0, draft=draft)
        m, eager = runner.draft.model, not graphs
        assert runner.draft_graphs is graphs and m.verify_tokens == cost.verify_tokens
        prompt = tuple(range(100, 140))
        greedy = SamplingOptions(temperature=0.0)
        runner.execute(StepPlan(1, (SeqChunk("a", prompt, 0, (0, 1, 2, 3), True),), (SeqStart("a", prompt, greedy),)))
        assert runner.draft_seconds(StepPlan(2, (SeqChunk("a", (7,), 40, (0, 1, 2, 3), True),))) == 0.0
        verify = StepPlan(2, (SeqChunk("a", (7, 8, 9, 10), 40, (0, 1, 2, 3), True, num_drafts=3),))
        first = runner.draft_seconds(verify)
        assert first == pytest.approx(m.step_seconds([41], [41], 1, eager=True)    # a prompt: eager
                                      + m.step_seconds([1], [42], 1, eager=eager)
                                      + m.step_seconds([1], [43], 1, eager=eager))
        result = runner.execute(verify)
        assert result.num_tokens == (4,)                     # every draft held (P = 1)
        assert runner.draft_kv["a"] == 43                    # the last draft's KV is not written
        after = runner.draft_seconds(StepPlan(3, (SeqChunk("a", (11, 1, 2, 3), 44, (0, 1, 2, 3), True, num_drafts=3),)))
        assert after == pytest.approx(m.step_seconds([2], [45], 1, eager=eager)
                                      + m.step_seconds([1], [46], 1, eager=eager)
                                      + m.step_seconds([1], [47], 1, eager=eager))
        if graphs:      # a replay launches less than the eager forward: the catch-up's verify
            assert m.step_seconds([2], [45], 1) < m.step_seconds([2], [45], 1, eager=True)
            assert m.step_seconds([1], [42], 1) < m.step_seconds([1], [42], 1, eager=True)
            assert after < eager_after
        eager_after = after


def test_an_eagle3_heads_forwards_are_priced_from_its_config(smollm_tokenizer):
    """method eagle3 on the stand-in: the published gpt-oss-20b EAGLE3 speculator's config
    (gpu/configs/gpt-oss-20b-eagle3, speculators format; no weights) read and checked as a
    real head's. Its forwards cost its one layer (qkv over twice the width), fc over three
    aux states and its LM head over the 32000-token draft vocabulary; its first forward of
    a step reads the target states it has not read (after a verify, the verified run's
    again): eager for a prompt, a verify-shaped graph's replay for at most K + 1."""
    from gpu.worker.spec_decode.eagle import HeadError
    from gpu.worker.simulate import StandInDraft

    configs = Path(gpu.__file__).parent / "configs"
    target = config_from_hf(json.loads((configs / "gpt-oss-20b/config.json").read_text()))
    spec = attrs.make_class("Spec", ["method", "model"])("eagle3", str(configs / "gpt-oss-20b-eagle3"))
    head = StandInDraft.of(spec, target, H200)
    assert head.head and head.cost is None
    m = head.model
    H, q, kv, inter = 2880, 64 * 64, 8 * 64, 2880
    layer = H * (q + 2 * kv) + q * H + 3 * H * inter
    assert (m.num_layers, m.vocab_size) == (1, 32000)
    assert m.matmul_params == layer + 32000 * H + 3 * 2880 * H + H * (q + 2 * kv)
    qwen = config_from_hf(json.loads((configs / "qwen3-8b/config.json").read_text()))
    with pytest.raises(HeadError, match="vocabulary"):
        StandInDraft.of(spec, qwen, H200)
    with pytest.raises(HeadError, match="does not exist"):
        StandInDraft.of(attrs.evolve(spec, model=str(configs / "nothing-here")), target, H200)
    with pytest.raises(HeadError, match='use "method": "eagle3"'):
        StandInDraft.of(attrs.evolve(spec, method="eagle"), target, H200)

    cost = attrs.evolve(CostModel.of(target, H200), verify_tokens=4)
    runner = SimulatedRunner(cost, 16, ordinary_token_ids(smollm_tokenizer, 201088), seed=1,
                             draft_acceptance=1.0, draft=head)
    assert runner.draft.model.verify_tokens == 4 and runner.draft_graphs
    m = runner.draft.model
    prompt = tuple(range(100, 140))
    runner.execute(StepPlan(1, (SeqChunk("a", prompt, 0, (0, 1, 2, 3), True),),
                            (SeqStart("a", prompt, SamplingOptions(temperature=0.0)),)))
    verify = StepPlan(2, (SeqChunk("a", (7, 8, 9, 10), 40, (0, 1, 2, 3), True, num_drafts=3),))
    assert runner.draft_seconds(verify) == pytest.approx(
        m.step_seconds([41], [41], 1) + m.step_seconds([1], [42], 1) + m.step_seconds([1], [43], 1))
    assert m.step_seconds([41], [41], 1) == pytest.approx(m.step_seconds([41], [41], 1, eager=True))
    assert runner.execute(verify).num_tokens == (4,)
    assert runner.draft_kv["a"] == 41          # the verified run's 4 states are read again
    after = StepPlan(3, (SeqChunk("a", (11, 1, 2, 3), 44, (0, 1, 2, 3), True, num_drafts=3),))
    assert runner.draft_seconds(after) == pytest.approx(
        m.step_seconds([4], [45], 1) + m.step_seconds([1], [46], 1) + m.step_seconds([1], [47], 1))
    assert m.step_seconds([4], [45], 1) < m.step_seconds([4], [45], 1, eager=True)   # a replay


def test_quantized_linears_and_an_fp8_cache_are_priced_by_their_bytes():
    """The stand-in reads a pre-quantized checkpoint's decoder linears in its CUDA layout's
    bytes (the LM head stays bf16), and an fp8 KV cache in one byte a value."""
    from gpu.quantization.config import stand_in_format
    from gpu.worker.simulate import WEIGHT_BYTES

    bf16 = CostModel.of(QWEN3, H200)
    head = QWEN3.vocab_size * QWEN3.hidden_size
    for fmt in ("fp8", "w4a16", "w8a8"):
        q = CostModel.of(QWEN3, H200, weights=fmt)
        assert q.weight_bytes == int((bf16.matmul_params - head) * WEIGHT_BYTES[fmt] + head * 2)
        saved = (bf16.matmul_params - head) * (2 - WEIGHT_BYTES[fmt]) / H200.bandwidth
        assert q.step_seconds([1], [100], 1) == pytest.approx(bf16.step_seconds([1], [100], 1) - saved)
    assert WEIGHT_BYTES["w4a16"] == 0.5 + 5 / 128        # int4, an fp32 scale and a uint8 zero per 128
    fp8_kv = CostModel.of(QWEN3, H200, kv_elem_bytes=1)
    assert fp8_kv.kv_bytes_per_token * 2 == bf16.kv_bytes_per_token
    assert fp8_kv.kv_blocks(16, 0.9) >= 2 * bf16.kv_blocks(16, 0.9) - 1
    with pytest.raises(ValueError, match="no cost for 'nf4' weights"):
        CostModel.of(QWEN3, H200, weights="nf4")
    groups = lambda w, a=None: {"quant_method": "compressed-tensors", "config_groups": {  # noqa: E731
        "g": {"weights": w, "input_activations": a}}}
    assert [stand_in_format(c) for c in (
        None, {"quant_method": "fp8"}, {"quant_method": "awq", "bits": 4}, {"quant_method": "gptq", "bits": 8},
        groups({"type": "float", "num_bits": 8}), groups({"num_bits": 4}),
        groups({"num_bits": 8}, {"num_bits": 8}))] == ["bf16", "fp8", "w4a16", "w8a16", "fp8", "w4a16", "w8a8"]
