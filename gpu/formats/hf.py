"""Read a Hugging Face model directory: config.json, generation_config.json, *.safetensors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

if TYPE_CHECKING:   # safe_open(framework="pt") imports torch when tensors are read
    import torch


def read_json(path: Path) -> dict[str, Any]:
    """A JSON file of the model directory; {} when it is absent."""
    return json.loads(path.read_text()) if path.is_file() else {}


def safetensors_files(model_dir: Path) -> list[Path]:
    """The shards listed in model.safetensors.index.json, else every *.safetensors file."""
    index = read_json(model_dir / "model.safetensors.index.json")
    if index:
        files = [model_dir / f for f in dict.fromkeys(index["weight_map"].values())]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def count_tensors(files: list[Path]) -> int:
    return len(tensor_names(files))


def tensor_names(files: list[Path]) -> list[str]:
    """Every tensor's name (read from the headers only)."""
    names = []
    for f in files:
        with safe_open(f, framework="pt") as st:
            names += st.keys()
    return names


def named_tensors(files: list[Path], select=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor. select(name, shape) -> a tuple of slices: read only that
    part (a tensor-parallel rank's shard: safetensors reads just those bytes), or None: all."""
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                part = st.get_slice(name) if select is not None else None
                index = select(name, tuple(part.get_shape())) if part is not None else None
                yield name, st.get_tensor(name) if index is None else part[index]
