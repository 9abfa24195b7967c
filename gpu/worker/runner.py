"""The model runner: executes one StepPlan (gpu/interface.py) and returns a StepResult.

Synchronous; no trio, no globals. ``stage(plan)`` does the host half of input
preparation (gpu/worker/staging.py) as soon as a plan arrives, while the step before it still
runs; ``execute(plan, staged)`` is left with filling in the PLACEHOLDERs and the upload
(``execute(plan)`` alone stages as well). ``warm_up`` compiles before serving; the
start-up facts (``cuda_graphs``, ``cuda_graph_sizes``, ``cuda_graph_capture_s``,
``warmup_s``) are what bench throughput reports. KV sizing is gpu/worker/profiling.py.
"""
from __future__ import annotations

import logging
import time

import attrs
import torch

from gpu.layers.attention import KVCache, TorchPagedAttention
from gpu.worker.cuda_graphs import run_graphed
from gpu.worker.grammar import Guide, accept, mask_logits
from gpu.models.qwen_vision import mrope_positions
from gpu.interface import (PromptLogprobs, SamplingOptions, SeqChunk, SeqStart, StagingRunner,
                           StepPlan, StepResult, TokenLogprobs, TPLost)
from gpu.worker.think_budget import ThinkBudget
from gpu.worker.sampler import (DeviceSampler, DraftRow, SeqSamplingState, apply_logit_controls, sample,
                         token_logprobs)
from gpu.worker.staging import (BlockTables, HostInputs, StagedTokens, Staging, float_chunks, last_token,
                         stage_plan, upload_inputs)

_log = logging.getLogger("tailrace.gpu")

KV_POLL_WAIT_S = 0.01   # a plan with only remote prefills in flight waits this long for one


class ModelRunner(StagingRunner):
    def __init__(self, model, cache: KVCache, *, device: torch.device, seed: int = 0,
                 use_triton: bool = False, cuda_graph_max_bs: int = 0, max_model_len: int = 0,
                 broadcast=None, vision=None, encoder_cache_size: int = 64, lora=None,
                 draft=None, verify_tokens: int = 0, kv_connector=None, floating: bool = False,
                 ngram=None, state_pool=None) -> None:
        """broadcast: tensor parallelism's rank 0 (gpu/worker/tp.py StepBroadcast): each
        step's inputs go to the worker ranks before the forward. vision: a vision-language
        model's tower and projector (gpu/models/llava_vision.py), with an encoder cache of
        `encoder_cache_size` pictures' features. lora: a gpu.lora.adapters.LoRAManager
        (--enable-lora): the adapters' terms added to the step's rows that use one.
        draft: speculative decoding's draft model (gpu/worker/spec_decode/draft.py DraftModel) or EAGLE head
        (gpu/worker/spec_decode/eagle.py EagleDrafter), which fills each step's DRAFT placeholders before the
        verify forward; a head also reads each step's hidden states (`captured`).
        verify_tokens: with speculative decoding and CUDA graphs, K + 1: verify steps of up
        to that many tokens a sequence replay graphs of their own (gpu/worker/cuda_graphs.py).
        kv_connector: --kv-transfer-config's (gpu/kv_transfer/connector.py). floating: drafts
        planned ahead with async scheduling, their chunks floating; ngram: the prompt lookup
        (stages/schedule/drafter.py NgramDrafter) that fills them where no draft model or
        head does.
        state_pool: a hybrid model's linear-attention states (gpu/layers/linear_attention.py
        StatePool), one slot a running sequence (SeqChunk.state_slot)."""
        self.model = model
        self.state_pool = state_pool
        self.vision = vision
        self.images: dict[str, tuple] = {}          # seq id -> its prompt's ImageInputs
        # M-RoPE (Qwen2.5-VL): seq id -> (its prompt's positions [3, L], rope delta), for
        # the sequences with pictures; every other row keeps its one position
        self.mrope = bool(model.config.mrope_section)
        self.mrope_pos: dict[str, tuple] = {}
        self.encoder_cache = EncoderCache(encoder_cache_size)
        self.lora = lora
        self.draft = draft
        self.kv_connector = kv_connector
        # with floating chunks: where each sampled sequence's KV ends after the steps run so far
        self.floating = floating
        self.ngram = ngram
        self.next_pos: dict[str, int] = {}
        # EAGLE3: the target layers whose input the head reads (the forward captures them)
        self.aux_layers: tuple[int, ...] = () if draft is None else tuple(draft.aux_layers)
        self.broadcast = broadcast
        self.cache = cache
        self.device = device = torch.device(device)
        self.use_triton = use_triton
        cfg = model.config
        scale = cfg.head_dim ** -0.5
        if use_triton:
            from gpu.layers.attention import TritonPagedAttention
            self.attn = TritonPagedAttention(cache, scale)
        else:
            self.attn = TorchPagedAttention(cache, scale)
        self.states: dict[str, SeqSamplingState] = {}
        # seq id -> [top k, the next prompt position still owed], for those that asked
        self.prompt_logprobs: dict[str, list[int]] = {}
        self.block_tables = BlockTables()
        self.staged_tokens = StagedTokens()
        self._seed_rng = torch.Generator().manual_seed(seed)
        self.staging = Staging(device) if device.type == "cuda" else None
        self.device_sampler = DeviceSampler(device) if use_triton else None
        # What happened before the first request (bench throughput reports these).
        self.cuda_graphs = False
        self.cuda_graph_sizes: list[int] = []
        self.cuda_graph_capture_s = 0.0
        self.cuda_graph_error: str | None = None
        self.warmup_s = 0.0
        self.graphs = None
        self.verify_graphs = None
        self.cuda_graph_verify_tokens = 0
        if use_triton and cuda_graph_max_bs > 0:
            from gpu.worker.cuda_graphs import capture_graphs
            t0 = time.perf_counter()
            try:
                self.graphs, self.verify_graphs = capture_graphs(
                    model, self.attn, max_bs=cuda_graph_max_bs, max_model_len=max_model_len,
                    device=device, verify_tokens=verify_tokens, aux_layers=self.aux_layers)
                self.cuda_graphs, self.cuda_graph_sizes = True, list(self.graphs.sizes)
                if self.verify_graphs is not None:
                    self.cuda_graph_verify_tokens = verify_tokens
                self.cuda_graph_error = self.graphs.verify_error   # bench reports it
            except Exception as exc:  # a capture failure costs speed, not correctness
                _log.warning("CUDA graph capture failed, running eager: %s", exc, exc_info=exc)
                self.cuda_graph_error = f"{type(exc).__name__}: {exc}"[:500]   # bench reports it
            if self.graphs is not None and draft is not None:   # the drafter's own (model or head)
                try:
                    draft.capture(max_bs=cuda_graph_max_bs, max_model_len=max_model_len,
                                  verify_tokens=verify_tokens)
                except Exception as exc:  # its forwards run eagerly
                    _log.warning("CUDA graph capture for the drafter failed, drafting eagerly: %s",
                                 exc, exc_info=exc)
            self.cuda_graph_capture_s = round(time.perf_counter() - t0, 3)

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    def stage(self, plan: StepPlan) -> HostInputs | None:
        """The plan's host-side input preparation, which needs nothing from the steps
        before it: the GPU stage calls it as a plan arrives, while the step before still
        runs, and hands the result to `execute`. Plans are staged in order, one at a time."""
        return stage_plan(plan, self.block_size, self.block_tables, self.staged_tokens)

    def execute(self, plan: StepPlan, staged: HostInputs | None = None) -> StepResult:
        """Run one step; `staged` is `stage(plan)`'s result when the caller staged it
        ahead (otherwise it is staged here). With the KV connector, the plan's remote
        prefills start reading first, and the result says which reads have landed: a
        plan with nothing else to run waits for one a few ms (the scheduler sends such
        plans while reads are in flight), so an idle decode side does not spin."""
        kv = self.kv_connector
        if kv is None or not (plan.kv_reads or plan.kv_waiting):
            if not self.floating:
                return self._execute(plan, staged)
            try:
                return self._execute(plan, staged)
            except Exception:
                # where the step's sequences' KV ends is not known now: a floating chunk of
                # theirs planned next (their requests fail with this step) runs where the
                # scheduler planned it, in its own table's tail, never over a hashed block
                for c in plan.chunks:
                    self.next_pos.pop(c.seq_id, None)
                raise
        if plan.kv_reads:         # under TP: every rank starts its shard's reads
            kv.start_reads(plan.kv_reads)
            if self.draft is not None:
                for read in plan.kv_reads:      # a draft model's KV there is not theirs
                    self.draft.overwritten(read.local_block_ids)
        result = self._execute(plan, staged)
        loaded, failed, late = kv.poll()
        if not plan.chunks and not loaded and not failed:
            deadline = time.monotonic() + KV_POLL_WAIT_S
            while not (loaded or failed) and kv.reading and time.monotonic() < deadline:
                time.sleep(0.0005)
                loaded, failed, late = kv.poll()
        if loaded or failed:
            return attrs.evolve(result, kv_loaded=loaded, kv_failed=failed, kv_late=late)
        return result

    def _execute(self, plan: StepPlan, staged: HostInputs | None = None) -> StepResult:
        t0 = time.perf_counter()
        if staged is None:
            staged = self.stage(plan)
        if plan.kv_updates:
            self.cache.remap(plan.kv_updates)
            if self.broadcast is not None:
                self.broadcast.remapped(plan.kv_updates)
        for sid in plan.released:
            self.states.pop(sid, None)
            self.prompt_logprobs.pop(sid, None)
            self.images.pop(sid, None)
            self.mrope_pos.pop(sid, None)
            if self.lora is not None:
                self.lora.release(sid)
        for ns in plan.new_seqs:
            if ns.images:
                self.images[ns.seq_id] = ns.images
                if self.mrope:
                    self.mrope_pos[ns.seq_id] = mrope_positions(
                        len(ns.prompt_token_ids), ns.images, self.vision.merge)
            fallback = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
            st = self.states[ns.seq_id] = SeqSamplingState(ns.sampling, ns.prompt_token_ids, fallback)
            if ns.grammar is not None:
                st.guide = Guide(ns.grammar, ns.think, ns.thinking)
            if ns.sampling.thinking_token_budget is not None and ns.think is not None:
                st.budget = ThinkBudget(ns.sampling.thinking_token_budget, ns.think, ns.thinking)
            if ns.prompt_logprobs is not None:
                self.prompt_logprobs[ns.seq_id] = [ns.prompt_logprobs, 1]
            if ns.lora is not None:
                self.lora.start(ns.seq_id, ns.lora)
        if self.draft is not None:
            for sid in plan.released:
                self.draft.release(sid)
        if self.floating:
            for sid in plan.released:
                if self.ngram is not None:
                    self.ngram.forget(sid)
                self.next_pos.pop(sid, None)
        if not plan.chunks:
            return StepResult(plan.step, (), (), time.perf_counter() - t0)
        floating = self.floating and any(c.floating for c in plan.chunks)
        if floating:                    # their starts and tokens, now that the steps before ran
            plan, staged = float_chunks(plan, staged, self.block_size, self._float_start,
                                        self._float_tokens)
        if self.draft is not None:      # the drafts, written into the plan and its inputs
            plan = self.draft.fill(plan, staged, self.states)
        input_ids, positions, meta, sample_idx = upload_inputs(
            staged, self.device, self.staging, self.last_token, self.staged_tokens.previous(staged))
        if self.mrope_pos:
            positions = self._mrope_positions(plan.chunks, positions)
        if self.state_pool is not None:     # each sequence's slot, in the step's row order
            self.state_pool.load(plan.chunks)       # prefix-cache hits: their snapshots
            meta.states = self.state_pool.step([c.state_slot for c in plan.chunks], meta.q_starts,
                                               meta.q_lens, meta.start_positions)
        spans = self._prompt_logprob_spans(plan.chunks) if self.prompt_logprobs else []
        sampling = [c for c in plan.chunks if c.sample]
        seq_ids = tuple(c.seq_id for c in sampling)
        if self.broadcast is not None:
            self.broadcast.send(staged, [(a, b) for _, a, b, _ in spans], bool(seq_ids), plan.step,
                                [x for c in plan.chunks for x in (c.state_slot, c.state_load, c.state_save)]
                                if self.state_pool is not None else ())
        with torch.inference_mode():
            try:   # the forward and the logits: collectives under tensor parallelism
                embeds = self._image_embeds(plan.chunks) if self.images else None
                if self.lora is not None:
                    groups = self.lora.groups(plan.chunks)
                    if self.broadcast is not None:   # the workers add their shards' terms
                        self.broadcast.send_lora(groups)
                    lora = self.lora.set_step(groups)
                else:
                    lora = False
                try:
                    hidden, aux = self.forward(input_ids, positions, meta, embeds, lora)   # [T, D]
                    if self.state_pool is not None:
                        self.state_pool.save(plan.chunks)   # states kept at block boundaries
                finally:
                    if lora:
                        self.lora.done()
                if self.draft is not None and self.draft.reads_hidden:
                    # an EAGLE head reads the target's hidden states (gpu/worker/spec_decode/eagle.py)
                    self.draft.captured(plan.chunks, hidden, aux)
                prompt_logprobs = self._prompt_logprobs(spans, hidden) if spans else ()
                logits = (self.model.compute_logits(hidden.index_select(0, sample_idx))  # [R, V]
                          if seq_ids else None)
            except Exception as exc:
                if self.broadcast is None:
                    raise
                # a rank that fails here leaves the others inside a collective
                raise TPLost(f"step {plan.step} failed on rank 0 between its broadcast and "
                             f"its last collective: {type(exc).__name__}: {exc}") from exc
            if not seq_ids:
                return StepResult(plan.step, (), (), time.perf_counter() - t0,
                                  prompt_logprobs=prompt_logprobs)
            states = [self.states[s] for s in seq_ids]
            verify = any(c.num_drafts for c in sampling)
            if verify:      # one row per position: the sequence as if the drafts before it held
                states = [st if j == 0 else DraftRow(st, c.token_ids[-c.num_drafts:][:j])
                          for c, st in zip(sampling, states) for j in range(c.num_drafts + 1)]
            want = [i for i, st in enumerate(states) if st.opts.logprobs is not None]
            raw = torch.log_softmax(logits[want].float(), dim=-1) if want else None  # before sampling edits
            logits = apply_logit_controls(logits, states)   # logit_bias, allowed ids, bad words
            matchers = [st.guide for st in states]
            constrained = any(m is not None for m in matchers)
            # a speculated constrained sequence: its first row's guide masks all its rows
            drafts = ([c.token_ids[-c.num_drafts:] if j == 0 and c.num_drafts else ()
                       for c in sampling for j in range(c.num_drafts + 1)]
                      if verify and constrained else None)
            if self.use_triton:
                if constrained:
                    logits = logits.float()
                    mask_logits(logits, matchers, drafts)
                tokens = self.device_sampler.sample(logits, None if verify else seq_ids, states)
            else:
                host = logits.float().cpu()
                if constrained:
                    mask_logits(host, matchers, drafts)
                tokens = sample(host, states)
            if any(st.budget is not None for st in states):   # </think> forced at the budget
                # (a budgeted sequence gets no drafts, stages/schedule/spec.py: one row each)
                tokens = [tok if st.budget is None else st.budget.next(tok)
                          for st, tok in zip(states, tokens)]
            if constrained and not verify:   # a verify step's: the tokens it emits (_accept)
                accept(matchers, tokens)
            logprobs: tuple[TokenLogprobs | None, ...] = ()
            if want:
                chosen = [states[i].opts.logprob_token_ids for i in want]
                per_row = dict(zip(want, token_logprobs(raw, [tokens[i] for i in want],
                                                        [states[i].opts.logprobs for i in want],
                                                        chosen if any(chosen) else None)))
                logprobs = tuple(TokenLogprobs(*per_row[i]) if i in per_row else None
                                 for i in range(len(states)))
        if verify:
            return self._accept(plan.step, sampling, tokens, logprobs, prompt_logprobs, t0,
                                floating)
        for st, tok in zip(states, tokens):
            st.output_ids.append(tok)
        if self.floating:
            for c in sampling:
                self.next_pos[c.seq_id] = c.start_pos + len(c.token_ids)
        self.staged_tokens.executed(plan.step, tokens)
        return StepResult(plan.step, seq_ids, tuple(tokens), time.perf_counter() - t0,
                          logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                          num_drafts=(0,) * len(seq_ids) if floating else ())

    def _float_start(self, chunk: SeqChunk) -> int:
        return self.next_pos.get(chunk.seq_id, chunk.start_pos)

    def _float_tokens(self, chunk: SeqChunk) -> tuple[int, ...]:
        """A floating chunk's tokens: the sequence's last sampled token, then what prompt
        lookup finds after it, up to the chunk's num_drafts (gpu/worker/staging.py float_chunks);
        with a draft model or an EAGLE head, num_drafts DRAFTs, which its `fill` drafts."""
        st = self.states[chunk.seq_id]
        last = st.output_ids[-1] if st.output_ids else 0
        if not chunk.num_drafts:
            return (last,)
        if self.ngram is None:
            return (last, *(chunk.token_ids[1:]))
        return (last, *self.ngram.propose(chunk.seq_id, [*st.prompt_ids, *st.output_ids],
                                          chunk.num_drafts))

    def _accept(self, step: int, sampling: list[SeqChunk], tokens: list[int],
                logprobs: tuple, prompt_logprobs: tuple, t0: float,
                floating: bool = False) -> StepResult:
        """A verify step's tokens: per sequence, the rows' tokens while each draft equals
        the token sampled before it, and the first one that differs (or the bonus token
        after the last draft)."""
        out: list[int] = []
        lps: list = []
        counts: list[int] = []
        last: list[int] = []
        row = 0
        for c in sampling:
            drafts = c.token_ids[len(c.token_ids) - c.num_drafts:]
            n = 1
            while n <= c.num_drafts and tokens[row + n - 1] == drafts[n - 1]:
                n += 1
            emitted = tokens[row:row + n]
            out.extend(emitted)
            if logprobs:
                lps.extend(logprobs[row:row + n])
            counts.append(n)
            last.append(emitted[-1])
            st = self.states[c.seq_id]
            st.output_ids.extend(emitted)
            if st.guide is not None:
                for tok in emitted:
                    st.guide.accept(tok)
            if self.draft is not None and c.num_drafts:
                self.draft.verified(c.seq_id, c.start_pos, n)
            if self.floating:
                self.next_pos[c.seq_id] = c.start_pos + (n if c.num_drafts else len(c.token_ids))
            row += c.num_drafts + 1
        self.staged_tokens.executed(step, last)
        return StepResult(step, tuple(c.seq_id for c in sampling), tuple(out),
                          time.perf_counter() - t0, logprobs=tuple(lps),
                          prompt_logprobs=prompt_logprobs, num_tokens=tuple(counts),
                          num_drafts=tuple(c.num_drafts for c in sampling) if floating else ())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta,
                embeds=None, lora: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's (hidden states [T, D], an EAGLE3 head's captured layers or None): a
        captured graph for a decode batch that fits one, or for a verify step (up to K + 1
        tokens a sequence) that fits one of the verify graphs; else the model's fused CPU
        decode stack where it takes the step (gpu/kernels/cpu/layer.py: no pictures, no
        captured layers); else eager (always with LoRA rows or pictures: the graphs hold
        the base model's text path alone). Every tensor-parallel rank decides alike from
        the same inputs. embeds: pictures' features for some rows (`_image_embeds`)."""
        aux = self.aux_layers
        if embeds is None and not lora and positions.dim() == 1:    # M-RoPE's [3, T] runs eagerly
            out = run_graphed(self.graphs, self.verify_graphs, input_ids, positions, meta)
            if out is not None:
                return out if aux else (out, None)
        self.attn.prepare(meta)
        fused = self.model.fused_decode
        if (fused is not None and embeds is None and not aux
                and (hidden := fused(input_ids, positions, self.attn)) is not None):
            return hidden, None
        if aux:
            return self.model(input_ids, positions, self.attn, embeds=embeds, aux_layers=aux)
        return self.model(input_ids, positions, self.attn, embeds=embeds), None

    def _mrope_positions(self, chunks: tuple[SeqChunk, ...], positions: torch.Tensor
                         ) -> torch.Tensor:
        """The step's positions under M-RoPE, when a sequence with pictures is in it: [3, T]
        (t, h, w) when a chunk covers such a prompt's positions (its own table), else [T]
        with p + rope delta past such prompts (the three agree there: one position still
        does, and a decode batch keeps its CUDA graph). Other rows keep p."""
        import numpy as np

        rows, three = [], False
        for c in chunks:
            p = np.arange(c.start_pos, c.start_pos + len(c.token_ids), dtype=np.int64)
            entry = self.mrope_pos.get(c.seq_id)
            if entry is None:
                rows.append(np.broadcast_to(p, (3, len(p))))
                continue
            table, delta = entry
            inside = p < table.shape[1]
            three |= bool(inside.any())
            rows.append(np.where(inside[None], table[:, np.minimum(p, table.shape[1] - 1)],
                                 p + delta))
        host = np.concatenate(rows, axis=1)
        if not three:
            host = host[0]
        return torch.from_numpy(np.ascontiguousarray(host)).to(positions.device)

    def _image_embeds(self, chunks: tuple[SeqChunk, ...]):
        """(rows, features) for the step's rows that are pictures' placeholder tokens, or
        None: each picture a chunk cuts into is encoded (once: the encoder cache keeps its
        features by content hash), and the chunk's part of its features taken, so a
        chunked prefill may cut through a picture."""
        spans = []     # (first row, image, first feature, end feature)
        row0 = 0
        for c in chunks:
            start, end = c.start_pos, c.start_pos + len(c.token_ids)
            for im in self.images.get(c.seq_id, ()):
                a, b = max(start, im.offset), min(end, im.offset + im.length)
                if a < b:
                    spans.append((row0 + a - start, im, a - im.offset, b - im.offset))
            row0 += len(c.token_ids)
        if not spans:
            return None
        cache = self.encoder_cache
        have = {im.hash: cache.get(im.hash) for _, im, _, _ in spans if im.hash in cache}
        missing = {im.hash: im for _, im, _, _ in spans if im.hash not in have}
        if missing:
            have.update(self._encode(list(missing.values())))
        rows, feats = [], []
        for r, im, a, b in spans:
            rows.append(torch.arange(r, r + b - a))
            feats.append(have[im.hash][a:b])
        return (torch.cat(rows).to(self.device), torch.cat(feats))

    def _encode(self, images: list) -> dict[str, torch.Tensor]:
        """Run the vision tower on pictures (those of one size in one batch): their
        features by hash, also kept in the encoder cache."""
        out = {}

        def keep(im, f: torch.Tensor) -> None:
            if f.shape[0] != im.length:
                raise ValueError(f"a picture has {im.length} placeholder tokens, its "
                                 f"features {f.shape[0]}")
            self.encoder_cache.put(im.hash, f)
            out[im.hash] = f

        if self.vision.variable_size:     # Qwen2.5-VL: one picture at a time
            for im in images:
                keep(im, self.vision(torch.from_numpy(im.pixels).to(self.device), im.grid))
        else:                             # fixed-size towers: one batch per picture size
            by_shape: dict[tuple, list] = {}
            for im in images:
                by_shape.setdefault(tuple(im.pixels.shape), []).append(im)
            for group in by_shape.values():
                pixels = torch.stack([torch.from_numpy(im.pixels) for im in group]).to(
                    self.device, self.vision.dtype)
                for im, f in zip(group, self.vision(pixels)):     # [N, tokens, D]
                    keep(im, f)
        self.encoder_cache.encoded += len(images)
        return out

    def _prompt_logprob_spans(self, chunks: tuple[SeqChunk, ...]) -> list[tuple[str, int, int, int]]:
        """(seq id, first row, end row, first position) of the rows of the step's hidden
        states whose prompt logprobs are owed: row p of a chunk (position p) gives the
        logprob of prompt token p + 1. A position is reported once, even when a preempted
        sequence computes its prompt again."""
        out = []
        row0 = 0
        for c in chunks:
            want = self.prompt_logprobs.get(c.seq_id)
            if want is not None:
                prompt = self.states[c.seq_id].prompt_ids
                first = max(c.start_pos, want[1] - 1)
                end = min(c.start_pos + len(c.token_ids), len(prompt) - 1)
                if end > first:
                    out.append((c.seq_id, row0 + first - c.start_pos, row0 + end - c.start_pos, first))
            row0 += len(c.token_ids)
        return out

    def _prompt_logprobs(self, spans: list[tuple[str, int, int, int]], hidden: torch.Tensor
                         ) -> tuple[PromptLogprobs, ...]:
        out = []
        for seq_id, a, b, first in spans:
            want = self.prompt_logprobs[seq_id]
            prompt = self.states[seq_id].prompt_ids
            entries = compute_prompt_logprobs(self.model, hidden[a:b],
                                              prompt[first + 1:first + 1 + b - a], want[0])
            out.append(PromptLogprobs(seq_id, entries))
            want[1] = first + b - a + 1
        return tuple(out)

    def last_token(self, seq_id: str) -> int:
        return last_token(self.states, seq_id)

    def warm_up(self, max_num_batched_tokens: int, max_num_seqs: int) -> float:
        """Compile before the first request: one prefill step, one mixed step (a prefill
        chunk beside decodes) and the eager decode sizes past the captured ones, on
        blocks no request holds yet (call it before serving). The captured decode sizes
        were compiled when the graphs were captured. Returns (and keeps in warmup_s) the
        seconds it took."""
        t0 = time.perf_counter()
        bs = self.block_size
        nblocks = self.cache.num_blocks
        greedy = SamplingOptions(temperature=0.0)
        prompt = max(3, min(max_num_batched_tokens // 2, 256, (nblocks // 2) * bs))
        table = tuple(range(min(nblocks, -(-(prompt + 1) // bs))))
        warm = "__warmup__"
        steps = [StepPlan(-1, (SeqChunk(warm, (0,) * prompt, 0, table, True),),
                          (SeqStart(warm, (0,) * prompt, greedy),)),
                 StepPlan(-2, (SeqChunk(warm, (0,), prompt, table, True),
                               SeqChunk(warm + "b", (0,) * 3, 0, table[:-(-3 // bs)], True)),
                          (SeqStart(warm + "b", (0,) * 3, greedy),))]
        # decode batches larger than the largest graph run eagerly: compile that path too
        largest = self.graphs.max_bs if self.graphs is not None else 0
        if max_num_seqs > largest:
            n = min(max_num_seqs, largest + 1)
            steps.append(StepPlan(-3, tuple(SeqChunk(f"{warm}{i}", (0,), 1, table[:1], True)
                                            for i in range(n)),
                                  tuple(SeqStart(f"{warm}{i}", (0,), greedy) for i in range(n))))
        for plan in steps:
            self.execute(plan)
        self.execute(StepPlan(-4, (), released=tuple(self.states)))   # forget the warm-up
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.warmup_s = round(time.perf_counter() - t0, 3)
        return self.warmup_s


class EncoderCache:
    """Pictures' features by content hash, least recently used out first (issue 34): a
    picture that comes again (another request, a later chunk of the same prefill) is not
    encoded again. `encoded` counts the pictures the tower ran on."""

    def __init__(self, capacity: int) -> None:
        from collections import OrderedDict

        self.capacity = max(1, capacity)
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.encoded = 0

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def get(self, key: str) -> torch.Tensor:
        self.entries.move_to_end(key)
        return self.entries[key]

    def put(self, key: str, value: torch.Tensor) -> None:
        self.entries[key] = value
        self.entries.move_to_end(key)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)


PROMPT_LOGPROB_ROWS = 256   # rows of [rows, vocab] logits at a time


def compute_prompt_logprobs(model, hidden: torch.Tensor, targets: tuple[int, ...], k: int
                          ) -> tuple[TokenLogprobs, ...]:
    """hidden [R, D] at positions p..p+R-1 and the prompt tokens that follow each: their
    raw log-softmax logprob, rank (1 + the tokens more likely) and the top k."""
    out = []
    for s in range(0, len(targets), PROMPT_LOGPROB_ROWS):
        lp = torch.log_softmax(model.compute_logits(hidden[s:s + PROMPT_LOGPROB_ROWS]).float(),
                               dim=-1)                                          # [r, V]
        t = torch.tensor(targets[s:s + PROMPT_LOGPROB_ROWS], device=lp.device)[:, None]
        picked = lp.gather(1, t)                                               # [r, 1]
        ranks = ((lp > picked).sum(dim=-1) + 1).tolist()
        picked = picked[:, 0].tolist()
        k = min(k, lp.shape[-1])    # -1 (the whole vocabulary) arrives as the vocabulary size
        if k:
            top_v, top_i = lp.topk(k, dim=-1)
            top_v, top_i = top_v.tolist(), top_i.tolist()
        for r in range(len(picked)):
            out.append(TokenLogprobs(picked[r], tuple(top_i[r]) if k else (),
                                     tuple(top_v[r]) if k else (), ranks[r]))
    return tuple(out)


