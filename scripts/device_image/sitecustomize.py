"""Makes this Python look like the lent GPU machine's image: every package that the image
lacks and scripts/fetch_gpu_wheels.sh does not carry fails to import.

    TAILRACE_DEVICE_IMAGE=1 PYTHONPATH=scripts/device_image:$PWD python -c "import pipeline.tools.bench"

Put this folder first on PYTHONPATH: Python imports `sitecustomize` at start-up, and with
TAILRACE_DEVICE_IMAGE=1 it installs a meta-path finder that raises ImportError for those
packages (whatever this venv has installed). scripts/gpu_check.sh's CPU dry run and
tests/kernels/test_device_imports.py use it, so an import the image cannot satisfy fails
here, before a GPU is spent on it.

IMAGE: the package list of the image ('cuda', nvidia-h200), as the device tool's KINDS.md
read it on 2026-11-17. Update it when that list changes.
"""
from __future__ import annotations

import importlib.abc
import importlib.metadata as md
import os
import re
import sys

IMAGE = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio
attrs botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax
e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec
gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio
iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp""".split()

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_OWN = {"gpu", "pipeline", "stages", "web", "scripts", "tests"}   # this repository's packages


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def carried() -> set[str]:
    """The wheels scripts/fetch_gpu_wheels.sh downloads (NAME==VERSION tokens)."""
    try:
        text = open(os.path.join(_ROOT, "scripts", "fetch_gpu_wheels.sh")).read()
    except OSError:
        return set()
    return {norm(m) for m in re.findall(r"([A-Za-z0-9][A-Za-z0-9_.-]*)==[0-9]", text)}


def missing_modules() -> set[str]:
    """Top-level module names installed here whose distribution the image lacks and the
    wheels do not carry."""
    have = {norm(n) for n in IMAGE} | carried()
    out = set()
    for module, dists in md.packages_distributions().items():
        if module in _OWN or module.startswith("_"):
            continue
        if not any(norm(d) in have for d in dists):
            out.add(module)
    return out


class _Blocker(importlib.abc.MetaPathFinder):
    def __init__(self, blocked: set[str]) -> None:
        self.blocked = blocked

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in self.blocked:
            raise ImportError(f"No module named {fullname!r} (not on the GPU image: "
                              f"scripts/device_image/sitecustomize.py)", name=fullname)
        return None


def install(blocked: set[str] | None = None) -> set[str]:
    blocked = missing_modules() if blocked is None else blocked
    sys.meta_path.insert(0, _Blocker(blocked))
    return blocked


if os.environ.get("TAILRACE_DEVICE_IMAGE") == "1":
    install()
