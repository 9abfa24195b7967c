"""Fixtures for the kernel tests: CUDA when present, else CPU under the Triton interpreter."""

import pytest
import torch


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
