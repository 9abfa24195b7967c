"""Verify steps' CUDA graphs (gpu/worker/cuda_graphs.py VerifyGraphs) on the CUDA code path of a
tiny random Qwen3, on CPU under TRITON_INTERPRET=1. CUDA graphs cannot be captured here,
so a stand-in graph's `replay` runs the recorded forward eagerly over the same static
buffers: what is checked is what a replay computes from them. The real rows must come out
as the eager step's (hidden states, the EAGLE head's auxiliary states, the KV written),
the padding rows must write nothing, and the runner must send a verify step there."""
from __future__ import annotations

import pytest
import torch

from gpu.worker.cuda_graphs import DecodeGraphs, VerifyGraphs
from gpu.interface import SamplingOptions, SeqChunk, SeqStart, StepPlan
from gpu.worker.staging import prepare_step
from tests.support.tiny_runners import fake_capture, runner_pair

BLOCK = 4     # runner_pair's cache: 12 blocks of 4 tokens


def kv(runner):
    return [t.clone() for t in (*runner.cache.k, *runner.cache.v)]


def prefill(runner, prompts: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
    greedy = SamplingOptions(temperature=0.0)
    runner.execute(StepPlan(1, tuple(SeqChunk(s, p, 0, t, True) for s, (p, t) in prompts.items()),
                            tuple(SeqStart(s, p, greedy) for s, (p, _) in prompts.items())))


PROMPTS = {"a": ((3, 9, 4, 1, 7, 2, 8), (0, 1, 2)), "b": ((5, 6, 11, 12, 13), (3, 4, 6)),
           "c": ((2, 2, 9), (5, 7))}


@pytest.mark.parametrize("aux", [(), (1, 2)], ids=["plain", "eagle3-aux"])
@pytest.mark.parametrize("shape", ["ragged", "full"])
def test_verify_graph_rows_equal_eager(tmp_path, device, aux, shape):
    """A verify step (a: 3 drafts, b: 1, c: none) in the graph of 4 sequences x 4 tokens,
    with 9 padding rows; and one that fills its graph exactly (2 x 4, no padding)."""
    lm, _, runner = runner_pair(tmp_path, device)
    prefill(runner, PROMPTS)
    if shape == "ragged":
        chunks = (SeqChunk("a", (10, 4, 4, 5), 7, (0, 1, 2), True, num_drafts=3),
                  SeqChunk("b", (1, 3), 5, (3, 4, 6), True, num_drafts=1),
                  SeqChunk("c", (8,), 3, (5, 7), True))
    else:
        chunks = (SeqChunk("a", (10, 4, 4, 5), 7, (0, 1, 2), True, num_drafts=3),
                  SeqChunk("b", (1, 3, 3, 7), 5, (3, 4, 6), True, num_drafts=3))
    input_ids, positions, meta, _ = prepare_step(chunks, BLOCK, torch.device(device))
    before = kv(runner)
    runner.attn.prepare(meta)
    out = lm(input_ids, positions, runner.attn, aux_layers=aux)
    want, want_aux = (out[0].clone(), out[1].clone()) if aux else (out.clone(), None)
    want_kv = kv(runner)
    for t, b in zip((*runner.cache.k, *runner.cache.v), before):   # back to before the step
        t.copy_(b)

    graphs = VerifyGraphs(lm, runner.attn, max_bs=4, max_blocks=3, device=torch.device(device),
                          tokens_per_seq=4, aux_layers=aux)
    fake_capture(graphs)
    assert graphs.fits(len(meta.q_lens), meta.block_tables.shape[1], meta.max_seqlen_q)
    assert not graphs.fits(len(meta.q_lens), meta.block_tables.shape[1], 5)   # K + 1 at most
    assert not graphs.fits(5, meta.block_tables.shape[1], 4)
    got = graphs.run(input_ids, positions, meta)
    got, got_aux = got if aux else (got, None)
    bs = 4 if shape == "ragged" else 2
    assert graphs.graphs[bs].replays == 1 and sum(g.replays for g in graphs.graphs.values()) == 1
    assert got.shape == want.shape == (input_ids.shape[0], lm.config.hidden_size)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if aux:
        assert got_aux.shape == want_aux.shape
        torch.testing.assert_close(got_aux, want_aux, atol=1e-5, rtol=1e-5)
    # the real rows' KV as eagerly, and the padding rows wrote nowhere (slot -1)
    for x, y in zip(kv(runner), want_kv):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)
    if shape == "ragged":     # the padding sequence: 9 rows, attending to block 0 alone
        assert graphs.seq_lens[3].item() == 16 - 7 and graphs.cu_seqlens_q[4:6].tolist() == [16, 16]


def test_runner_verifies_in_the_graph(tmp_path, device):
    """ModelRunner.forward sends a verify step with drafts to the verify graphs, and a
    pure decode step to the decode graphs; both runners emit the same tokens."""
    lm, _, eager = runner_pair(tmp_path, device)
    _, _, graphed = runner_pair(tmp_path, device)
    dev = torch.device(device)
    graphed.graphs = DecodeGraphs(lm, graphed.attn, max_bs=4, max_blocks=3, device=dev)
    graphed.verify_graphs = VerifyGraphs(lm, graphed.attn, max_bs=4, max_blocks=3, device=dev,
                                         tokens_per_seq=4)
    for g in (graphed.graphs, graphed.verify_graphs):
        fake_capture(g)
    for runner in (eager, graphed):
        prefill(runner, PROMPTS)
    ta, tb, tc = (eager.states[s].output_ids[-1] for s in "abc")
    verify = StepPlan(2, (SeqChunk("a", (ta, 4, 4, 5), 7, (0, 1, 2), True, num_drafts=3),
                          SeqChunk("b", (tb, 3), 5, (3, 4, 6), True, num_drafts=1),
                          SeqChunk("c", (tc,), 3, (5, 7), True)))
    r_eager, r_graph = eager.execute(verify), graphed.execute(verify)
    assert sum(g.replays for g in graphed.verify_graphs.graphs.values()) == 1
    assert (r_graph.token_ids, r_graph.num_tokens) == (r_eager.token_ids, r_eager.num_tokens)
    # a decode step after it: each sequence one token on from what the verify emitted
    nxt = {s: (len(PROMPTS[s][0]) + n, eager.states[s].output_ids[-1])
           for s, n in zip(r_eager.seq_ids, r_eager.num_tokens)}
    decode = StepPlan(3, tuple(SeqChunk(s, (tok,), pos, PROMPTS[s][1], True)
                               for s, (pos, tok) in nxt.items()))
    assert graphed.execute(decode).token_ids == eager.execute(decode).token_ids
    assert sum(g.replays for g in graphed.graphs.graphs.values()) == 1
    assert sum(g.replays for g in graphed.verify_graphs.graphs.values()) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="capturing CUDA graphs needs CUDA")
def test_captured_verify_graphs_equal_eager(tmp_path):
    """On a GPU (scripts/gpu_check.sh step 3): the graphs really captured, replayed for a
    ragged verify step, against the same step run eagerly."""
    lm, _, runner = runner_pair(tmp_path, "cuda")
    prefill(runner, PROMPTS)
    chunks = (SeqChunk("a", (10, 4, 4, 5), 7, (0, 1, 2), True, num_drafts=3),
              SeqChunk("b", (1, 3), 5, (3, 4, 6), True, num_drafts=1))
    input_ids, positions, meta, _ = prepare_step(chunks, BLOCK, torch.device("cuda"))
    graphs = VerifyGraphs(lm, runner.attn, max_bs=4, max_blocks=3, device=torch.device("cuda"),
                          tokens_per_seq=4)
    graphs.capture()
    got = graphs.run(input_ids, positions, meta).clone()
    runner.attn.prepare(meta)
    want = lm(input_ids, positions, runner.attn)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_failed_verify_capture_keeps_the_decode_graphs(tmp_path, device, monkeypatch, caplog):
    """A verify graph capture that fails costs only the verify steps' graphs: the runner
    keeps its decode graphs, runs verify steps eagerly and reports the error (bench's
    `cuda_graph_error`)."""
    from gpu.layers.attention import KVCache
    from gpu.worker.runner import ModelRunner

    def broken(self):
        raise RuntimeError("capture refused")

    monkeypatch.setattr(DecodeGraphs, "capture", fake_capture)
    monkeypatch.setattr(VerifyGraphs, "capture", broken)
    lm, _, _ = runner_pair(tmp_path, device)
    c = lm.config
    cache = KVCache(c.num_hidden_layers, 12, BLOCK, c.num_key_value_heads, c.head_dim, torch.float32,
                    torch.device(device))
    runner = ModelRunner(lm, cache, device=torch.device(device), use_triton=True, cuda_graph_max_bs=4,
                         max_model_len=12, verify_tokens=4)
    assert runner.cuda_graphs and runner.graphs is not None and runner.verify_graphs is None
    assert runner.cuda_graph_verify_tokens == 0
    assert runner.cuda_graph_error == "RuntimeError: capture refused"
    assert "verify steps failed" in caplog.text
    prefill(runner, PROMPTS)
    ta = runner.states["a"].output_ids[-1]
    result = runner.execute(StepPlan(2, (SeqChunk("a", (ta, 4, 4, 5), 7, (0, 1, 2), True, num_drafts=3),)))
    assert len(result.token_ids) == result.num_tokens[0] >= 1      # verified eagerly
    decode = StepPlan(3, (SeqChunk("b", (runner.states["b"].output_ids[-1],), 5, (3, 4, 6), True),))
    runner.execute(decode)
    assert sum(g.replays for g in runner.graphs.graphs.values()) == 1
