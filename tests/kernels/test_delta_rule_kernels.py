"""gpu/kernels/triton/delta_rule.py against gpu/layers/delta_rule.py's torch forms (and
flash-linear-attention's naive recurrence where fla-core is installed): the chunked form over
a padded batch of sequences, from zeros or a carried state, the states read and written in
the pool by slot; the recurrent step; the conv's one-token update. Tiny shapes (the
interpreter runs each program in numpy)."""
import pytest
import torch

from gpu.kernels.triton import delta_rule as kernels
from gpu.layers import delta_rule as ref

HK, HV, DK, DV, S = 2, 4, 16, 8, 5


def _inputs(B, L, dtype=torch.float32, seed=0, alike: int | None = None):
    """alike: that sequence's keys nearly parallel, beta near 1, decays near 1, so that A's
    entries are near 1 and every factor of the chunk's inverse counts."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = r(B, L, HK, DK), r(B, L, HK, DK), r(B, L, HV, DV)
    g = -torch.rand(B, L, HV, generator=gen) * 0.3          # decays exp(g) in (0.74, 1]
    beta = torch.rand(B, L, HV, generator=gen)
    if alike is not None:
        k[alike] = r(1, HK, DK) + 0.05 * k[alike]
        beta[alike], g[alike] = 0.9 + 0.1 * beta[alike], g[alike] * 0.01
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta, r(S, HV, DK, DV) * 0.3


@pytest.mark.parametrize("dtype,lens", [(torch.float32, [70, 5, 64]), (torch.bfloat16, [9, 5, 12])], ids=str)
def test_chunked_matches_the_torch_chunked_form_per_sequence(device, dtype, lens):
    """fp32: past one 64-token chunk, a short one, exactly one; bf16 inputs: short ones."""
    B, L = len(lens), max(lens)
    q, k, v, g, beta, pool = _inputs(B, L, dtype, alike=2)
    slots, carried = torch.tensor([3, -1, 0]), torch.tensor([True, False, False])
    want_o, want_states = [], {}
    for b, n in enumerate(lens):
        init = pool[slots[b]] if carried[b] else None
        o, s = ref.chunked(q[b, :n], k[b, :n], v[b, :n], g[b, :n], beta[b, :n], init)
        want_o.append(o)
        if slots[b] >= 0:
            want_states[int(slots[b])] = s
    state = pool.clone().to(device)
    got = kernels.chunked(*(t.to(device) for t in (q, k, v, g, beta)), torch.tensor(lens, device=device),
                          state, slots.to(device), carried.to(device)).cpu()
    for b, n in enumerate(lens):
        torch.testing.assert_close(got[b, :n], want_o[b], atol=2e-4, rtol=2e-4)
    for slot in range(S):        # kept where a sequence had a slot, untouched elsewhere
        torch.testing.assert_close(state[slot].cpu(), want_states.get(slot, pool[slot]), atol=2e-4, rtol=2e-4)


def test_recurrent_step_matches_torch_and_updates_the_pool_in_place(device):
    B = 3
    q, k, v, g, beta, pool = _inputs(B, 1, seed=1)
    q, k, v, g, beta = q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0]
    slots = torch.tensor([4, 0, 2])
    want_o, want_s = ref.recurrent_step(q, k, v, g, beta, pool[slots].clone())
    state = pool.clone().to(device)
    got = kernels.recurrent_step(*(t.to(device) for t in (q, k, v, g, beta)), state, slots.to(device)).cpu()
    torch.testing.assert_close(got, want_o, atol=1e-5, rtol=1e-5)
    expected_pool = pool.clone()
    expected_pool[slots] = want_s
    torch.testing.assert_close(state.cpu(), expected_pool, atol=1e-5, rtol=1e-5)


def test_chunked_then_steps_equal_fla_naive_recurrence(device):
    """One sequence: 67 tokens chunked, then 3 decode steps, against fla-core's naive
    recurrent gated delta rule over all 70 (q, k l2-normed and repeated to Hv heads first)."""
    naive = _fla_naive()
    q, k, v, g, beta, _ = _inputs(1, 70, seed=2)
    state = torch.zeros(S, HV, DK, DV, device=device)
    slot = torch.tensor([1], device=device)
    d = lambda t: t.to(device)  # noqa: E731
    outs = [kernels.chunked(d(q[:, :67]), d(k[:, :67]), d(v[:, :67]), d(g[:, :67]), d(beta[:, :67]),
                            torch.tensor([67], device=device), state, slot, torch.tensor([False], device=device))[0].cpu()]
    for t in range(67, 70):
        outs.append(kernels.recurrent_step(d(q[:, t]), d(k[:, t]), d(v[:, t]), d(g[:, t]), d(beta[:, t]),
                                           state, slot).cpu())
    got = torch.cat(outs)
    qn, kn = (ref.l2norm(x.float()).repeat_interleave(HV // HK, dim=2) for x in (q, k))
    want, final = naive.naive_recurrent_gated_delta_rule(qn, kn, v, beta, g, output_final_state=True)
    torch.testing.assert_close(got, want[0], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(state[1].cpu(), final[0], atol=2e-4, rtol=2e-4)


def _fla_naive():
    """fla-core's naive.py alone (torch and einops): the package's __init__ takes 10-20 s."""
    import importlib.util

    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core is not installed")
    path = f"{spec.submodule_search_locations[0]}/ops/gated_delta_rule/naive.py"
    module_spec = importlib.util.spec_from_file_location("fla_gated_delta_rule_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_conv1d_step_matches_torch_and_shifts_the_state(device, dtype):
    B, C, K = 3, 40, 4
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(B, 2 * C, generator=gen).to(dtype)[:, :C]          # strided rows, as a projection's
    w = torch.randn(C, K, generator=gen).to(dtype)
    pool = torch.randn(S, C, K - 1, generator=gen).to(dtype)
    slots = torch.tensor([2, 0, 4])
    want, want_state = ref.conv1d_step(x, w, pool[slots])
    state = pool.clone().to(device)
    got = kernels.conv1d_step(x.to(device), w.to(device), state, slots.to(device)).cpu()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    expected = pool.clone()
    expected[slots] = want_state.to(dtype)
    torch.testing.assert_close(state.cpu(), expected, atol=0, rtol=0)
