import pytest
import torch

from gpu.kernels.triton.sampling import (
    apply_penalties,
    apply_penalties_ref,
    build_token_counts,
    sample,
    sampling_mask_ref,
    sampling_probs_ref,
)


def _params(B, device, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, steps=0):
    def full(v, dtype):
        t = torch.as_tensor(v, dtype=dtype)
        return (t.expand(B) if t.dim() == 0 else t).contiguous().to(device)
    seeds = torch.arange(B) if seeds is None else seeds
    return dict(temperature=full(temperature, torch.float32), top_k=full(top_k, torch.int32),
                top_p=full(top_p, torch.float32), min_p=full(min_p, torch.float32),
                seeds=full(seeds, torch.int64), steps=full(steps, torch.int64))


def _filters(p):
    return {k: p[k] for k in ("temperature", "top_k", "top_p", "min_p")}


def test_greedy_is_argmax(device):
    g = torch.Generator().manual_seed(0)
    B, V = 8, 5000  # several vocab blocks per row
    logits = (3 * torch.randn(B, V, generator=g)).to(device)
    p = _params(B, device, temperature=0.0, top_k=torch.tensor([0, 5, 0, 1, 0, 0, 50, 0]),
                top_p=torch.tensor([1, 1, .5, 1, .1, 1, .9, 1]), min_p=0.2)
    assert torch.equal(sample(logits, **p), logits.argmax(-1))


def test_sampled_tokens_are_in_the_allowed_set(device):
    """8 filter settings x 32 seeds in one launch; every draw lies in the reference filter's set."""
    g = torch.Generator().manual_seed(1)
    settings = [  # temperature, top_k, top_p, min_p
        (1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.0, 0, 0.6, 0.0), (1.3, 0, 1.0, 0.1),
        (1.0, 10, 0.8, 0.0), (0.5, 20, 0.95, 0.05), (2.0, 3, 0.5, 0.2), (1.0, 1, 1.0, 0.0),
    ]
    n_seeds, V = 32, 61
    rows = [s for s in settings for _ in range(n_seeds)]
    B = len(rows)
    base = 2 * torch.randn(len(settings), V, generator=g)
    logits = base.repeat_interleave(n_seeds, 0).contiguous().to(device)
    t, k, tp, mp = (torch.tensor([r[i] for r in rows]) for i in range(4))
    p = _params(B, device, t, k, tp, mp, seeds=torch.arange(B) * 7919 + 2**40, steps=torch.arange(B) % 5)
    tokens = sample(logits, **p)
    allowed = sampling_mask_ref(logits.cpu(), *(x.cpu() for x in _filters(p).values()))
    assert allowed[torch.arange(B), tokens.cpu()].all()
    # The filters bite: restricted settings never leave their (small) sets, and draws do vary.
    assert (tokens.view(len(settings), n_seeds)[-1] == base[-1].argmax().item()).all()  # top_k = 1
    assert len(set(tokens.view(len(settings), n_seeds)[0].tolist())) > 5


def test_same_seed_and_step_give_the_same_token_in_any_batch(device):
    g = torch.Generator().manual_seed(2)
    V = 40
    row = torch.randn(V, generator=g)
    others = torch.randn(5, V, generator=g)
    batch_a = torch.cat((row[None], others)).to(device)
    batch_b = torch.cat((others[:3], row[None])).to(device)
    seeds_a = torch.tensor([1234, 1, 2, 3, 4, 5])
    seeds_b = torch.tensor([7, 8, 9, 1234])
    for step in (0, 1, 2**33 + 5):
        a = sample(batch_a, **_params(6, device, seeds=seeds_a, steps=step))
        b = sample(batch_b, **_params(4, device, seeds=seeds_b, steps=step, top_p=0.99))
        assert a[0].item() == b[3].item()


def test_different_seeds_and_steps_give_different_tokens(device):
    B, V = 64, 16
    logits = torch.zeros(B, V, device=device)  # uniform: every token equally likely
    by_seed = sample(logits, **_params(B, device, seeds=torch.arange(B) + 100))
    by_step = sample(logits, **_params(B, device, seeds=torch.full((B,), 100), steps=torch.arange(B)))
    for tokens in (by_seed, by_step):
        assert len(set(tokens.tolist())) >= 10  # 64 uniform draws over 16 tokens


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 1.0, 0.0), (5, 0.9, 0.0), (0, 1.0, 0.15)])
def test_sampled_frequencies_match_the_distribution(top_k, top_p, min_p, device):
    B, V = 2000, 8  # 2000 draws in one launch: row b uses seed b
    logits = torch.tensor([[1.0, 0.5, 2.0, -1.0, 0.0, 1.5, 2.2, -0.3]]).expand(B, V).contiguous().to(device)
    p = _params(B, device, temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p, steps=3)
    tokens = sample(logits, **p)
    freq = torch.bincount(tokens.cpu(), minlength=V).float() / B
    probs = sampling_probs_ref(logits[:1].cpu(), *(x[:1].cpu() for x in _filters(p).values()))[0]
    assert (freq[probs == 0] == 0).all()
    # Binomial std of a frequency is <= sqrt(0.25 / 2000) ~ 0.011; allow ~4 sigma.
    assert (freq - probs).abs().max() < 0.045, (freq, probs)


def test_sampling_ref_filter_order():
    """The reference itself: top-p acts on the top-k-renormalized distribution."""
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    one = lambda v, dt=torch.float32: torch.tensor([v], dtype=dt)  # noqa: E731
    mask = sampling_mask_ref(logits, one(1.0), one(2, torch.int32), one(0.5), one(0.0))
    # top-2 renormalized: [4/7, 3/7] -> top-p 0.5 keeps only the first.
    assert mask.tolist() == [[True, False, False, False]]
    mask = sampling_mask_ref(logits, one(1.0), one(0, torch.int32), one(1.0), one(0.3))
    assert mask.tolist() == [[True, True, True, False]]  # min_p: p >= 0.3 * 0.4


def test_apply_penalties_matches_ref(device):
    g = torch.Generator().manual_seed(3)
    B, V = 5, 1500
    logits = (3 * torch.randn(B, V, generator=g)).to(device)
    prompt_ids = torch.randint(0, V, (B, 40), generator=g)
    prompt_ids[1, 10:] = -1
    output_ids = torch.randint(0, V, (B, 30), generator=g)
    output_ids[:, :3] = 7  # repeats
    output_ids[2] = -1  # nothing generated yet
    prompt_mask = build_token_counts(prompt_ids.to(device), V) > 0
    counts = build_token_counts(output_ids.to(device), V)
    rep = torch.tensor([1.0, 1.3, 0.8, 2.0, 1.1], device=device)
    freq = torch.tensor([0.0, 0.5, -0.5, 1.0, 0.2], device=device)
    pres = torch.tensor([0.0, 0.3, 1.0, -0.4, 0.0], device=device)
    out = apply_penalties(logits, prompt_mask, counts, rep, freq, pres)
    ref = apply_penalties_ref(logits, prompt_mask, counts, rep, freq, pres)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[0], logits[0])  # all penalties off


def test_build_token_counts():
    ids = torch.tensor([[3, 3, 1, -1], [-1, -1, -1, -1]])
    counts = build_token_counts(ids, 5)
    assert counts.tolist() == [[0, 1, 0, 2, 0], [0, 0, 0, 0, 0]]
    assert counts.dtype == torch.int32


def test_vocab_chunks_keep_the_first_index_on_ties(device):
    """The vocabulary is split over the grid; the reduction over chunks must keep argmax's
    first-index rule (a tie across chunks goes to the lower chunk)."""
    from gpu.kernels.triton.sampling import _pick_sample_blocks

    V = 5000
    chunk = _pick_sample_blocks(V)["CHUNK"]
    assert V > 2 * chunk  # at least three chunks
    logits = torch.zeros(3, V)
    logits[0, [chunk + 5, 2 * chunk + 1]] = 3.0        # tie across chunks 1 and 2
    logits[1, [7, V - 1]] = 2.0                          # tie across the first and last chunk
    logits[2, V - 1] = 1.0                               # the best in the last, partial chunk
    tokens = sample(logits.to(device), **_params(3, device, temperature=0.0))
    assert tokens.tolist() == [chunk + 5, 7, V - 1]


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 1.0, 0.0), (7, 0.8, 0.0), (0, 1.0, 0.1)])
def test_bf16_logits_sample_as_their_fp32_copy(top_k, top_p, min_p, device):
    """The kernel reads bf16 logits directly (no fp32 copy of the whole vocabulary): the
    same tokens as the fp32 copy of the same values, filters included."""
    g = torch.Generator().manual_seed(13)
    B, V = 24, 3001     # several vocab chunks, a ragged last one
    logits = (torch.randn(B, V, generator=g) * 3).to(torch.bfloat16).to(device)
    p = _params(B, device, temperature=torch.linspace(0.0, 1.5, B), top_k=top_k, top_p=top_p, min_p=min_p,
                seeds=torch.arange(B) * 31 + 5, steps=torch.arange(B) % 3)
    assert torch.equal(sample(logits, **p), sample(logits.float(), **p))


def test_every_philox_output_is_a_draw(device):
    """Flat logits: each column must get its own uniform (output v % 4 of counter v // 4),
    else columns would tie in fours and only every fourth could win."""
    B, V = 4000, 8
    tokens = sample(torch.zeros(B, V, device=device), **_params(B, device, steps=1))
    freq = torch.bincount(tokens.cpu(), minlength=V).float() / B
    assert (freq - 1 / V).abs().max() < 0.03, freq


def test_token_logprobs_gather_the_chosen_ids_of_the_rows_that_ask():
    """logprob_token_ids (issue 37): a row with chosen ids reports its sampled token, then
    those ids once each, in place of its top k; the other rows keep their top k; a k past
    the vocabulary (-1's vocabulary size) is the whole row."""
    from gpu.worker.sampler import token_logprobs

    raw = torch.log_softmax(torch.randn(3, 10, generator=torch.Generator().manual_seed(0)), -1)
    out = token_logprobs(raw, [3, 4, 7], [2, 0, 0], [(), (4, 1, 4, 9), (7,)])
    top_v, top_i = raw[0].topk(2)
    assert out[0] == (raw[0, 3].item(), tuple(top_i.tolist()), tuple(top_v.tolist()))
    assert out[1] == (raw[1, 4].item(), (4, 1, 9), tuple(raw[1, [4, 1, 9]].tolist()))
    assert out[2] == (raw[2, 7].item(), (7,), (raw[2, 7].item(),))
    whole = token_logprobs(raw, [3, 4, 7], [12, 0, 0])
    assert whole[0][1] == tuple(raw[0].argsort(descending=True).tolist())
    assert token_logprobs(raw[:1], [3], [1])[0][1] == (int(raw[0].argmax()),)
