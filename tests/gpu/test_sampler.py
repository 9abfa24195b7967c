"""The host-path sampler: filters, penalties, seeds, min_tokens."""
from __future__ import annotations

import torch

from gpu.interface import SamplingOptions
from gpu.worker.sampler import SeqSamplingState, apply_penalties, filter_logits, sample

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def draws(opts: SamplingOptions, n: int = 300, logits: torch.Tensor = LOGITS) -> set[int]:
    """n tokens of one sequence (each draw is keyed by the output index: as the runner
    does, each token joins the output before the next draw)."""
    st = SeqSamplingState(opts, (), fallback_seed=5)
    out = set()
    for _ in range(n):
        tok = sample(logits[None].clone(), [st])[0]
        st.output_ids.append(tok)
        out.add(tok)
    return out


def test_greedy_is_argmax():
    assert draws(SamplingOptions(temperature=0.0), n=5) == {0}


def test_top_k_limits_the_support():
    assert draws(SamplingOptions(temperature=1.0, top_k=2)) == {0, 1}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.softmax(LOGITS, -1)          # 0.49, 0.18, 0.11, 0.07, ...
    assert probs[0] < 0.6 < probs[0] + probs[1]
    assert draws(SamplingOptions(temperature=1.0, top_p=0.6)) == {0, 1}


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    kept = filter_logits(LOGITS.clone(), SamplingOptions(temperature=1.0, min_p=0.2))
    probs = torch.softmax(LOGITS, -1)
    assert torch.isfinite(kept).tolist() == (probs >= 0.2 * probs.max()).tolist()


def test_same_seed_same_tokens_whatever_the_batch():
    opts = SamplingOptions(temperature=1.0, seed=42)
    alone = SeqSamplingState(opts, (), 0)
    batched = SeqSamplingState(opts, (), 0)
    other = SeqSamplingState(SamplingOptions(temperature=1.0, seed=1), (), 0)
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    a = [sample(logits[:1].clone(), [alone])[0] for _ in range(10)]
    b = [sample(logits.clone(), [batched, other])[0] for _ in range(10)]
    assert a == b


def test_penalties_follow_hf_and_openai_definitions():
    st = SeqSamplingState(SamplingOptions(repetition_penalty=2.0, frequency_penalty=0.5,
                                          presence_penalty=0.25), prompt_ids=(1,), fallback_seed=0)
    st.output_ids = [0, 0, 4]
    out = apply_penalties(LOGITS.clone(), st)
    expected = LOGITS.clone()
    expected[0] = 2.0 / 2 - 0.5 * 2 - 0.25     # seen in output twice; positive logit divided
    expected[1] = 1.0 / 2                        # seen in the prompt only: repetition penalty only
    expected[4] = -1.0 * 2 - 0.5 - 0.25          # negative logit multiplied
    torch.testing.assert_close(out, expected)


def test_min_tokens_masks_stop_tokens_until_reached():
    opts = SamplingOptions(temperature=0.0, min_tokens=2, stop_token_ids=(0,))
    st = SeqSamplingState(opts, (), 0)
    first = sample(LOGITS[None].clone(), [st])[0]
    st.output_ids.append(first)
    second = sample(LOGITS[None].clone(), [st])[0]
    st.output_ids.append(second)
    third = sample(LOGITS[None].clone(), [st])[0]
    assert first != 0 and second != 0 and third == 0
