"""A GPU stand-in: the model's forward replaced by a timed wait from a cost model.

`--simulate-gpu h200` runs everything else for real (scheduler, block manager, input
preparation, sampler bookkeeping, every stage, HTTP) and measures whether the host can
keep a GPU of that speed fed. The wait is `time.sleep` in the runner's worker thread,
which releases the GIL as a real device wait does.

The cost of one step of a model in bf16 on a GPU with memory bandwidth BW and dense
bf16 peak P (a roofline, plus a fixed cost per step):

    bytes = weights read once                    (every matmul weight + the lm_head)
          + KV of every scheduled sequence        (its whole context, new tokens included)
          + the logits of the sampled rows        (written and read back once, fp32)
    flops = 2 * matmul params * tokens + 4 * layers * q_heads * head_dim * sum(q_len * ctx_len)
    step  = max(bytes / BW, flops / P) + STEP_OVERHEAD

H200 SXM (NVIDIA's datasheet): 141 GB HBM3e at 4.8 TB/s, 989 TFLOP/s dense bf16
(1,979 with sparsity). STEP_OVERHEAD is an estimate, not a measurement: a decode step of
a 28-layer model replayed as one CUDA graph runs about 300 kernels (about 10 per layer,
plus sampling), and inside a graph each costs about 1 µs of launch gap (NVIDIA, "Getting
Started with CUDA Graphs", developer.nvidia.com/blog/cuda-graphs/: graphs cut the
per-kernel launch cost of short kernels back to back from several µs to about 1), plus
the host-to-device input copies and the one device-to-host sync of the sampled tokens:
0.3 ms in all. Cross-check: for Qwen3-0.6B at 256 sequences of nano-vllm's workload
(mean context about 840 tokens) the model gives 5.6 ms per step, inside the 5–6 ms
that issue 11 estimates for the GPU's share of a step.
"""
from __future__ import annotations

import math
import time

import attrs
import numpy as np
import torch

from gpu.config import ModelConfig
from gpu.interface import StagingRunner, StepPlan, StepResult, TokenLogprobs
from gpu.staging import BlockTables, HostInputs, StagedTokens, last_token, stage_plan, upload_inputs
from gpu.sampler import SeqSamplingState


@attrs.frozen
class GpuSpec:
    name: str
    memory_bytes: float
    bandwidth: float            # bytes/s
    bf16_flops: float           # dense, FLOP/s
    step_overhead_s: float      # fixed per step: launches inside a CUDA graph, copies, sync


GPUS = {
    "h200": GpuSpec("H200", memory_bytes=141e9, bandwidth=4.8e12, bf16_flops=989e12,
                    step_overhead_s=0.3e-3),
}
_KV_RESERVE_BYTES = 2 << 30     # as the CUDA path keeps for activations and graphs


@attrs.frozen
class CostModel:
    """What one step of `config` in bf16 costs on `gpu`."""
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

    @classmethod
    def of(cls, config: ModelConfig, gpu: GpuSpec) -> "CostModel":
        c = config
        mlp = 3 * c.hidden_size * c.intermediate_size
        per_layer = (c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
                     + mlp * max(1, c.num_experts))
        return cls(gpu=gpu, num_layers=c.num_hidden_layers, num_q_heads=c.num_attention_heads,
                   head_dim=c.head_dim, vocab_size=c.vocab_size,
                   matmul_params=c.num_hidden_layers * per_layer + c.vocab_size * c.hidden_size,
                   kv_bytes_per_token=2 * c.num_hidden_layers * c.kv_size * 2,
                   expert_params=c.num_hidden_layers * mlp if c.num_experts else 0,
                   num_experts=c.num_experts, top_k=c.num_experts_per_tok)

    @property
    def weight_bytes(self) -> int:
        return self.matmul_params * self.elem_bytes

    @property
    def active_params(self) -> int:
        """Matmul weights one token runs through (all of them for a dense model)."""
        return self.matmul_params - (self.num_experts - self.top_k) * self.expert_params

    def step_seconds(self, q_lens: list[int], ctx_lens: list[int], num_sampled: int) -> float:
        """One step: q_lens new tokens per sequence, ctx_lens its context including them."""
        tokens = sum(q_lens)
        kv = self.kv_bytes_per_token * sum(ctx_lens)
        logits = 2 * 4 * num_sampled * self.vocab_size
        attention = 4 * self.num_layers * self.num_q_heads * self.head_dim * sum(
            q * c for q, c in zip(q_lens, ctx_lens))
        idle_experts = self.num_experts - min(self.num_experts, self.top_k * tokens)  # at best
        read_params = self.matmul_params - idle_experts * self.expert_params
        flops = 2 * self.active_params * tokens + attention
        g = self.gpu
        return max((read_params * self.elem_bytes + kv + logits) / g.bandwidth, flops / g.bf16_flops) \
            + g.step_overhead_s

    def kv_blocks(self, block_size: int, gpu_memory_utilization: float) -> int:
        """KV cache blocks the GPU would hold, sized as the CUDA path sizes them."""
        budget = (self.gpu.memory_bytes * gpu_memory_utilization - self.weight_bytes
                  - _KV_RESERVE_BYTES)
        return max(1, int(budget // (self.kv_bytes_per_token * block_size)))


def ordinary_token_ids(tokenizer, vocab_size: int) -> np.ndarray:
    """Every id a model could emit as text: in both vocabularies, not special, not added."""
    if tokenizer is None:
        return np.arange(vocab_size)
    added = set(tokenizer.hf.get_added_tokens_decoder()) | tokenizer.all_special_ids
    n = min(vocab_size, tokenizer.vocab_size)
    return np.array([i for i in range(n) if i not in added])


class SimulatedRunner(StagingRunner):
    """ModelRunner's interface; the forward is a wait of the cost model's length.

    Input preparation and the per-sequence sampling state are the real ones; sampled
    tokens are uniform over the tokenizer's ordinary tokens (seeded), so detokenize
    through emit do real work on real text.
    """

    def __init__(self, cost: CostModel, block_size: int, token_ids: np.ndarray, seed: int = 0) -> None:
        self.cost = cost
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
        self.steps = 0

    def stage(self, plan: StepPlan) -> tuple[HostInputs, float, list[int]] | None:
        """ModelRunner.stage: the host half of input preparation, ahead of the step. The
        cost model's wait and the step's random tokens (the device's work, which a real
        runner does not pay for on the host) are worked out here too."""
        host = stage_plan(plan, self.block_size, self.block_tables, self.staged_tokens)
        if host is None:
            return None
        num_sampled = len(host.sampled)
        wait = self.cost.step_seconds(host.q_lens, host.ctx_lens, num_sampled)
        return host, wait, self.rng.choice(self.token_ids, size=num_sampled).tolist()

    def execute(self, plan: StepPlan, staged=None) -> StepResult:
        t0 = time.perf_counter()
        if staged is None:
            staged = self.stage(plan)
        for sid in plan.released:
            self.states.pop(sid, None)
        for ns in plan.new_seqs:
            self.states[ns.seq_id] = SeqSamplingState(ns.sampling, ns.prompt_token_ids, 0)
        if staged is None:
            return StepResult(plan.step, (), (), time.perf_counter() - t0)
        host, wait, tokens = staged
        # the host's part of a step once the one before has ended: PLACEHOLDERs, upload
        upload_inputs(host, self.device, last_token=lambda sid: last_token(self.states, sid),
                      previous=self.staged_tokens.previous(host))
        seq_ids = host.sampled
        states = [self.states[s] for s in seq_ids]
        logprobs = self._logprobs(states, tokens)
        for st, tok in zip(states, tokens):
            st.output_ids.append(tok)
        self.staged_tokens.executed(plan.step, tokens)
        # the device runs after the host has prepared and launched: wait from here
        time.sleep(wait)
        self.waited_s += wait
        self.steps += 1
        return StepResult(plan.step, seq_ids, tuple(tokens), time.perf_counter() - t0,
                          logprobs=logprobs)

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
            others = self.lp_rng.choice(self.token_ids, size=max(k - 1, 0)).tolist()
            top = (tok, *others)[:k]
            out.append(TokenLogprobs(lp, top, (lp,) * len(top)))
        return tuple(out)

