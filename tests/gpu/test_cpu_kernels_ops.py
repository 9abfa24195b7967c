"""gpu/layers/ops.py's CPU ops through gpu/kernels/cpu/ops.c against their torch code (the same
functions with the kernels off): fp32 within 1e-6 relative (only the order of the norm's
sum of squares differs), bf16 within one bf16 rounding (2^-8 relative)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from gpu.kernels.cpu import ops as cpu_kernels


from gpu.layers import ops
pytestmark = pytest.mark.skipif(cpu_kernels.kernels() is None, reason="no C compiler (or TAILRACE_CPU_KERNELS=0)")
DTYPES = [torch.float32, torch.bfloat16]
BOUNDS = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.bfloat16: dict(rtol=2.0 ** -8, atol=1e-5)}


@pytest.fixture
def torch_ops(monkeypatch):
    """Call an op with the kernels off: its torch code."""
    def call(fn, *args):
        with monkeypatch.context() as m:
            m.setattr(ops, "_cpu", lambda: None)
            return fn(*args)
    return call


def close(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **BOUNDS[want.dtype])


@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("r_dtype", DTYPES)
@pytest.mark.parametrize("w_dtype", DTYPES)
def test_fused_add_rms_norm(torch_ops, x_dtype, r_dtype, w_dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 576, generator=g) * 3).to(x_dtype)
    res = torch.randn(37, 576, generator=g).to(r_dtype)
    w = (torch.rand(576, generator=g) + 0.5).to(w_dtype)
    got, want = ops.fused_add_rms_norm(x, res, w, 1e-5), torch_ops(ops.fused_add_rms_norm, x, res, w, 1e-5)
    close(got[1], want[1])
    close(got[0], want[0])
    close(ops.rms_norm(x, w, 1e-6), torch_ops(ops.rms_norm, x, w, 1e-6))


# In a fresh interpreter (no OpenMP team yet on its main thread), with a team of two: a
# norm under PARALLEL_MIN elements (gpu/kernels/cpu/ops.c) starts no thread, one past it starts
# the team's worker, and the threaded result is the serial one's.
THREADS = r"""
import os, torch
from gpu.kernels.cpu import ops as cpu_kernels
torch.set_num_threads(2)          # the team the kernels get (libgomp's, shared with torch)
def tasks(): return len(os.listdir("/proc/self/task"))
k, g = cpu_kernels.kernels(), torch.Generator().manual_seed(0)
w, small, big = torch.rand(512, generator=g), torch.randn(4, 512, generator=g), torch.randn(300, 512, generator=g)
base = tasks()
k.add_rms_norm(small, None, w, 1e-6)
after_small = tasks()
threaded = k.add_rms_norm(big, None, w, 1e-6)[0]
after_big = tasks()
serial = torch.cat([k.add_rms_norm(big[i:i + 4], None, w, 1e-6)[0] for i in range(0, 300, 4)])
print(base, after_small, after_big, torch.equal(threaded, serial))
"""


def test_a_big_norm_runs_threaded(torch_ops):
    """The big norm's rows are split over the OpenMP team: its worker thread appears with
    it (and not with a small one), and the rows come out as the serial loop's."""
    x, w = torch.randn(300, 512), torch.rand(512)     # past PARALLEL_MIN elements
    close(ops.rms_norm(x, w, 1e-6), torch_ops(ops.rms_norm, x, w, 1e-6))
    done = subprocess.run([sys.executable, "-c", THREADS], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    base, after_small, after_big, same = done.stdout.split()
    assert int(after_small) == int(base)              # serial: no team started
    assert int(after_big) == int(base) + 1            # the team of two: one worker thread
    assert same == "True"


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope(torch_ops, dtype):
    """q and k as the model hands them: strided views into one qkv row."""
    from gpu.config.model import ModelConfig
    cfg = ModelConfig(architecture="llama", vocab_size=10, hidden_size=64 * 3, intermediate_size=8,
                      num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=1, head_dim=64,
                      rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=300)
    cos_sin = ops.build_rope_cache(cfg, 300)
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(11, 5 * 64, generator=g).to(dtype)
    q, k, _ = qkv.split([3 * 64, 64, 64], dim=-1)
    q, k = q.reshape(11, 3, 64), k.reshape(11, 1, 64)
    pos = torch.randint(0, 300, (11,), generator=g)
    got, want = ops.apply_rope(q, k, pos, cos_sin), torch_ops(ops.apply_rope, q, k, pos, cos_sin)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])   # same roundings, in order
    with pytest.raises(IndexError):   # beyond the table: the kernel declines, torch raises
        ops.apply_rope(q, k, pos + 300, cos_sin)


def test_autograd_and_odd_shapes_keep_torch():
    w = torch.ones(8, requires_grad=True)
    x = torch.randn(4, 8)
    assert cpu_kernels.kernels().add_rms_norm(x, None, w, 1e-6) is None
    with torch.no_grad():
        assert cpu_kernels.kernels().add_rms_norm(x, None, w, 1e-6) is not None
    assert cpu_kernels.kernels().add_rms_norm(x.t(), None, w[:4].detach(), 1e-6) is None  # not contiguous


@pytest.mark.parametrize("w_dtype", DTYPES)
def test_exact_top_logits(torch_ops, w_dtype):
    """The C pass recomputes the same near-top entries as the torch code, to fp32 rounding,
    and leaves the rest alone (rows of 4099: a tail past the 16-wide loop)."""
    from gpu.models.causal_lm import exact_top_logits
    g = torch.Generator().manual_seed(3)
    weight = (torch.randn(4099, 64, generator=g) * 0.5).to(w_dtype)
    hidden = weight[7].float() * 2 + torch.randn(9, 64, generator=g) * 0.1
    hidden[3] = weight[4098].float() * 3              # the top in the tail
    logits = (hidden.bfloat16() @ weight.bfloat16().T).float()
    got = exact_top_logits(logits.clone(), hidden, weight)
    want = torch_ops(exact_top_logits, logits.clone(), hidden, weight)
    top = logits.amax(-1, keepdim=True)
    near = logits >= top - top.abs() * 2.0 ** -6
    assert torch.equal(got[~near], logits[~near])                    # the rest untouched
    assert (got[near] != logits[near]).any()                         # the near ones recomputed
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    assert int(got.argmax(-1)[3]) == 4098


def test_argmax_rows_is_torchs_first_maximal_index():
    """gpu/worker/sampler.py greedy_tokens' C pass: the first maximal index of each row, as
    max(dim=-1).indices gives, ties, all -inf and NaN rows included; other arguments declined."""
    k = cpu_kernels.kernels()
    g = torch.Generator().manual_seed(0)
    for shape in ((1, 262144), (5, 4099), (3, 64), (2, 1)):
        x = torch.randn(*shape, generator=g)
        x[0] = float("-inf")                          # all -inf: index 0
        if shape[0] > 2:
            x[1, shape[1] // 2:] = x[1].max() + 1     # a tie: the first
            x[2, shape[1] // 3] = float("nan")        # a NaN counts as the maximum
            x[2, -1] = float("nan")
        assert k.argmax_rows(x).tolist() == x.max(dim=-1).indices.tolist(), shape
    assert k.argmax_rows(torch.randn(2, 8, dtype=torch.bfloat16)) is None
    assert k.argmax_rows(torch.randn(8, 2).t()) is None
