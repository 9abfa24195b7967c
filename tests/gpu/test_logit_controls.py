"""apply_logit_controls: logit_bias, allowed_token_ids and bad_words over a whole batch."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gpu.interface import SamplingOptions
from gpu.worker.sampler import SeqSamplingState, apply_logit_controls, sample

V = 12
NEG = float("-inf")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))]


def state(output_ids=(), **opts) -> SeqSamplingState:
    st = SeqSamplingState(SamplingOptions(temperature=0.0, **opts), (), fallback_seed=0)
    st.output_ids = list(output_ids)
    return st


def mixed_batch() -> list[SeqSamplingState]:
    return [
        state(logit_bias=((3, 5.0), (7, -100.0))),
        state(allowed_token_ids=(2, 9)),
        # (4, 6): the output ends with 4, so 6 is banned; (1, 2, 8): ends with 1, 5, not 1, 2
        state(output_ids=(0, 4), bad_words_token_ids=((10,), (4, 6), (1, 2, 8))),
        state(),                                                   # no controls
        state(output_ids=(1, 2), allowed_token_ids=(8, 5), logit_bias=((8, 1.5), (0, 9.0)),
              bad_words_token_ids=((1, 2, 8), (3, 4, 5, 6))),   # 8 completes a bad word
        state(output_ids=(), bad_words_token_ids=((4, 6),)),     # no output yet: 6 is free
    ]


def reference(logits: torch.Tensor, states: list[SeqSamplingState]) -> torch.Tensor:
    """Row by row, straight from the definitions."""
    out = logits.clone().float()
    for i, st in enumerate(states):
        o, row = st.opts, out[i]
        if o.allowed_token_ids:
            keep = torch.full_like(row, NEG)
            keep[list(o.allowed_token_ids)] = row[list(o.allowed_token_ids)]
            row.copy_(keep)
        for word in o.bad_words_token_ids:
            prefix = list(word[:-1])
            if not prefix or st.output_ids[-len(prefix):] == prefix:
                row[word[-1]] = NEG
        for tok, bias in o.logit_bias:
            row[tok] += bias
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_matches_the_row_by_row_reference(device):
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(0)).to(device)
    states = mixed_batch()
    expected = reference(logits.cpu(), states)
    got = apply_logit_controls(logits.clone(), states)
    assert got.device.type == device
    torch.testing.assert_close(got.cpu(), expected)
    # spot checks of the rules themselves
    x = logits.cpu()
    assert got[0, 3] == x[0, 3] + 5 and got[0, 7] == x[0, 7] - 100
    assert torch.isfinite(got[1]).nonzero().flatten().tolist() == [2, 9]
    assert got[2, 10] == NEG and got[2, 6] == NEG and got[2, 8] == x[2, 8]
    assert torch.equal(got[3].cpu(), x[3])                       # untouched
    assert torch.isfinite(got[4]).nonzero().flatten().tolist() == [5]
    assert got[4, 5] == x[4, 5]                                   # 8 banned, 0 not allowed
    assert torch.equal(got[5].cpu(), x[5])


def test_a_batch_without_controls_is_returned_as_is():
    logits = torch.randn(3, V)
    before = logits.clone()
    states = [state(), state(min_tokens=2, stop_token_ids=(1,)), state(repetition_penalty=1.3)]
    assert apply_logit_controls(logits, states) is logits
    assert torch.equal(logits, before)


def test_half_precision_logits_come_back_as_float32():
    logits = torch.randn(2, V).to(torch.bfloat16)
    got = apply_logit_controls(logits, [state(logit_bias=((1, 0.25),)), state()])
    assert got.dtype == torch.float32
    assert got[0, 1] == logits[0, 1].float() + 0.25


class _DeviceRecorder(TorchDispatchMode):
    """Every aten op run inside, with the devices of its tensor arguments and results."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, set[str]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat, _ = tree_flatten((args, kwargs, out))
        self.ops.append((str(func), {t.device.type for t in flat if isinstance(t, torch.Tensor)}))
        return out


def test_every_tensor_is_made_on_the_logits_device():
    # On the "meta" device a tensor made on the host (torch.tensor(...) without device=)
    # shows up as a CPU argument of some op: on CUDA it would be a device mismatch or a
    # hidden synchronising copy.
    logits = torch.empty(6, V, device="meta")
    with _DeviceRecorder() as rec:
        got = apply_logit_controls(logits, mixed_batch())
    assert got.device.type == "meta"
    assert rec.ops, "nothing ran"
    assert [op for op, devices in rec.ops if devices != {"meta"}] == []
    assert any("index_put" in op for op, _ in rec.ops)


def test_sampling_follows_the_controls():
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(1))
    top = int(logits.argmax())
    forced = (top + 1) % V
    assert sample(apply_logit_controls(logits.clone(), [st := state(logit_bias=((forced, 100.0),))]),
                  [st]) == [forced]
    assert sample(apply_logit_controls(logits.clone(), [st := state(bad_words_token_ids=((top,),))]),
                  [st]) != [top]
    # random draws stay in the allowed set, and every allowed token is drawn sometimes
    st = SeqSamplingState(SamplingOptions(temperature=2.0, allowed_token_ids=(0, 5, 11)), (), 3)
    flat = torch.zeros(1, V)
    seen = set()
    for _ in range(200):   # each draw is keyed by the output index: the tokens join the output
        seen.add(tok := sample(apply_logit_controls(flat.clone(), [st]), [st])[0])
        st.output_ids.append(tok)
    assert seen == {0, 5, 11}
