"""A pre-quantized checkpoint's load as on CUDA (the Triton GEMMs' linears forced on this CPU,
gpu/quantization/cuda_linear.py) never holds the model expanded: every tensor torch makes during
the load is tracked by its storage, and the most bytes alive at once beyond what the loaded model
keeps stays under one linear's expansion, whatever the number of layers; the integrate branch's
load (each linear dequantized into a dense weight, then replaced) held them all. The weights
the kernels read are the dense load's, bit for bit."""

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from gpu.loader.decoder import load_model
from gpu.quantization import cuda_linear
from tests.support.quantized_checkpoints import make_quantized

SHAPE = {"num_hidden_layers": 6, "hidden_size": 128, "intermediate_size": 256}
LARGEST_PART = 128 * 256          # gate, up or down: the largest single linear, in elements
# a part's transient expansion while its form is made: its integers (int64), its scale per
# element (fp32) and the repacking's intermediates; measured 32 bytes an element (AWQ)
BYTES_PER_ELEMENT = 40


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages torch ops made (of at least `floor` bytes) alive at once: the
    peak, and now. Sampled after every op, so every allocation's peak is seen."""

    def __init__(self, floor: int = 4096):
        super().__init__()
        self.floor, self.refs, self.peak, self.now = floor, {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta and (st := t.untyped_storage()).nbytes() >= self.floor:
                self.refs[st._cdata] = (StorageWeakRef(st), st.nbytes())
        self.refs = {k: v for k, v in self.refs.items() if not v[0].expired()}
        self.now = sum(n for _, n in self.refs.values())
        self.peak = max(self.peak, self.now)
        return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("load-memory")
    for fmt in ("awq", "fp8-block"):
        make_quantized(fmt, "llama", root / fmt, seed=3, **SHAPE)
    return root


def _load(path, kernels: bool, monkeypatch):
    monkeypatch.setattr(cuda_linear, "wanted", lambda device: kernels)
    with LiveBytes() as live:
        loaded = load_model(path, dtype="float32", progress=False, quantization="auto" if kernels else "none")
    return loaded, live


@pytest.mark.parametrize("fmt", ["awq", "fp8-block"])
def test_a_cuda_load_expands_one_linear_at_a_time(fmt, checkpoints, monkeypatch):
    loaded, live = _load(checkpoints / fmt, True, monkeypatch)
    assert "24 of 24 decoder linears kept quantized and run by the Triton GEMMs" in loaded.weights
    transient = live.peak - live.now
    assert transient <= BYTES_PER_ELEMENT * LARGEST_PART, (transient, live.peak, live.now)
    dense, _ = _load(checkpoints / fmt, False, monkeypatch)
    expanded = sum(p.numel() * 4 for n, p in dense.model.named_parameters() if n.startswith("layers.") and "proj" in n)
    assert expanded > 2 * BYTES_PER_ELEMENT * LARGEST_PART      # the bound excludes the model expanded
    # results unchanged: the kernels read exactly the dense load's weights
    for (name, lin), (_, ref) in zip(_linears(loaded.model), _linears(dense.model)):
        assert isinstance(lin, cuda_linear.QuantLinear), name
        assert torch.equal(lin.dequantized(), ref.weight), name


def _linears(model):
    return [(n, m) for n, m in model.named_modules() if n.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))]


def test_a_module_no_form_fits_falls_back_to_its_dense_weight_with_its_formed_parts(checkpoints, monkeypatch):
    """v_proj's scales fit no form (forced here): q and k, formed before it (the checkpoint's
    order), are dequantized into qkv's dense weight, and the other modules stay quantized."""
    from gpu.quantization.awq import AWQ

    real = AWQ.kernel_parts
    monkeypatch.setattr(AWQ, "kernel_parts",
                        lambda self, prefix, parts: None if prefix.endswith("v_proj") else real(self, prefix, parts))
    path = checkpoints / "awq"
    loaded, _ = _load(path, True, monkeypatch)
    assert "18 of 24 decoder linears kept quantized" in loaded.weights and "6 dequantized at load" in loaded.weights
    dense, _ = _load(path, False, monkeypatch)
    for (name, lin), (_, ref) in zip(_linears(loaded.model), _linears(dense.model)):
        assert isinstance(lin, cuda_linear.QuantLinear) != name.endswith("qkv_proj"), name
        got = lin.weight if name.endswith("qkv_proj") else lin.dequantized()
        assert torch.equal(got, ref.weight), name
