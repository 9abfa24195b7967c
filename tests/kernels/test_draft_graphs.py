"""A draft model's CUDA graphs (gpu/worker/spec_decode/draft.py DraftModel.capture) and an EAGLE3 head's
(gpu/worker/spec_decode/eagle.py EagleDrafter.capture) on the CUDA code path of tiny random Qwen3s, on CPU
under TRITON_INTERPRET=1. Graphs cannot be captured here, so
each graph's stand-in replays the recorded forward eagerly over the same static buffers
(tests/kernels/test_verify_graphs.py): what is checked is that the drafter sends its
forwards to them (a draft's decode forward to the decode graphs, the catch-up after a
verify to the verify graphs, a prompt's catch-up eagerly) and that what they compute
from the static buffers is what the eager forwards compute: the same drafts, the same
verified tokens, the same draft KV."""
from __future__ import annotations

import json

import pytest
import torch

from gpu.layers.attention import KVCache
from gpu.worker.cuda_graphs import DecodeGraphs, VerifyGraphs
from gpu.worker.spec_decode.draft import DraftModel
from gpu.worker.spec_decode.eagle import EagleDrafter, load_head
from gpu.interface import SamplingOptions, SeqChunk, SeqStart, StepPlan
from gpu.loader.decoder import load_model
from gpu.worker.runner import ModelRunner
from stages.schedule.drafter import DRAFT
from tests.support.eagle_heads import eagle3_head
from tests.support.tiny_runners import TINY_QWEN3, fake_capture

K = 3
TABLES = {"a": (0, 1, 2, 8, 11), "b": (3, 4, 6, 9, 12), "c": (5, 7, 10)}
PROMPTS = {"a": (3, 9, 4, 1, 7, 2, 8), "b": (5, 6, 11, 12, 13), "c": (2, 2, 9)}


def _model(path, device, seed: int):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TINY_QWEN3))
    return load_model(path, load_format="dummy", dtype="float32", device=str(device), seed=seed,
                      progress=False).model


def _runner(target, draft_lm, device, graphed: bool | str) -> ModelRunner:
    """graphed: the stand-in graphs set on the draft (True); "runner": captured by the
    runner with its own, as start-up has it (the stand-in's capture here, real on CUDA);
    False: none."""
    dev = torch.device(device)
    c, d = target.config, draft_lm.config

    def cache(cfg):
        return KVCache(cfg.num_hidden_layers, 16, 4, cfg.num_key_value_heads, cfg.head_dim,
                       torch.float32, dev)

    draft = DraftModel(draft_lm, cache(d), dev, use_triton=True)
    if graphed == "runner":
        return ModelRunner(target, cache(c), device=dev, use_triton=True, draft=draft,
                           cuda_graph_max_bs=4, max_model_len=20, verify_tokens=K + 1)
    if graphed:
        draft.graphs = DecodeGraphs(draft_lm, draft.attn, max_bs=4, max_blocks=5, device=dev)
        draft.verify_graphs = VerifyGraphs(draft_lm, draft.attn, max_bs=4, max_blocks=5, device=dev,
                                           tokens_per_seq=K + 1)
        fake_capture(draft.graphs)
        fake_capture(draft.verify_graphs)
    return ModelRunner(target, cache(c), device=dev, use_triton=True, draft=draft)


def _replays(graphs) -> int:
    return sum(g.replays for g in graphs.graphs.values())


def _steps(runners, drafting=(True, True, True)) -> int:
    """A prefill, then a step for each of `drafting` (True: a verify step, a and b drafting
    K and c decoding; False: a plain decode step) on each runner, checked alike; the
    drafts that held."""
    opts = {"a": SamplingOptions(temperature=0.8, seed=7), "b": SamplingOptions(temperature=0.0),
            "c": SamplingOptions(temperature=0.0)}
    first = StepPlan(1, tuple(SeqChunk(s, p, 0, TABLES[s], True) for s, p in PROMPTS.items()),
                     tuple(SeqStart(s, p, opts[s]) for s, p in PROMPTS.items()))
    results = {g: r.execute(first) for g, r in runners.items()}
    assert results[True].token_ids == results[False].token_ids
    pos = {s: len(p) for s, p in PROMPTS.items()}
    accepted = 0
    for step, drafts in enumerate(drafting, 2):
        eager = runners[False]
        k = {s: K if drafts and s != "c" else 0 for s in PROMPTS}
        chunks = tuple(SeqChunk(s, (eager.states[s].output_ids[-1],) + (DRAFT,) * k[s],
                                pos[s], TABLES[s], True, num_drafts=k[s]) for s in PROMPTS)
        plan = StepPlan(step, chunks)
        results = {g: r.execute(plan) for g, r in runners.items()}
        got, want = results[True], results[False]
        assert (got.token_ids, got.num_tokens) == (want.token_ids, want.num_tokens)
        for s in PROMPTS:
            assert runners[True].states[s].output_ids == eager.states[s].output_ids
        for s, n in zip(want.seq_ids, want.num_tokens or (1,) * len(want.seq_ids)):
            pos[s] += n
            accepted += n - 1
    return accepted


def test_draft_model_forwards_replay_its_graphs_as_eager(tmp_path, device):
    """Three sequences (a and b drafting K = 3, c decoding), three verify steps: the
    graphed drafter's drafts, the target's verified tokens and the draft's KV are the eager
    drafter's; its first step's prompt catch-up runs eagerly, every other forward replays
    a graph (greedy, and seeded at T = 0.8 for a)."""
    target = _model(tmp_path / "target", device, seed=1)
    draft_lm = _model(tmp_path / "draft", device, seed=2)    # another model: drafts also fail
    runners = {g: _runner(target, draft_lm, device, g) for g in (False, True)}
    accepted = _steps(runners)
    g, e = runners[True].draft, runners[False].draft
    assert g.forwards == e.forwards == 3 * K
    # the first step's catch-up (the prompts) ran eagerly; the later two replayed verify
    # graphs (1 or 2 tokens a sequence), and every draft's decode forward a decode graph
    assert _replays(g.verify_graphs) == 2 and _replays(g.graphs) == 3 * (K - 1)
    assert g.replays == g.forwards - 1 and e.replays == 0
    for x, y in zip((*g.cache.k, *g.cache.v), (*e.cache.k, *e.cache.v)):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    assert g.done == e.done
    # some drafts held and some did not: catch-ups of both one and two tokens a sequence
    assert 0 < accepted < 2 * 3 * K


def test_the_runner_captures_the_drafts_graphs_beside_its_own(tmp_path, device, monkeypatch):
    """ModelRunner with CUDA graphs and a draft model captures the draft's graphs too (at
    its batch sizes, verify graphs of K + 1 tokens a sequence, over the draft's cache), and
    both models replay them: the same tokens and drafts as eager runners."""
    if not torch.cuda.is_available():      # graphs cannot be captured here: the stand-in
        monkeypatch.setattr(DecodeGraphs, "capture", fake_capture)
    target = _model(tmp_path / "target", device, seed=1)
    draft_lm = _model(tmp_path / "draft", device, seed=2)
    runners = {False: _runner(target, draft_lm, device, False),
               True: _runner(target, draft_lm, device, "runner")}
    graphed = runners[True]
    g = graphed.draft
    assert graphed.cuda_graphs and graphed.cuda_graph_verify_tokens == K + 1
    assert g.graphs is not None and g.graphs.model is draft_lm and g.graphs.attn.cache is g.cache
    assert g.verify_graphs.q == K + 1 and g.graphs.sizes == graphed.graphs.sizes == [1, 2, 4]
    _steps(runners)
    assert g.replays == g.forwards - 1 == 3 * K - 1


def test_an_eagle3_heads_forwards_replay_its_graphs_as_eager(tmp_path, device, monkeypatch):
    """A random EAGLE3 head (its own draft vocabulary, three aux states of the target):
    the runner captures the head's graphs beside its own (gpu/worker/cuda_graphs.py HeadGraphs,
    HeadVerifyGraphs), the head's forwards replay them (its input state a row a second
    input), and the tokens, drafts and the head's KV are an eager runner's."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(DecodeGraphs, "capture", fake_capture)
    dev = torch.device(device)
    target = _model(tmp_path / "target", device, seed=1)
    path = eagle3_head(tmp_path / "head", vocab=96, target_hidden=32, hidden=32, heads=2,
                       kv_heads=1, head_dim=16, inter=48, draft_vocab=40, aux_ids=[0, 1, 2])
    head = load_head(str(path), "eagle3", target, torch.float32, dev)

    def runner(graphs: bool) -> ModelRunner:
        hc = head.config
        drafter = EagleDrafter(head, KVCache(hc.num_hidden_layers, 16, 4, hc.num_key_value_heads,
                                             hc.head_dim, torch.float32, dev), dev, use_triton=True)
        c = target.config
        cache = KVCache(c.num_hidden_layers, 16, 4, c.num_key_value_heads, c.head_dim, torch.float32, dev)
        kw = dict(cuda_graph_max_bs=4, max_model_len=20, verify_tokens=K + 1) if graphs else {}
        return ModelRunner(target, cache, device=dev, use_triton=True, draft=drafter, **kw)

    runners = {False: runner(False), True: runner(True)}
    g, e = runners[True].draft, runners[False].draft
    assert g.graphs is not None and e.graphs is None and g.graphs.attn.cache is g.cache
    assert g.verify_graphs.q == K + 1
    # a plain decode step between verifies leaves two target states a sequence to read
    _steps(runners, drafting=(True, False, True, True))
    assert g.forwards == e.forwards and g.drafted == e.drafted > 0
    # every forward replays but the first verify's first, which reads the prompts' states;
    # a later verify's first forward (at most K + 1 states a sequence) a verify-shaped
    # graph where a sequence reads more than one, the forwards on the head's own states
    # the decode graphs
    assert g.replays == _replays(g.graphs) + _replays(g.verify_graphs) == g.forwards - 1
    assert _replays(g.verify_graphs) >= 1 and _replays(g.graphs) >= 3 * (K - 1)
    assert e.replays == 0
    for x, y in zip((*g.cache.k, *g.cache.v), (*e.cache.k, *e.cache.v)):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
