"""An event log read whole (`Log`): what `tailrace replay` and its timeline read."""
from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import attrs

from pipeline.core.events import SCHEMA_VERSION, read_events

# Every event type this version writes (docs/events.md); others are reported, not fatal.
KNOWN_EVENTS = frozenset({
    "header", "received", "rendered", "rejected", "render_failed", "admitted", "dropped",
    "scheduled", "step", "step_failed", "detokenized", "stop_string", "parsed", "accounted",
    "finished", "emitted", "reply_end", "log_error"})


@attrs.define
class Log:
    """An event log read whole: its header, its events, and what reading it warned."""
    header: dict
    events: list[dict]
    warnings: list[str]

    @classmethod
    def read(cls, path: str | Path) -> Log:
        warnings: list[str] = []
        events = list(read_events(path, warn=warnings.append))
        header = events[0] if events and events[0].get("event") == "header" else {}
        if not header:
            warnings.append("the log has no header line (an older tailrace wrote it): "
                            "the tokenizer and parsers come from the flags or the defaults")
        schema = header.get("schema_version", SCHEMA_VERSION)
        if isinstance(schema, int) and schema > SCHEMA_VERSION:
            warnings.append(f"the log has schema version {schema}, newer than this tailrace "
                            f"reads ({SCHEMA_VERSION}): replaying what it understands")
        unknown: dict[str, int] = defaultdict(int)
        for ev in events:
            if ev.get("event") not in KNOWN_EVENTS:
                unknown[str(ev.get("event"))] += 1
        for name, count in sorted(unknown.items()):
            warnings.append(f"unknown event type {name!r} ({count} lines): ignored")
        return cls(header, events, warnings)


# -- a run of --api-server-count: the engine's file PATH and each frontend's PATH.frontend-K
def frontend_logs(path: str | Path) -> list[Path]:
    """The frontends' files of a multi-process run beside the engine's (none: one process).
    Each has the engine's header and replays on its own: it logs every Step it received."""
    path = Path(path)
    pattern = re.compile(re.escape(path.name) + r"\.frontend-(\d+)$")
    found = [(int(m.group(1)), p) for p in path.parent.glob(path.name + ".frontend-*")
             if (m := pattern.match(p.name))]
    return [p for _, p in sorted(found)]


def _renamed(value, prefix: str):
    """`value` with every request id under `prefix` (frontend K's "id" is the engine's "K:id")."""
    if isinstance(value, dict):
        out = {k: _renamed(v, prefix) for k, v in value.items()}
        if isinstance(out.get("request_id"), str):
            out["request_id"] = prefix + out["request_id"]
        if "replies" in out and isinstance(out["replies"], list):
            out["replies"] = [[prefix + r[0], *r[1:]] if isinstance(r, list) and r else r
                              for r in out["replies"]]
        return out
    if isinstance(value, list):
        return [_renamed(v, prefix) for v in value]
    return value


def joined(path: str | Path) -> Log:
    """One Log of a multi-process run, for the timeline: the engine's steps (its
    `scheduled` plans and `step` durations) and every frontend's requests, on their common
    clock (CLOCK_MONOTONIC is one clock for every process), each request named as the
    engine names it ("K:id")."""
    engine = Log.read(path)
    events: list[dict] = []
    for ev in engine.events[1:]:
        if ev.get("event") == "scheduled":   # the requests come from the frontends' copies
            msg = {k: v for k, v in (ev.get("message") or {}).items()
                   if k not in ("new_requests", "deltas")}
            ev = {**ev, "message": msg}
        events.append(ev)
    warnings = list(engine.warnings)
    for k, part in enumerate(frontend_logs(path)):
        log = Log.read(part)
        warnings += [f"{part.name}: {w}" for w in log.warnings]
        events += [_renamed(ev, f"{k}:") for ev in log.events[1:]]
    events.sort(key=lambda ev: ev.get("t", 0.0))
    return Log(engine.header, [engine.header, *events] if engine.header else events, warnings)
