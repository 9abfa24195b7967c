"""attrs validators shared by the frozen configurations (pipeline.core.config.EngineConfig,
web.app.AppConfig); None, an unset optional value, passes. Imports nothing heavy, so the
web app can use them without the engine."""
from __future__ import annotations


def positive(inst, attribute, value) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{attribute.name} must be positive, got {value}")


def non_negative(inst, attribute, value) -> None:
    if value is not None and value < 0:
        raise ValueError(f"{attribute.name} must not be negative, got {value}")
