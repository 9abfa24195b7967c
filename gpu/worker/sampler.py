"""Token sampling: logit controls, penalties, temperature, top-k/top-p/min-p, min_tokens, logprobs.

sample() is the host path (CPU): each draw's noise comes from a generator seeded with the
key (sequence seed, output index) (`draw_key`; the seed is the request's, or one from the
engine's seed sequence), so a seeded request samples the same tokens whatever else is in
the batch, and a row can be sampled out of turn: speculative decoding samples the rows
of a sequence's drafts in one batch (`DraftRow`) and gets the very tokens that decoding
one at a time would. Greedy rows never touch a generator.
DeviceSampler is the CUDA path, through gpu/kernels/triton/sampling.py: it keeps the batch's
sampling parameters and penalty token counts on the device between steps.
"""
from __future__ import annotations

import torch

from gpu.interface import SamplingOptions


class SeqSamplingState:
    """Per-sequence sampling state: its generator and the token history penalties need."""

    def __init__(self, opts: SamplingOptions, prompt_ids: tuple[int, ...], fallback_seed: int) -> None:
        self.opts = opts
        self.prompt_ids = prompt_ids
        self.output_ids: list[int] = []
        # one non-negative int64 for both paths (torch.Generator, the kernels' philox)
        self.seed = (opts.seed if opts.seed is not None else fallback_seed) % 2**63
        self.guide = None       # a gpu.worker.grammar.Guide when the output is constrained
        self.budget = None      # a gpu.worker.think_budget.ThinkBudget with thinking_token_budget


class DraftRow:
    """A sequence's state as it will be once `drafts` are accepted: what a verify row
    samples from (its penalties, min_tokens and bad words see the drafts before it, its
    draw is keyed by its own output index). A grammar's masks for these rows come from
    the sequence's own guide walked through the drafts (gpu/worker/grammar.py `draft_masks`)."""

    __slots__ = ("opts", "prompt_ids", "output_ids", "seed", "guide", "budget")

    def __init__(self, st: SeqSamplingState, drafts: tuple[int, ...]) -> None:
        self.opts = st.opts
        self.prompt_ids = st.prompt_ids
        self.output_ids = st.output_ids + list(drafts)
        self.seed = st.seed
        self.guide = None
        self.budget = None


_MASK64 = 2**64 - 1


def draw_key(seed: int, index: int) -> int:
    """The generator seed of a sequence's draw for output token `index`: splitmix64 of
    the pair, so that neighbouring seeds and indices give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def apply_logit_controls(logits: torch.Tensor, states: list[SeqSamplingState]) -> torch.Tensor:
    """logit_bias, allowed_token_ids and bad_words for the whole batch, as vLLM applies
    them: before penalties, temperature and the filters, and after the raw logprobs were
    taken (vLLM's default logprobs mode). A grammar's bitmask and min_tokens' stop-token
    mask may come before or after: they only ban tokens, and a banned (-inf) logit stays
    banned whatever bias is added to it.

    logits: [B, V], one row per state, on any device; edited in place when float32 (a
    float32 copy otherwise) and returned. A batch where no row uses a control costs one
    pass over the states' options. Otherwise the host builds one index tensor and one bias
    tensor for the whole batch, and three or four indexed writes apply them:
    - allowed_token_ids: the row's allowed logits are kept, the row is set to -inf, and
      the kept logits are written back;
    - bad_words: a one-token word is always banned; a longer word's last token is banned
      when the row's output ends with the rest of the word (vLLM's rule);
    - logit_bias: added with one index_put_(accumulate=True).
    """
    rows = [i for i, st in enumerate(states) if st.opts.controls_logits]
    if not rows:
        return logits
    allow_rows: list[int] = []
    allow_r: list[int] = []
    allow_c: list[int] = []
    ban_r: list[int] = []
    ban_c: list[int] = []
    bias_r: list[int] = []
    bias_c: list[int] = []
    bias_v: list[float] = []
    for i in rows:
        st = states[i]
        o = st.opts
        if o.allowed_token_ids:
            allow_rows.append(i)
            allow_r += [i] * len(o.allowed_token_ids)
            allow_c += o.allowed_token_ids
        out = st.output_ids
        for word in o.bad_words_token_ids:
            n = len(word) - 1
            if n == 0 or (n <= len(out) and tuple(out[len(out) - n:]) == word[:n]):
                ban_r.append(i)
                ban_c.append(word[-1])
        for tok, bias in o.logit_bias:
            bias_r.append(i)
            bias_c.append(tok)
            bias_v.append(bias)
    if logits.dtype != torch.float32:
        logits = logits.float()
    dev = logits.device
    # one upload for every index of the step
    parts = (allow_rows, allow_r, allow_c, ban_r, ban_c, bias_r, bias_c)
    flat = torch.tensor([x for p in parts for x in p], dtype=torch.int64, device=dev)
    allow_rows_t, allow_r_t, allow_c_t, ban_r_t, ban_c_t, bias_r_t, bias_c_t = \
        flat.split([len(p) for p in parts])
    if allow_rows:
        kept = logits[allow_r_t, allow_c_t]
        logits.index_fill_(0, allow_rows_t, float("-inf"))
        logits.index_put_((allow_r_t, allow_c_t), kept)
    if ban_r:
        logits.index_put_((ban_r_t, ban_c_t), torch.full((len(ban_r),), float("-inf"), device=dev))
    if bias_r:
        logits.index_put_((bias_r_t, bias_c_t),
                          torch.tensor(bias_v, dtype=torch.float32, device=dev), accumulate=True)
    return logits


def apply_penalties(logits: torch.Tensor, state: SeqSamplingState) -> torch.Tensor:
    """HF-style repetition penalty over prompt+output; OpenAI frequency/presence over output."""
    o = state.opts
    vocab = logits.shape[-1]
    if o.repetition_penalty != 1.0:
        seen = torch.tensor(list(state.prompt_ids) + state.output_ids, dtype=torch.int64)
        seen = seen[seen < vocab].unique()
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / o.repetition_penalty, vals * o.repetition_penalty)
    if state.output_ids and (o.frequency_penalty or o.presence_penalty):
        out = torch.tensor(state.output_ids, dtype=torch.int64)
        counts = torch.bincount(out[out < vocab], minlength=vocab).to(logits.dtype)
        logits -= o.frequency_penalty * counts + o.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, o: SamplingOptions) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks (masked entries become -inf)."""
    logits = logits / o.temperature
    if o.top_k <= 0 and o.min_p <= 0.0 and o.top_p >= 1.0:
        return logits
    vocab = logits.shape[-1]
    if 0 < o.top_k < vocab:
        kth = torch.topk(logits, o.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if o.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < o.min_p * probs.max(), float("-inf"))
    if o.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always keep the first token)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= o.top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def stop_tokens_to_mask(states: list[SeqSamplingState], vocab: int) -> list[tuple[int, int]]:
    """(row, token) pairs to forbid: stop tokens of rows that have not reached min_tokens."""
    return [(i, t) for i, st in enumerate(states)
            if st.opts.stop_token_ids and len(st.output_ids) < st.opts.min_tokens
            for t in st.opts.stop_token_ids if t < vocab]


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's first maximal index (a NaN counting as the maximum): gpu/kernels/cpu/ops.c
    argmax_rows for fp32 rows on the CPU (torch's row-wise max took 1.0-1.4 ms a row of Gemma
    3's 262k logits on one AVX2 core, 40 ms for 32 rows; the C pass ~0.1 ms a row), else
    max(-1).indices (the first maximal index, as argmax gives, 3x faster than it on the CPU)."""
    if logits.device.type == "cpu":
        from gpu.kernels.cpu import ops as cpu_kernels
        k = cpu_kernels.kernels()
        if k is not None and (out := k.argmax_rows(logits)) is not None:
            return out.tolist()
    return logits.max(dim=-1).indices.tolist()


def sample(logits: torch.Tensor, states: list[SeqSamplingState]) -> list[int]:
    """logits: [B, V] float32 -> one token per row.

    Random rows draw by the exponential race, argmax(p / E) with E ~ Exp(1) from the row's
    own generator: an exact categorical draw, batched except for the noise itself.
    """
    for i, t in stop_tokens_to_mask(states, logits.shape[-1]):
        logits[i, t] = float("-inf")
    for i, st in enumerate(states):
        if st.opts.penalised:
            logits[i] = apply_penalties(logits[i].clone(), st)
    out = greedy_tokens(logits)
    rand = [i for i, st in enumerate(states) if not st.opts.greedy]
    if rand:
        rows = torch.stack([filter_logits(logits[i], states[i].opts) for i in rand])   # [R, V]
        probs = torch.softmax(rows, dim=-1)
        u = torch.empty_like(probs)
        gen = torch.Generator()
        for r, i in enumerate(rand):
            st = states[i]
            gen.manual_seed(draw_key(st.seed, len(st.output_ids)))   # ~2 us
            u[r].uniform_(generator=gen)   # uniform_ is ~7x cheaper than exponential_
        noise = -torch.log(u)                                # Exp(1)
        for i, tok in zip(rand, (probs / noise).max(dim=-1).indices.tolist()):
            out[i] = tok
    return out


def sample_on_device(logits: torch.Tensor, states: list[SeqSamplingState]) -> list[int]:
    """CUDA path, one shot: DeviceSampler without a batch to remember."""
    return DeviceSampler(logits.device).sample(logits, None, states)


class DeviceSampler:
    """CUDA path: the Triton sampling kernels over the whole batch, one host sync per step
    (the sampled tokens' ``.tolist()``).

    The batch's sampling parameters (temperature, top-k/p, min-p, seeds), its step counters
    and, when a row has penalties, its token counts live on the device and are rebuilt
    only when the batch changes (other sequences, or a sequence whose history moved other
    than by this sampler's last token). While it stays the same, the counters advance and
    the counts take the sampled tokens on the device: nothing is copied from the host.

    The random stream of each row depends only on (seed, step, token), so a seeded request
    samples the same tokens whatever else is in the batch.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._key: tuple | None = None       # (seq ids, their output lengths) expected next
        self._params: dict[str, torch.Tensor] = {}
        self._flags = (False, False)         # (any top-k/top-p, any min-p)
        self._pen_rows: list[int] = []
        self._pen: dict[str, torch.Tensor] = {}

    def _rebuild(self, states: list[SeqSamplingState], V: int) -> None:
        from gpu.kernels.triton.sampling import build_token_counts

        dev = self.device
        o = [st.opts for st in states]
        f32 = dict(dtype=torch.float32, device=dev)
        self._params = dict(
            temperature=torch.tensor([0.0 if x.greedy else x.temperature for x in o], **f32),
            top_k=torch.tensor([x.top_k if x.top_k > 0 else 0 for x in o], dtype=torch.int32, device=dev),
            top_p=torch.tensor([x.top_p for x in o], **f32),
            min_p=torch.tensor([x.min_p for x in o], **f32),
            seeds=torch.tensor([st.seed for st in states], dtype=torch.int64, device=dev),
            steps=torch.tensor([len(st.output_ids) for st in states], dtype=torch.int64, device=dev))
        self._flags = (any(x.top_k > 0 or x.top_p < 1.0 for x in o),
                       any(x.min_p > 0.0 and not x.greedy for x in o))
        self._pen_rows = [i for i, st in enumerate(states) if st.opts.penalised]
        self._pen = {}
        if self._pen_rows:
            def padded(seqs: list[list[int]]) -> torch.Tensor:
                width = max(1, max(len(s) for s in seqs))
                return torch.tensor([s + [-1] * (width - len(s)) for s in seqs], dtype=torch.int64, device=dev)
            sub = [states[i] for i in self._pen_rows]
            self._pen = dict(
                rows=torch.tensor(self._pen_rows, dtype=torch.int64, device=dev),
                prompt_mask=build_token_counts(padded([list(s.prompt_ids) for s in sub]), V) > 0,
                counts=build_token_counts(padded([s.output_ids for s in sub]), V),
                rep=torch.tensor([s.opts.repetition_penalty for s in sub], **f32),
                freq=torch.tensor([s.opts.frequency_penalty for s in sub], **f32),
                pres=torch.tensor([s.opts.presence_penalty for s in sub], **f32))

    def sample(self, logits: torch.Tensor, seq_ids: tuple[str, ...] | None,
               states: list[SeqSamplingState]) -> list[int]:
        from gpu.kernels.triton.sampling import apply_penalties, sample as kernel_sample

        B, V = logits.shape
        lens = tuple(len(st.output_ids) for st in states)
        key = None if seq_ids is None else (tuple(seq_ids), lens)
        if key is None or key != self._key:
            self._rebuild(states, V)
        # bf16 logits are sampled as they are (the kernel converts each tile on load): an
        # fp32 copy of the whole [B, V] only when a row has penalties (their kernel's fp32)
        logits = (logits.float() if self._pen else logits).contiguous()
        masked = stop_tokens_to_mask(states, V)
        if masked:
            rows, cols = torch.tensor(masked, device=self.device).T
            logits[rows, cols] = float("-inf")
        pen = self._pen
        if pen:
            idx = pen["rows"]
            logits[idx] = apply_penalties(logits.index_select(0, idx), pen["prompt_mask"], pen["counts"],
                                          pen["rep"], pen["freq"], pen["pres"])
        p = self._params
        use_filters, use_min_p = self._flags
        tokens = kernel_sample(logits, p["temperature"], p["top_k"], p["top_p"], p["min_p"],
                               p["seeds"], p["steps"], use_top_k_top_p=use_filters, use_min_p=use_min_p)
        # the next step, if the batch is the same, starts from here
        p["steps"] += 1
        if pen:
            picked = tokens.index_select(0, pen["rows"])
            pen["counts"].scatter_add_(1, picked[:, None], torch.ones_like(picked, dtype=torch.int32)[:, None])
        out = tokens.tolist()
        self._key = None if seq_ids is None else (tuple(seq_ids), tuple(n + 1 for n in lens))
        return out


def token_logprobs(raw_logprobs: torch.Tensor, tokens: list[int], ks: list[int],
                   chosen: list[tuple[int, ...]] | None = None):
    """raw_logprobs: [R, V] log-softmax of the model's logits (before penalties and
    temperature, as vLLM reports them); one (logprob, top ids, top logprobs) per row.
    chosen[r] (logprob_token_ids): row r's alternatives are its sampled token, then these
    ids (once each), in place of its top k, as vLLM's sampler gathers them."""
    picked = raw_logprobs.gather(1, torch.tensor(tokens, device=raw_logprobs.device)[:, None])[:, 0]
    kmax = min(max(ks), raw_logprobs.shape[-1])   # the whole vocabulary at most
    top_v, top_i = raw_logprobs.topk(kmax, dim=-1) if kmax > 0 else (None, None)
    picked = picked.tolist()
    top_v = top_v.tolist() if top_v is not None else None
    top_i = top_i.tolist() if top_i is not None else None
    out = []
    for r, k in enumerate(ks):
        if chosen is not None and chosen[r]:
            ids = tuple(dict.fromkeys((tokens[r], *chosen[r])))
            vals = tuple(raw_logprobs[r, torch.tensor(ids, device=raw_logprobs.device)].tolist())
            out.append((picked[r], ids, vals))
            continue
        ids = tuple(top_i[r][:k]) if k else ()
        vals = tuple(top_v[r][:k]) if k else ()
        out.append((picked[r], ids, vals))
    return out
