"""Read a Hugging Face model directory: config.json, generation_config.json, *.safetensors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open


def read_json(path: Path) -> dict[str, Any]:
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


def named_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)
