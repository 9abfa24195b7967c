"""The pooling runner (issue 32): executes a StepPlan of whole sequences and answers one
pooled vector per sequence (StepResult.pooled), no tokens, no KV cache.

Each chunk of a pooling plan is a whole prompt (start_pos 0, no block table): the
scheduler never splits a pooling sequence, since an encoder attends over all of it at
once. Its `SeqStart.pooling` says what it asks (PoolingOptions: Matryoshka dimensions,
normalization, a classifier's activation, a cross-encoder pair's second segment). The
vectors come back as float32 little-endian bytes: plain data that crosses a process
boundary as it is, and that an embeddings reply encodes to base64 or floats at once.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from gpu.interface import PoolingOptions, Runner, SamplingOptions, SeqChunk, SeqStart, StepPlan, StepResult
from gpu.layers.pooler import VarlenAttention, finish
from gpu.loader.pooling import LoadedPooling

_DEFAULT = PoolingOptions()


class PoolingRunner(Runner):
    def __init__(self, loaded: LoadedPooling, *, device: torch.device | str = "cpu",
                 use_triton: bool = False) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.spec = loaded.spec
        self.device = torch.device(device)
        # an encoder's step on the CPU runs in the padded layout (VarlenAttention._prepare_padded)
        self.attn = VarlenAttention(loaded.head_dim ** -0.5, causal=not self.spec.encoder, use_triton=use_triton,
                                    padded=self.spec.encoder and self.device.type == "cpu")
        self.options: dict[str, PoolingOptions] = {}
        # what bench throughput reports for a generating runner; a pooling runner has none of it
        self.cuda_graphs = False
        self.cuda_graph_sizes: list[int] = []
        self.cuda_graph_capture_s = 0.0
        self.cuda_graph_error: str | None = None
        self.warmup_s = 0.0

    def execute(self, plan: StepPlan, staged: object = None) -> StepResult:
        t0 = time.perf_counter()
        for sid in plan.released:
            self.options.pop(sid, None)
        for ns in plan.new_seqs:
            self.options[ns.seq_id] = ns.pooling or _DEFAULT
        chunks = [c for c in plan.chunks if c.sample]
        if not chunks:
            return StepResult(plan.step, (), (), time.perf_counter() - t0)
        for c in chunks:
            if c.start_pos:
                raise ValueError(f"pooling sequence {c.seq_id} was split (starts at {c.start_pos})")
        lens = [len(c.token_ids) for c in chunks]
        options = [self.options.pop(c.seq_id, _DEFAULT) for c in chunks]
        ids = np.fromiter((t for c in chunks for t in c.token_ids), dtype=np.int64, count=sum(lens))
        positions = np.concatenate([np.arange(n, dtype=np.int64) for n in lens])
        types = None
        if self.spec.encoder and any(o.segment for o in options):
            types = np.concatenate([(np.arange(n) >= o.segment).astype(np.int64) if o.segment
                                    else np.zeros(n, dtype=np.int64) for n, o in zip(lens, options)])
        dev = self.device
        with torch.inference_mode():
            layout = self.attn.prepare(lens, dev)
            if layout is not None:         # the padded layout's rows
                rows = layout.numpy()
                ids, positions = ids[rows], positions[rows]
                types = None if types is None else types[rows]
            out = self.model(torch.from_numpy(ids).to(dev), torch.from_numpy(positions).to(dev), self.attn, lens,
                             None if types is None else torch.from_numpy(types).to(dev))
            rows = finish(out, options, self.spec)
            vectors = [r.float().cpu().numpy() for r in rows]
        pooled = tuple(v.astype("<f4", copy=False).tobytes() for v in vectors)
        return StepResult(plan.step, tuple(c.seq_id for c in chunks), (), time.perf_counter() - t0, pooled=pooled)

    def warm_up(self, max_num_batched_tokens: int, max_num_seqs: int) -> float:
        """One step of a few sequences (compiles the Triton kernels on CUDA)."""
        t0 = time.perf_counter()
        n = max(1, min(4, max_num_seqs))
        size = max(1, min(16, max_num_batched_tokens // n))
        plan = StepPlan(-1, tuple(SeqChunk(f"__warmup__{i}", (0,) * size, 0, (), True) for i in range(n)),
                        tuple(SeqStart(f"__warmup__{i}", (0,) * size, SamplingOptions(), pooling=_DEFAULT)
                              for i in range(n)))
        self.execute(plan)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.warmup_s = round(time.perf_counter() - t0, 3)
        return self.warmup_s
