"""Fixtures for the kernel tests: CUDA when present, else CPU under the Triton interpreter."""

import json

import pytest
import torch

from tests.support.tiny_runners import TINY_QWEN3


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# Per-dtype tolerances for outputs of magnitude ~1 computed in fp32 and rounded on store.
TOLERANCES = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2.5e-2, rtol=2e-2),
}


@pytest.fixture
def tol():
    return lambda dtype: TOLERANCES[dtype]


@pytest.fixture
def tiny_qwen3_dir(tmp_path):
    """A folder holding TINY_QWEN3's config.json (load it with load_format="dummy")."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_QWEN3))
    return tmp_path


# Each case's error against its reference, for scripts/gpu_check.sh's kernels_tests.json: every
# torch.testing.assert_close a test makes is measured before it is judged (a failing one
# too), and the worst, relative to its tolerance, goes into the junit report as properties
# (max_abs_err, atol, rtol, ratio: the largest |actual - expected| / (atol + rtol |expected|),
# over 1 fails). A miss can then be judged from the file: by how much, against what.
_DEFAULT_TOL = {torch.float16: (1e-5, 1e-3), torch.bfloat16: (1e-5, 1.6e-2), torch.float32: (1e-5, 1.3e-6),
                torch.float64: (1e-7, 1e-7)}   # assert_close's own (atol, rtol) per dtype


def _closeness(actual, expected, atol, rtol) -> dict | None:
    if not (isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor)):
        return None
    if actual.shape != expected.shape or actual.numel() == 0:
        return None
    if atol is None or rtol is None:
        d_atol, d_rtol = _DEFAULT_TOL.get(expected.dtype, (0.0, 0.0))
        atol, rtol = (d_atol if atol is None else atol), (d_rtol if rtol is None else rtol)
    a, e = actual.detach().double(), expected.detach().to(actual.device).double()
    finite = torch.isfinite(a) & torch.isfinite(e)
    err = (a - e).abs().where(finite, torch.zeros((), dtype=a.dtype, device=a.device))
    ratio = err / (atol + rtol * e.abs()) if atol + rtol > 0 else (err > 0).double() * float("inf")
    return dict(max_abs_err=float(err.max()), atol=float(atol), rtol=float(rtol),
                ratio=float(ratio.max()), dtype=str(expected.dtype).removeprefix("torch."),
                shape=list(expected.shape), nonfinite_mismatch=int((torch.isfinite(a) != torch.isfinite(e)).sum()))


@pytest.fixture(autouse=True)
def _record_closeness(monkeypatch, record_property):
    seen = []
    assert_close = torch.testing.assert_close

    def measured(actual, expected, *args, **kwargs):
        try:
            st = _closeness(actual, expected, kwargs.get("atol"), kwargs.get("rtol"))
        except Exception:  # noqa: BLE001 - measuring must never change a test's outcome
            st = None
        if st is not None:
            seen.append(st)
        return assert_close(actual, expected, *args, **kwargs)

    monkeypatch.setattr(torch.testing, "assert_close", measured)
    yield
    if seen:
        worst = max(seen, key=lambda st: st["ratio"])
        record_property("compared", len(seen))
        for key, value in worst.items():
            record_property(key, value)
