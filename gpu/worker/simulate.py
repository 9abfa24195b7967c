"""A GPU stand-in: the model's forward replaced by a timed wait from a cost model.

`--simulate-gpu h200` runs everything else for real (scheduler, block manager, input
preparation, sampler bookkeeping, every stage, HTTP) and measures whether the host can
keep a GPU of that speed fed. The wait is `time.sleep` in the runner's worker thread,
which releases the GIL as a real device wait does.

The cost of one step of a model in bf16 (or its linears in a pre-quantized format's bytes,
WEIGHT_BYTES, at the same bf16 peak: decode is bandwidth-bound) on a GPU with memory bandwidth BW and dense
bf16 peak P (a roofline), plus what the step's kernels cost for being many:

    bytes = weights read once                    (every matmul weight + the lm_head)
          + KV of every scheduled sequence / E    (its whole context, new tokens included;
                                                   E the attention's bandwidth efficiency)
          + the logits of the sampled rows        (bf16, written and read once)
    flops = 2 * matmul params * tokens + 4 * layers * q_heads * head_dim * sum(q_len * ctx_len)
    step  = max(bytes / BW, flops / P)
          + graph kernels * GRAPH_KERNEL + eager kernels * EAGER_KERNEL + STEP_FIXED

H200 SXM (NVIDIA's datasheet): 141 GB HBM3e at 4.8 TB/s, 989 TFLOP/s dense bf16
(1,979 with sparsity), 67 TFLOP/s fp32 on the CUDA cores.

A hybrid linear-attention model (Qwen3-Next, Qwen3.5): KV, attention FLOPs and kernels of its
full-attention layers only; its Gated DeltaNet layers' weights, their per-sequence states'
traffic and the delta rule's fp32 arithmetic, and its eager kernels (the CUDA path captures no
graphs for it) as gpu/worker/simulate_linear.py prices them.

The kernels are counted from the model's structure as the CUDA path runs it
(`kernels_per_step`): per layer two residual-add RMSNorms, the qkv and o projections, the
fused q/k-norm + RoPE + KV-write kernel, paged attention (and its split combine at small
decode batches), gate_up, SiLU-and-mul and down (a gpt-oss layer's MoE about 30 torch ops,
counted from gpu/layers/moe.py); then the embedding and the final norm. A pure decode step replays
them as one CUDA graph after 6 copies into its static buffers; outside the graph, eagerly:
the 2 staging copies, the lm_head, the sampled rows' gather, 5 sampling kernels and the
tokens' copy back. With speculative decoding a verify step (up to K + 1 tokens a sequence)
replays a graph of its own after 11 copies and fills (gpu/worker/cuda_graphs.py VerifyGraphs;
`verify_tokens`). Prefill and mixed steps launch everything eagerly. Qwen3-0.6B: 254
kernels in the graph at a large decode batch (9 a layer; 14 without the fused kernel,
about 400 in all as issue 26's read-through counted), 10 eager.

The numbers that are estimates, not measurements (no GPU has been lent to this project
yet; gpu_check.sh's first figure replaces them):
- GRAPH_KERNEL 2.5 us: issue 26's read-through estimates about 1 ms for about 400 kernels
  inside a graph, i.e. the launch gap between dependent kernels (about 1 us in a graph:
  NVIDIA, "Getting Started with CUDA Graphs", developer.nvidia.com/blog/cuda-graphs/)
  plus the ramp-up and tail of a kernel too small to fill 132 SMs.
- EAGER_KERNEL 6 us: a launch from Python (torch's dispatch or Triton's launcher, a few
  microseconds each) that the host pays while the device waits on kernels that short.
- STEP_FIXED 50 us: the host-to-device input copies, the tokens' device-to-host copy and
  the sync on it.
- E = 0.6 for decode attention: paged decode kernels read KV in 16-token pages through a
  block table; tuned CUDA kernels are reported at 80-90% of HBM bandwidth (FlashInfer's
  blog, flashinfer.ai/2024/02/02/introduce-flashinfer.html), simpler ones much less. Ours
  is Triton, unmeasured: 0.6, until gpu/kernels/triton/bench.py's of_peak for
  paged_attention_decode replaces it.
Before issue 26 the stand-in charged a flat 0.3 ms a step and E = 1: for Qwen3-0.6B at 256
sequences of nano-vllm's workload (context about 840) that was 5.6 ms a step; now 9.6
(0.25 ms of weights, 8.6 of KV at E = 0.6, 0.76 of kernels, copies and sync).
"""
from __future__ import annotations

import math
import time
from itertools import accumulate

import attrs
import numpy as np
import torch

from gpu.config.model import ModelConfig
from gpu.config.names import SIMULATED_GPUS
from gpu.interface import StagingRunner, StepPlan, StepResult, TokenLogprobs
from gpu.worker.staging import (BlockTables, HostInputs, StagedTokens, float_chunks, last_token, stage_plan,
                         upload_inputs)
from gpu.worker.sampler import SeqSamplingState
from gpu.worker.simulate_linear import LinearCost, hybrid_kernels, mixer_params


@attrs.frozen
class GpuSpec:
    name: str
    memory_bytes: float
    bandwidth: float            # bytes/s
    bf16_flops: float           # dense, FLOP/s
    graph_kernel_s: float       # a kernel replayed inside a CUDA graph (decode steps)
    eager_kernel_s: float       # a kernel launched from Python (prefill, mixed, outside the graph)
    step_fixed_s: float         # input copies in, the tokens' copy out, the sync on it
    attention_efficiency: float  # decode attention's share of the bandwidth
    sm_count: int = 132         # decode graphs split the KV below 2 x SMs programs
    fp32_flops: float = 67e12   # CUDA cores (the delta rule's "ieee" dots run there)
    state_efficiency: float = 0.6   # a hybrid's state reads/writes (Triton, unmeasured: as E)


GPUS = {
    # estimates and their sources: the module's docstring
    "h200": GpuSpec("H200", memory_bytes=141e9, bandwidth=4.8e12, bf16_flops=989e12,
                    graph_kernel_s=2.5e-6, eager_kernel_s=6e-6, step_fixed_s=50e-6,
                    attention_efficiency=0.6),
}

assert tuple(GPUS) == SIMULATED_GPUS

MOE_KERNELS = 30   # gpu/moe.MoE.forward: torch ops one kernel each, the sort as 3
SAMPLING_KERNELS = 5
MLA_EXTRA_KERNELS = 9   # gpu/layers/mla.py's ops beyond a plain layer's qkv, prep and attention   # the threshold, the race, the chunks' argmax and gather, steps += 1


def kernels_per_step(config: ModelConfig, *, decode: bool, kv_splits: bool = False,
                     fused_qkv: bool = True, verify: bool = False) -> tuple[int, int]:
    """(in the model's forward, outside it) kernels of one step on the CUDA path, counted
    from gpu/models/causal_lm.py: a decode step's forward is one graph replay, so is a verify step's
    (`verify`: gpu/worker/cuda_graphs.py VerifyGraphs), the rest eager."""
    c = config
    outside = 2 + 1 + 1 + SAMPLING_KERNELS + 1   # staging, lm_head, row gather, sampling, D2H
    if c.num_linear_layers:                      # no graphs: every step eager
        return hybrid_kernels(c, MOE_KERNELS), outside
    if fused_qkv:
        qkv = 1                                  # gpu/kernels/triton/qkv_prep.py
    else:                                        # norms on reshaped copies, rope, write_kv
        qkv = (2 + 2 if c.qk_norm else 0) + 2
    attention = 2 + qkv + 1 + int(kv_splits)     # qkv/o GEMMs, prep, attention
    if c.kv_lora_rank:    # gpu/layers/mla.py: q down, norm, up; kv down, norm; rope; absorb; 2 cats; write; out
        attention += MLA_EXTRA_KERNELS
    L = c.num_hidden_layers
    moe_layers = sum(c.is_moe_layer(i) for i in range(L))
    shared = 4 if c.moe.shared_intermediate_size else 0       # gate_up, act, down, add
    forward = 2 + L * (2 + attention) + moe_layers * (MOE_KERNELS + shared) + (L - moe_layers) * 3
    if decode:
        forward += 6                             # cuda_graphs.run: 4 copies, 2 fills
    elif verify:
        forward += 11                            # VerifyGraphs.load: 5 copies, 6 fills
    return forward, outside
_KV_RESERVE_BYTES = 2 << 30     # as the CUDA path keeps for activations and graphs


# Bytes a decoder linear's weight costs to read, by the pre-quantized format's CUDA layout
# (gpu/quantization/cuda_linear.py; the LM head and embeddings stay bf16):
#   fp8    1 byte + an fp32 scale per row and 128 columns (fp8_gemm's per-row form)
#   w4a16  half a byte + an fp32 scale and a uint8 zero per 128-column group (wna16_gemm)
#   w8a16  a byte + the same per group
#   w8a8   a byte + one fp32 scale a row (int8_gemm; ~0 per weight at K in the thousands)
WEIGHT_BYTES = {"bf16": 2.0, "fp8": 1 + 4 / 128, "w4a16": 0.5 + 5 / 128, "w8a16": 1 + 5 / 128, "w8a8": 1.0}


@attrs.frozen
class CostModel:
    """What one step of `config` costs on `gpu`: bf16, or its decoder linears in a
    pre-quantized format's bytes (`linear_bytes`) and the KV cache in fp8 (kv_bytes_per_token)."""
    gpu: GpuSpec
    num_layers: int
    num_q_heads: int
    head_dim: int
    vocab_size: int
    matmul_params: int          # every weight read by a matmul: layers' projections + lm_head
    kv_bytes_per_token: int
    elem_bytes: int = 2         # bf16
    # Mixture of experts (gpt-oss): matmul_params counts every expert (they are all held);
    # a token runs top_k of them, and a step reads only the experts its tokens route to.
    expert_params: int = 0      # one expert's weights, all layers
    num_experts: int = 0
    top_k: int = 0
    num_kv_heads: int = 1
    # kernels_per_step: (forward, outside) for decode steps without and with KV splits,
    # and for prefill/mixed steps
    decode_kernels: tuple[int, int] = (0, 0)
    split_decode_kernels: tuple[int, int] = (0, 0)
    eager_kernels: tuple[int, int] = (0, 0)
    verify_kernels: tuple[int, int] = (0, 0)
    # speculative decoding with CUDA graphs: K + 1, the tokens a sequence of the verify
    # steps' graphs (pipeline/core/startup.verify_graph_tokens); 0: verify steps run eagerly
    verify_tokens: int = 0
    # bytes a decoder linear's weight is read in (WEIGHT_BYTES); the LM head's stay elem_bytes
    linear_bytes: float = 2.0
    head_params: int = 0
    # a hybrid linear-attention model's Gated DeltaNet layers (gpu/worker/simulate_linear.py);
    # graphs False: every step's kernels launched eagerly (the CUDA path captures none for it)
    linear: LinearCost | None = None
    graphs: bool = True

    @classmethod
    def of(cls, config: ModelConfig, gpu: GpuSpec, weights: str = "bf16", kv_elem_bytes: int = 2) -> "CostModel":
        """weights: a WEIGHT_BYTES key (the checkpoint's format: gpu/quantization/config.py
        stand_in_format); kv_elem_bytes: 1 for --kv-cache-dtype fp8."""
        if weights not in WEIGHT_BYTES:
            raise ValueError(f"no cost for {weights!r} weights; known: {', '.join(WEIGHT_BYTES)}")
        c = config
        L, D = c.num_hidden_layers, c.hidden_size
        mlp = 3 * D * c.intermediate_size                   # one expert's (or the dense MLP's) weights
        moe_layers = sum(c.is_moe_layer(i) for i in range(L))
        mlps = (moe_layers * (mlp * c.num_experts + 3 * D * c.moe.shared_intermediate_size)
                + (L - moe_layers) * 3 * D * c.dense_intermediate_size)
        # the cache: K and V per KV head, or MLA's one latent row (V a view of it)
        cached = c.kv_cache_head_dim if c.kv_lora_rank else 2 * c.kv_size
        # attention FLOPs a (query, key) pair and head: q.k and p.v widths (MLA: absorbed, over the latent)
        widths = c.kv_cache_head_dim + c.kv_cache_latent if c.kv_lora_rank else 2 * c.head_dim
        # num_layers: those that attend over a KV cache (all but a hybrid's linear ones)
        return cls(gpu=gpu, num_layers=c.num_kv_layers, num_q_heads=c.num_attention_heads,
                   head_dim=widths // 2, vocab_size=c.vocab_size,
                   matmul_params=mixer_params(c) + mlps + c.vocab_size * D,
                   kv_bytes_per_token=kv_elem_bytes * (c.num_kv_layers * cached
                                                       if (shapes := getattr(c, "kv_layer_shapes", None)) is None
                                                       else sum(2 * h * d for h, d in filter(None, shapes))),
                   linear=LinearCost.of(c), graphs=not c.num_linear_layers,
                   linear_bytes=WEIGHT_BYTES[weights], head_params=c.vocab_size * D,
                   expert_params=moe_layers * mlp if c.num_experts else 0,
                   num_experts=c.num_experts, top_k=c.num_experts_per_tok,
                   num_kv_heads=1 if c.kv_lora_rank else c.num_key_value_heads,
                   decode_kernels=kernels_per_step(c, decode=True),
                   split_decode_kernels=kernels_per_step(c, decode=True, kv_splits=True),
                   eager_kernels=kernels_per_step(c, decode=False),
                   verify_kernels=kernels_per_step(c, decode=False, verify=True))

    def read_bytes(self, params: int) -> float:
        """Bytes of `params` matmul weights, the LM head's among them."""
        return (params - self.head_params) * self.linear_bytes + self.head_params * self.elem_bytes

    @property
    def weight_bytes(self) -> int:
        return int(self.read_bytes(self.matmul_params))

    @property
    def active_params(self) -> int:
        """Matmul weights one token runs through (all of them for a dense model)."""
        return self.matmul_params - (self.num_experts - self.top_k) * self.expert_params

    def launch_seconds(self, q_lens: list[int], eager: bool = False) -> float:
        """What the step's kernels cost for being many (module docstring); eager: launched
        one by one whatever the step (--enforce-eager's draft model forwards)."""
        g = self.gpu
        if eager or not self.graphs:
            forward, outside = self.eager_kernels
            return (forward + outside) * g.eager_kernel_s + g.step_fixed_s
        if all(q == 1 for q in q_lens):
            # the captured graphs split the KV when sequences x KV heads cannot fill the
            # SMs twice (paged_attention.suggest_num_kv_splits)
            split = len(q_lens) * self.num_kv_heads < 2 * g.sm_count
            forward, outside = self.split_decode_kernels if split else self.decode_kernels
            return forward * g.graph_kernel_s + outside * g.eager_kernel_s + g.step_fixed_s
        if self.verify_tokens and max(q_lens) <= self.verify_tokens:   # a verify graph's replay
            forward, outside = self.verify_kernels
            return forward * g.graph_kernel_s + outside * g.eager_kernel_s + g.step_fixed_s
        forward, outside = self.eager_kernels
        return (forward + outside) * g.eager_kernel_s + g.step_fixed_s

    def step_seconds(self, q_lens: list[int], ctx_lens: list[int], num_sampled: int,
                     eager: bool = False) -> float:
        """One step: q_lens new tokens per sequence, ctx_lens its context including them."""
        tokens = sum(q_lens)
        kv = self.kv_bytes_per_token * sum(ctx_lens) / self.gpu.attention_efficiency
        logits = 2 * self.elem_bytes * num_sampled * self.vocab_size   # bf16, no fp32 copy
        attention = 4 * self.num_layers * self.num_q_heads * self.head_dim * sum(
            q * c for q, c in zip(q_lens, ctx_lens))
        idle_experts = self.num_experts - min(self.num_experts, self.top_k * tokens)  # at best
        read_params = self.matmul_params - idle_experts * self.expert_params
        flops = 2 * self.active_params * tokens + attention
        g = self.gpu
        mixers = (self.linear.seconds(q_lens, g.bandwidth * g.state_efficiency, g.fp32_flops)
                  if self.linear is not None else 0.0)
        return max((self.read_bytes(read_params) + kv + logits) / g.bandwidth, flops / g.bf16_flops) \
            + mixers + self.launch_seconds(q_lens, eager)

    def kv_blocks(self, block_size: int, gpu_memory_utilization: float, state_slots: int = 0) -> int:
        """KV cache blocks the GPU would hold, sized as the CUDA path sizes them: after a
        hybrid model's state pool of `state_slots` slots (running sequences + snapshots)."""
        states = self.linear.state_bytes * state_slots if self.linear is not None else 0
        budget = (self.gpu.memory_bytes * gpu_memory_utilization - self.weight_bytes
                  - _KV_RESERVE_BYTES - states)
        return max(1, int(budget // (self.kv_bytes_per_token * block_size)))


def ordinary_token_ids(tokenizer, vocab_size: int) -> np.ndarray:
    """Every id a model could emit as text: in both vocabularies, not special, not added."""
    if tokenizer is None:
        return np.arange(vocab_size)
    added = set(tokenizer.hf.get_added_tokens_decoder()) | tokenizer.all_special_ids
    n = min(vocab_size, tokenizer.vocab_size)
    return np.array([i for i in range(n) if i not in added])


@attrs.frozen
class StandInDraft:
    """A drafter with forwards to price on the stand-in: a draft model (method draft_model)
    or an EAGLE/EAGLE3 head. `model`: what its forwards cost (a head: its layer and LM head
    over the draft vocabulary, as a one-layer model, with EAGLE3's fc over the aux states
    and its layer's qkv over twice the width, or EAGLE's fc); `cost`: a draft model's
    multiply-adds a token over the target's (as DraftModel.cost: the gate's bound; None for
    a head, whose cost the gate measures); `head`: an EAGLE head, which reads a verified
    run's target states again (its first forward of a step: a verify-shaped graph's replay
    where each sequence has at most K + 1 to read)."""
    model: CostModel
    cost: float | None
    head: bool = False

    @classmethod
    def of(cls, spec, target: ModelConfig, gpu: GpuSpec) -> "StandInDraft | None":
        """--speculative-config's draft model or head on the stand-in (its config alone;
        None for n-gram), checked against the target as a real one is."""
        if spec is None or spec.method not in ("draft_model", "eagle", "eagle3"):
            return None
        if spec.method != "draft_model":
            from gpu.worker.spec_decode.eagle import read_head
            head = read_head(spec.model, spec.method, target, weights=False)
            c = head.layer
            model = CostModel.of(attrs.evolve(c, vocab_size=head.draft_vocab_size), gpu)
            fc = (len(head.aux_layer_ids) * head.target_hidden_size if head.kind == "eagle3"
                  else 2 * c.hidden_size) * c.hidden_size
            wide_qkv = c.hidden_size * (c.q_size + 2 * c.kv_size) if head.kind == "eagle3" else 0
            return cls(attrs.evolve(model, matmul_params=model.matmul_params + fc + wide_qkv),
                       None, head=True)
        from gpu.worker.spec_decode.draft import check_draft
        from gpu.loader.decoder import load_shell

        try:
            config = load_shell(spec.model).config
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"--speculative-config: cannot read the draft model {spec.model}: {exc}") from exc
        check_draft(target, config, spec.model)
        return cls(CostModel.of(config, gpu), config.macs_per_token / target.macs_per_token)


class SimulatedRunner(StagingRunner):
    """ModelRunner's interface; the forward is a wait of the cost model's length.

    Input preparation and the per-sequence sampling state are the real ones; sampled
    tokens are uniform over the tokenizer's ordinary tokens (seeded), so detokenize
    through emit do real work on real text.
    """

    def __init__(self, cost: CostModel, block_size: int, token_ids: np.ndarray, seed: int = 0,
                 draft_acceptance: float = 0.0, draft: StandInDraft | None = None,
                 floating: bool = False, ngram=None) -> None:
        self.cost = cost
        # drafts hold with `draft_acceptance` (StandInDrafter); a draft model's forwards are
        # priced too (`draft_seconds`), else drafts cost nothing to make (n-gram lookup);
        # with the target's graphs (verify_tokens: not --enforce-eager) as replays of its
        # own graphs, as gpu/worker/spec_decode/draft.py captures them, else launched eagerly
        if draft is not None and cost.verify_tokens:
            draft = attrs.evolve(draft, model=attrs.evolve(draft.model, verify_tokens=cost.verify_tokens))
        self.draft = draft
        self.draft_graphs = draft is not None and cost.verify_tokens > 0
        self.draft_kv: dict[str, int] = {}     # seq id -> positions the draft model holds KV of
        self.block_size = block_size
        self.device = torch.device("cpu")
        self.token_ids = token_ids
        self.rng = np.random.default_rng(seed)            # the tokens (drawn when staged)
        # the logprobs' alternatives, drawn in the runner thread: a generator of their own,
        # so the two threads never interleave draws from one (the tokens stay seeded)
        self.lp_rng = np.random.default_rng(seed + 1)
        self.states: dict[str, SeqSamplingState] = {}
        self.block_tables = BlockTables()
        self.staged_tokens = StagedTokens()
        self.waited_s = 0.0           # the sum of the waits: the stand-in's own ceiling
        # where the host time between waits goes (pipeline/tools/bench.py reports it): the
        # runner thread back late from its waits (the OS and the GIL: sleep's overshoot), and
        # waiting for the next plan between one wait's end and the next step's execute
        self.late_s = 0.0
        self.starved_s = 0.0
        self._woke: float | None = None
        # speculative decoding: each draft holds with this probability while those before
        # it held (a generator of its own, drawn in the runner thread)
        self.draft_acceptance = draft_acceptance
        self.accept_rng = np.random.default_rng(seed + 2)
        self.steps = 0
        # floating chunks (speculation planned ahead): the runner's lookup
        # (stages/schedule/drafter.py StandInDrafter) and where each KV ends
        self.floating = floating
        self.ngram = ngram
        self.next_pos: dict[str, int] = {}

    def stage(self, plan: StepPlan) -> tuple[HostInputs, float, list[int]] | None:
        """ModelRunner.stage: the host half of input preparation, ahead of the step. The
        cost model's wait and the step's random tokens (the device's work, which a real
        runner does not pay for on the host) are worked out here too."""
        host = stage_plan(plan, self.block_size, self.block_tables, self.staged_tokens)
        if host is None:
            return None
        num_sampled = len(host.sampled)
        # a verify pass costs its tokens, and its logits a row per draft as well
        rows = num_sampled + sum(c.num_drafts for c in plan.chunks if c.sample)
        wait = self.cost.step_seconds(host.q_lens, host.ctx_lens, rows) + self.draft_seconds(plan)
        return host, wait, self.rng.choice(self.token_ids, size=num_sampled).tolist()

    def draft_seconds(self, plan: StepPlan) -> float:
        """A draft model's or head's part of a step, as gpu/worker/spec_decode/draft.py and gpu/worker/spec_decode/eagle.py run
        it: one forward catching each drafting sequence's draft KV up (its prompt, the first
        time; a head's: the target states it has not read) with its first draft (a verify
        graph's replay where every sequence's is at most K + 1 tokens, a decode graph's
        where each is one), then one decode forward (a decode graph's
        replay) for each further draft of the sequences still drafting; each launched
        eagerly under --enforce-eager. 0 without a drafter to price or drafts."""
        drafting = [c for c in plan.chunks if c.num_drafts]
        if self.draft is None or not drafting:
            return 0.0
        m, eager = self.draft.model, not self.draft_graphs
        q = [c.start_pos + 1 - min(self.draft_kv.get(c.seq_id, 0), c.start_pos) for c in drafting]
        t = m.step_seconds(q, [c.start_pos + 1 for c in drafting], len(drafting), eager=eager)
        for j in range(1, max(c.num_drafts for c in drafting)):
            live = [c for c in drafting if c.num_drafts > j]
            t += m.step_seconds([1] * len(live), [c.start_pos + 1 + j for c in live], len(live),
                                eager=eager)
        return t

    def execute(self, plan: StepPlan, staged=None) -> StepResult:
        t0 = time.perf_counter()
        if self._woke is not None:
            self.starved_s += t0 - self._woke
            self._woke = None
        if staged is None:
            staged = self.stage(plan)
        for sid in plan.released:
            self.states.pop(sid, None)
            self.draft_kv.pop(sid, None)
            if self.floating:
                if self.ngram is not None:
                    self.ngram.forget(sid)
                self.next_pos.pop(sid, None)
        for ns in plan.new_seqs:
            self.states[ns.seq_id] = SeqSamplingState(ns.sampling, ns.prompt_token_ids, 0)
        if staged is None:
            return StepResult(plan.step, (), (), time.perf_counter() - t0)
        host, wait, tokens = staged
        floating = self.floating and any(c.floating for c in plan.chunks)
        if floating:     # as ModelRunner: the real starts and tokens, then the wait again
            plan, host = float_chunks(plan, host, self.block_size,
                                      lambda c: self.next_pos.get(c.seq_id, c.start_pos),
                                      self._float_tokens)
            rows = len(host.sampled) + sum(c.num_drafts for c in plan.chunks if c.sample)
            wait = self.cost.step_seconds(host.q_lens, host.ctx_lens, rows) + self.draft_seconds(plan)
        # the host's part of a step once the one before has ended: PLACEHOLDERs, upload
        upload_inputs(host, self.device, last_token=lambda sid: last_token(self.states, sid),
                      previous=self.staged_tokens.previous(host))
        seq_ids = host.sampled
        states = [self.states[s] for s in seq_ids]
        counts: tuple[int, ...] = ()
        if any(c.num_drafts for c in plan.chunks):
            if self.draft is not None:  # its KV written up to the last draft's position;
                # a head reads the target's states of the verified run again from the first
                for c in plan.chunks:
                    if c.num_drafts:
                        self.draft_kv[c.seq_id] = c.start_pos + (1 if self.draft.head else c.num_drafts)
            tokens, counts = self._verify(plan, tokens)
            states = [st for st, n in zip(states, counts) for _ in range(n)]
        logprobs = self._logprobs(states, tokens)
        for st, tok in zip(states, tokens):
            st.output_ids.append(tok)
        if counts:
            ends = list(accumulate(counts))
            self.staged_tokens.executed(plan.step, [tokens[e - 1] for e in ends])
        else:
            self.staged_tokens.executed(plan.step, tokens)
        if self.floating:
            sampled = [c for c in plan.chunks if c.sample]
            for c, n in zip(sampled, counts or (1,) * len(sampled)):
                self.next_pos[c.seq_id] = c.start_pos + (n if c.num_drafts else len(c.token_ids))
        # the device runs after the host has prepared and launched: wait from here
        slept = time.perf_counter()
        time.sleep(wait)
        self._woke = time.perf_counter()
        self.late_s += max(0.0, self._woke - slept - wait)
        self.waited_s += wait
        self.steps += 1
        return StepResult(plan.step, seq_ids, tuple(tokens), time.perf_counter() - t0,
                          logprobs=logprobs, num_tokens=counts,
                          num_drafts=tuple(c.num_drafts for c in plan.chunks if c.sample)
                          if floating else ())

    def _float_tokens(self, chunk) -> tuple[int, ...]:
        """ModelRunner._float_tokens with the stand-in's lookup (padded to the drafts asked)."""
        st = self.states[chunk.seq_id]
        last = st.output_ids[-1] if st.output_ids else 0
        if not chunk.num_drafts:
            return (last,)
        return (last, *self.ngram.propose(chunk.seq_id, [*st.prompt_ids, *st.output_ids],
                                          chunk.num_drafts))

    def _verify(self, plan: StepPlan, bonus: list[int]) -> tuple[list[int], tuple[int, ...]]:
        """Each sequence's drafts held one after another with probability draft_acceptance;
        the first that fails is replaced by its random token, and when all hold the random
        token follows them (the bonus)."""
        out: list[int] = []
        counts: list[int] = []
        p = self.draft_acceptance
        for c, tok in zip((c for c in plan.chunks if c.sample), bonus):
            drafts = c.token_ids[len(c.token_ids) - c.num_drafts:] if c.num_drafts else ()
            n = 0
            while n < len(drafts) and self.accept_rng.random() < p:
                n += 1
            out.extend(drafts[:n])
            out.append(tok)
            counts.append(n + 1)
            if c.num_drafts and c.seq_id in self.draft_kv:     # the verify cuts it back
                self.draft_kv[c.seq_id] = min(self.draft_kv[c.seq_id], c.start_pos + n + 1)
        return out, tuple(counts)

    def _logprobs(self, states: list[SeqSamplingState], tokens: list[int]
                  ) -> tuple[TokenLogprobs | None, ...]:
        """The uniform draw's own logprobs, for the requests that ask: every token
        log(1/N), the top-k the sampled token and k-1 others."""
        if all(st.opts.logprobs is None for st in states):
            return ()
        lp = -math.log(len(self.token_ids))
        out: list[TokenLogprobs | None] = []
        for st, tok in zip(states, tokens):
            k = st.opts.logprobs
            if k is None:
                out.append(None)
                continue
            if st.opts.logprob_token_ids:    # the sampled token, then the chosen ids
                top = tuple(dict.fromkeys((tok, *st.opts.logprob_token_ids)))
                out.append(TokenLogprobs(lp, top, (lp,) * len(top)))
                continue
            others = self.lp_rng.choice(self.token_ids, size=max(k - 1, 0)).tolist()
            top = (tok, *others)[:k]
            out.append(TokenLogprobs(lp, top, (lp,) * len(top)))
        return tuple(out)

