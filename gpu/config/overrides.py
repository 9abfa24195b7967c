"""--hf-overrides (vLLM's flag): a JSON object laid over the model's config.json dict before
its family (or the pooling spec) reads it, e.g. a Matryoshka declaration a checkpoint lacks:
`--hf-overrides '{"is_matryoshka": true}'` or `'{"matryoshka_dimensions": [64, 32]}'`.

As vLLM's: a key whose value is an object and whose config value is an object (a nested
config such as `text_config` or `rope_scaling`) is updated key by key, recursively; any
other value replaces the config's (null too). A key the config lacks is added.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def apply_hf_overrides(config: Mapping[str, Any], overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """A new dict: `config` with `overrides` laid over it (neither is changed)."""
    out = dict(config)
    for key, value in (overrides or {}).items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = apply_hf_overrides(out[key], value)
        else:
            out[key] = value
    return out


def check_hf_overrides(value: object) -> dict[str, Any]:
    """The flag's value: a JSON object (a str of one, or a dict); a clear ValueError else."""
    if isinstance(value, str):
        import json
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"--hf-overrides: not JSON: {exc}") from None
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"--hf-overrides must be a JSON object, got {type(value).__name__}")
    return dict(value)
