"""Structured events: JSON lines through structlog, one converter for every message.

Each stage gets a ``log(event, **fields)`` callable bound with its stage name. Events
carry request_id (where there is one), stage and a monotonic timestamp. With no
``--event-log`` the callables are None and stages skip logging entirely (no cost).
The schedule stage logs its whole downstream message (``scheduled``) and emit logs
every byte it sends (``emitted``): that is enough for pipeline.replay to re-run
detokenize, parse, account and emit and reproduce each reply byte for byte.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterator

import attrs
import cattrs
import orjson
import structlog
from cattrs.strategies import configure_union_passthrough

from stages.api import protocol
from stages.api.protocol import ChatCompletionRequest, CompletionRequest, ResponsesRequest
from stages.render import ApiRequest
from stages.schedule import Step

converter = cattrs.Converter()
# Unions of JSON scalars (a Delta's stop_reason: a stop token id or a stop string) pass
# through as they are.
configure_union_passthrough(str | int | float | bool | None, converter)


def _structure_api_request(data: dict, _) -> ApiRequest:
    """A logged typed request back through the protocol's own converter; the API is the
    one whose required field the body holds."""
    cls = next(c for key, c in (("messages", ChatCompletionRequest), ("prompt", CompletionRequest),
                                ("input", ResponsesRequest)) if key in data)
    return protocol.converter.structure(data, cls)


converter.register_structure_hook(ApiRequest, _structure_api_request)


def unstructure(msg) -> dict:
    return converter.unstructure(msg)


def structure_step(data: dict) -> Step:
    """A logged ``scheduled`` message back into the Step schedule sent (finish reasons
    come back as FinishReason members)."""
    return converter.structure(data, Step)


def _add_time(_, __, event_dict):
    event_dict["t"] = time.monotonic()
    return event_dict


class EventLog:
    """An open JSON-lines event file and its structlog logger."""

    def __init__(self, path: str | Path) -> None:
        self._file = open(path, "wb", buffering=1 << 16)
        self._logger = structlog.wrap_logger(
            structlog.BytesLogger(self._file),
            processors=[_add_time, structlog.processors.JSONRenderer(serializer=orjson.dumps)],
        )

    def stage(self, name: str) -> Callable[..., None]:
        bound = self._logger.bind(stage=name)

        def log(event: str, **fields) -> None:
            for k, v in fields.items():
                if attrs.has(type(v)):
                    fields[k] = converter.unstructure(v)
            bound.msg(event, **fields)

        return log

    def close(self) -> None:
        self._file.close()


def read_events(path: str | Path) -> Iterator[dict]:
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                yield orjson.loads(line)
