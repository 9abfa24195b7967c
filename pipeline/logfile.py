"""An event log read whole (`Log`): what `tailrace replay` and its timeline read."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import attrs

from pipeline.events import SCHEMA_VERSION, read_events

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
