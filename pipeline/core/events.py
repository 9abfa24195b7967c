"""Structured events: JSON lines (orjson), one converter for every message.

The schema is docs/events.md. Each stage gets a ``log(event, **fields)`` callable bound
with its stage name; it only queues the event, and a writer thread serialises it. Events carry request_id (where there is one), stage and a
monotonic timestamp ``t``; the first line of every file (``header``) pairs one ``t``
with the wall clock and records what replay needs to run without flags: the versions,
the model, the tokenizer's hash and every flag that changes framing or parsing. With no
``--event-log`` the callables are None and stages skip logging entirely (no cost).

schedule logs its whole downstream message (``scheduled``), detokenize, parse and
account what they added to it (``detokenized``, ``parsed``, ``accounted``) and emit
every byte it sends (``emitted``): enough for pipeline.tools.replay to re-run those four
stages, reproduce each reply byte for byte and name the first stage that differs.

Secrets never reach the file: a ``headers`` or ``body`` field goes through `redact`.
With ``max_bytes`` the file rotates like logging's RotatingFileHandler (PATH.1 is the
newest old file, PATH.N the oldest; ``backup_count`` are kept); every file starts with
the header, and `event_files` lists a rotated set oldest first.
"""
from __future__ import annotations

import base64
import collections
import hashlib
import os
import re
import threading
import time
import warnings
from pathlib import Path
from typing import Callable, Iterable, Iterator

import attrs
import cattrs
import orjson
from cattrs.gen import make_dict_structure_fn
from cattrs.strategies import configure_union_passthrough

from gpu.interface import ImageInput, StepPlan
from stages.api import APIS, common
from stages.delta import Delta
from stages.messages import RenderedRequest, Step

SCHEMA_VERSION = 1

converter = cattrs.Converter()
# Unions of JSON scalars (a Delta's stop_reason: a stop token id or a stop string) pass
# through as they are.
configure_union_passthrough(str | int | float | bool | None, converter)


def _old_reply_spec(api: str, typed: dict) -> dict:
    """The ReplySpec of a request logged before there was one, from its typed request
    (logged whole): the API's own reply_spec of it, back through the protocol's converter."""
    spec = APIS[api]
    return converter.unstructure(spec.reply_spec(common.converter.structure(typed, spec.request)))


_structure_rendered_request = make_dict_structure_fn(RenderedRequest, converter)


def _structure_rendered(data: dict, cls: type) -> RenderedRequest:
    if "reply" not in data:   # logged before ReplySpec: the typed request (None in an engine's)
        typed = data.get("request")
        data = {**data, "reply": {**({} if typed is None else _old_reply_spec(data["api"], typed)),
                                  "prompt_tokens_details": True}}
    if "prompt_tokens_details" not in data["reply"]:
        # logged before --enable-prompt-tokens-details (issue 34): replies then always had them
        data = {**data, "reply": {**data["reply"], "prompt_tokens_details": True}}
    return _structure_rendered_request(data, cls)


converter.register_structure_hook(RenderedRequest, _structure_rendered)
# a picture (issue 34) is logged by its place and content hash (and Qwen2.5-VL's patch
# grid, which its positions follow), without its pixels
converter.register_unstructure_hook(
    ImageInput, lambda im: {"offset": im.offset, "length": im.length, "hash": im.hash,
                            **({"grid": list(im.grid)} if im.grid is not None else {})})
converter.register_structure_hook(
    ImageInput, lambda d, _: ImageInput(d["offset"], d["length"], d["hash"], None,
                                        tuple(d["grid"]) if "grid" in d else None))
# a pooled vector (Delta.pooled: float32 bytes) is logged as base64
converter.register_structure_hook(bytes, lambda value, _: base64.b64decode(value))


def _unstructure_plan(plan: StepPlan) -> dict:
    """A step's plan, small: each chunk as [sequence id, start position, tokens, samples]
    (no block tables, prompts or grammars)."""
    return {"step": plan.step,
            "chunks": [[c.seq_id, c.start_pos, len(c.token_ids), c.sample] for c in plan.chunks],
            "new_seqs": [s.seq_id for s in plan.new_seqs]}


converter.register_unstructure_hook(StepPlan, _unstructure_plan)


def unstructure(msg) -> dict:
    return converter.unstructure(msg)


def structure_step(data: dict) -> Step:
    """A logged ``scheduled`` message back into the Step schedule sent (finish reasons
    come back as FinishReason members)."""
    return converter.structure(data, Step)


# -- what each stage adds to a Delta (detokenized / parsed / accounted events) -------------
STAGE_FIELDS: dict[str, tuple[str, ...]] = {
    "detokenized": ("text", "logprobs", "finish_reason", "stop_reason"),
    "parsed": ("content", "reasoning", "tool_calls", "finish_reason"),
    "accounted": ("usage", "metrics"),
}


def stage_deltas(event: str, deltas: Iterable[Delta]) -> list[dict]:
    """Per delta, what `event`'s stage added, small: detokenize's text, logprobs and a stop
    string's finish; parse's content (only where it is not the text), reasoning, tool calls
    and a tool_calls finish; account's final usage and metrics. A delta with nothing to say
    is left out (so a plain reply logs no parse rows at all)."""
    out = []
    for d in deltas:
        row: dict = {}
        if event == "detokenized":
            if d.text:
                row["text"] = d.text
            if d.logprobs:
                row["logprobs"] = d.logprobs
            if d.finish_reason is not None:
                row["finish_reason"] = d.finish_reason
                if d.stop_reason is not None:
                    row["stop_reason"] = d.stop_reason
        elif event == "parsed":
            if d.content != d.text:
                row["content"] = d.content
            if d.reasoning:
                row["reasoning"] = d.reasoning
            if d.tool_calls:
                row["tool_calls"] = d.tool_calls
            if d.finish_reason == "tool_calls":
                row["finish_reason"] = d.finish_reason
        elif d.finish_reason is not None or d.metrics is not None:   # accounted
            row["usage"] = d.usage
            if d.metrics is not None:
                row["metrics"] = d.metrics
        if row:
            row["request_id"] = d.request_id
            if d.index:
                row["index"] = d.index
            out.append(row)
    return out


def plain(rows):
    """Rows as JSON values (what reading the log back gives), for comparing with it."""
    return orjson.loads(dumps(rows))


# -- secrets -------------------------------------------------------------------------------
REDACTED = "[redacted]"
# A header named like a credential (Authorization, X-Api-Key, Cookie, X-Auth-Token...).
_SECRET_HEADER = re.compile(r"auth|api[-_]?key|secret|token|passw|cookie|credential|session|"
                            r"signature|private", re.I)
# A body key named like one (not max_tokens and the like: whole names only).
_SECRET_KEY = re.compile(r"^(x[-_])?(authorization|api[-_]?keys?|secret|client[-_]secret|"
                         r"password|passwd|access[-_]token|refresh[-_]token|auth[-_]token|"
                         r"id[-_]token|bearer|cookie|credentials?|private[-_]key)$", re.I)
_BEARER = re.compile(r"^\s*(bearer|basic)\s+\S", re.I)


def redact_headers(headers) -> dict[str, str]:
    items = headers.items() if hasattr(headers, "items") else headers
    return {str(k).lower(): REDACTED if _SECRET_HEADER.search(str(k)) or _BEARER.match(str(v))
            else str(v) for k, v in items}


def redact(value, secrets: frozenset[str] = frozenset()):
    """A copy of a JSON body with every credential-named key's value, every "Bearer ..."
    string and every string holding one of `secrets` replaced by [redacted]."""
    if isinstance(value, dict):
        return {k: REDACTED if isinstance(k, str) and _SECRET_KEY.match(k) else redact(v, secrets)
                for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v, secrets) for v in value]
    if isinstance(value, str) and (_BEARER.match(value) or any(s in value for s in secrets)):
        return REDACTED
    return value


# -- the header ----------------------------------------------------------------------------
# EngineConfig fields that change how a request is rendered, parsed or framed.
HEADER_FLAGS = ("served_model_name", "reasoning_parser", "enable_auto_tool_choice",
                "tool_call_parser", "tool_parser_plugin", "exclude_tools_when_tool_choice_none",
                "chat_template", "generation_config", "override_generation_config",
                "enable_force_include_usage", "enable_per_request_metrics",
                "skip_tokenizer_init", "max_model_len", "seed", "tokenizer")


def tokenizer_hash(tokenizer) -> str | None:
    """The tokenizer's identity: sha256 of its tokenizer.json (as the tokenizers library
    writes it, so a GGUF's tokenizer and the same tokenizer.json hash alike)."""
    if tokenizer is None:
        return None
    return "sha256:" + hashlib.sha256(tokenizer.hf.to_str().encode()).hexdigest()


def tailrace_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tailrace")
    except PackageNotFoundError:
        return "unknown"


def make_header(cfg, *, model_path: str | None, model_name: str, tokenizer,
                served_model_names: tuple[str, ...], max_model_len: int,
                kv_blocks_total: int, block_size: int, parsers=None, cache_block: int = 0) -> dict:
    """The fields of the header line (the event, stage and times are added on writing).
    `parsers` (pipeline.core.parts.Parsers): the parsers the server resolved from the flags and
    the model (gpt-oss implies Harmony's), recorded apart from the flags as given."""
    flags = {name: getattr(cfg, name) for name in HEADER_FLAGS}
    flags["served_model_name"] = list(served_model_names)
    flags["max_model_len"] = max_model_len
    if cfg.chat_template is not None:   # the source, whether given as a file or inline
        path = Path(cfg.chat_template)
        source = (path.read_text() if len(cfg.chat_template) < 4096 and path.is_file()
                  else cfg.chat_template)
        flags["chat_template"] = source
    return {"schema_version": SCHEMA_VERSION, "tailrace_version": tailrace_version(),
            "model": model_path, "model_name": model_name,
            "tokenizer_path": cfg.tokenizer or model_path, "tokenizer_hash": tokenizer_hash(tokenizer),
            "flags": flags, "parsers": None if parsers is None else {
                "reasoning_parser": parsers.reasoning_parser,
                "tool_call_parser": parsers.tools.tool_call_parser,
                "enable_auto_tool_choice": parsers.tools.enable_auto_tool_choice,
                "exclude_tools_when_tool_choice_none":
                    parsers.tools.exclude_tools_when_tool_choice_none,
                "harmony": parsers.harmony},
            "kv_blocks_total": kv_blocks_total, "block_size": block_size,
            # the prefix cache's block size (0: none): usage's created_cache_tokens
            "cache_block": cache_block}


# -- writing -------------------------------------------------------------------------------
_FIELDS: dict[type, tuple[str, ...]] = {}


# A delta is written as the fields that differ from their defaults. Every default is
# None or falsy ((), "", 0, 0.0), so a field is written when it is truthy, or, where its
# default is None (or it has none), when it is not None: a stop token id 0 still shows.
_WRITE_UNLESS_NONE = frozenset(a.name for a in attrs.fields(Delta)
                               if a.default is attrs.NOTHING or a.default is None)
if any(a.default for a in attrs.fields(Delta) if a.default is not attrs.NOTHING):
    raise TypeError("a Delta field has a default the event log does not expect")


def _write_delta(d: Delta) -> dict:
    """A Delta as a dict of its fields that differ from their defaults, in field order (the
    writer thread writes one per sequence per step, four times; Delta is a dict class,
    so its fields are its instance dict)."""
    return {k: v for k, v in vars(d).items() if v or (v is not None and k in _WRITE_UNLESS_NONE)}
_STEP_FIELDS = tuple(a.name for a in attrs.fields(Step))


def _json_default(obj):
    """orjson's hook for what it cannot write itself: a Delta as its fields that differ
    from their defaults, a RenderedRequest whole (its ReplySpec nested), other attrs
    classes as their fields."""
    cls = type(obj)
    if cls is bytes:   # a pooled vector
        return base64.b64encode(obj).decode("ascii")
    if cls is Step:   # its deltas built here: a callback per Delta from orjson costs more
        out = {name: getattr(obj, name) for name in _STEP_FIELDS}
        out["deltas"] = [_write_delta(d) for d in obj.deltas]
        return out
    if cls is Delta:
        return _write_delta(obj)
    if cls is StepPlan:
        return _unstructure_plan(obj)
    if cls is RenderedRequest:
        return converter.unstructure(obj)
    names = _FIELDS.get(cls)
    if names is None:
        if not attrs.has(cls):
            raise TypeError(f"cannot write {cls.__name__} to the event log")
        names = _FIELDS[cls] = tuple(a.name for a in attrs.fields(cls))
    return {name: getattr(obj, name) for name in names}


def dumps(value) -> bytes:
    return orjson.dumps(value, default=_json_default)


class _Sink:
    """The file: appends lines, rotating by size. Lines are buffered and flushed at the end
    of each reply (and on close), not every line."""

    def __init__(self, path: Path, max_bytes: int, backup_count: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backup_count = backup_count
        self.header = b""
        self.file = open(path, "wb", buffering=1 << 16)
        self.size = 0

    def write(self, line: bytes) -> None:
        if self.max_bytes and self.size and self.size + len(line) > self.max_bytes:
            self._rotate()
        self.file.write(line)
        self.size += len(line)

    def _rotate(self) -> None:
        self.file.close()
        if self.backup_count > 0:
            for i in range(self.backup_count - 1, 0, -1):
                src = self.path.with_name(f"{self.path.name}.{i}")
                if src.exists():
                    os.replace(src, self.path.with_name(f"{self.path.name}.{i + 1}"))
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        else:
            os.remove(self.path)
        self.file = open(self.path, "wb", buffering=1 << 16)
        self.file.write(self.header)
        self.size = len(self.header)

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class EventLog:
    """An open JSON-lines event file (rotated by size when max_bytes).

    A stage's `log(event, **fields)` only appends (event, stage, time, fields) to a queue:
    no serialisation on the stage's path, whatever the batch. A writer thread turns the
    queue into lines (Steps and deltas are frozen, so it reads them safely), in the order
    logged; when it falls more than MAX_QUEUED entries behind, the logging stage writes
    the backlog itself, which bounds the memory. `write_header` writes the first line;
    every rotated file repeats it."""

    MAX_QUEUED = 8192

    def __init__(self, path: str | Path, *, max_bytes: int = 0, backup_count: int = 0,
                 secrets: frozenset[str] = frozenset()) -> None:
        self.path = Path(path)
        self._sink = _Sink(self.path, max_bytes, backup_count)
        self.secrets = secrets     # strings never written (the API keys)
        self._queue: collections.deque = collections.deque()
        self._lock = threading.Lock()          # one writer of the file at a time
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tailrace-event-log", daemon=True)
        self._thread.start()

    def write_header(self, fields: dict) -> None:
        line = orjson.dumps({"event": "header", "stage": "engine", "t": time.monotonic(),
                             "wall_time": time.time(), **fields}) + b"\n"
        with self._lock:
            self._sink.header = line
            self._sink.write(line)
            self._sink.flush()

    def stage(self, name: str) -> Callable[..., None]:
        queue, wake, monotonic = self._queue, self._wake, time.monotonic

        def log(event: str, **fields) -> None:
            queue.append((event, name, monotonic(), fields))
            if len(queue) > self.MAX_QUEUED:
                self._drain()
            elif not wake.is_set():
                wake.set()

        return log

    # -- the writer --------------------------------------------------------------------
    def _run(self) -> None:
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            self._drain(yield_gil=True)

    def _drain(self, yield_gil: bool = False) -> None:
        """Write what is queued. The writer thread lets go of the GIL after each event
        (`time.sleep(0)`): otherwise a thread waiting for it (the engine's, when a step's
        tokens come back) could wait out the interpreter's whole 5 ms switch interval."""
        with self._lock:
            queue, write = self._queue, self._sink.write
            if not queue:
                return
            while queue:
                if yield_gil:
                    time.sleep(0)
                event, stage, t, fields = queue.popleft()
                try:
                    lines = list(self._lines(event, stage, t, fields))
                except Exception as exc:   # a bug here must not stop the log (or the engine)
                    lines = [dumps({"event": "log_error", "stage": stage, "t": t,
                                    "failed_event": event, "error": repr(exc)}) + b"\n"]
                for line in lines:
                    write(line)
            self._sink.flush()   # what has been logged is on disk within a step or so

    def _lines(self, event: str, stage: str, t: float, fields: dict):
        if event == "emitted":   # a step's bytes on one line, then a line per reply that ended
            items = fields["items"]
            yield dumps({"event": "emitted", "stage": stage, "t": t, "replies": [
                (rid, item.decode()) for rid, item in items if type(item) is bytes]}) + b"\n"
            for rid, item in items:
                if type(item) is not bytes:
                    yield dumps({"event": "reply_end", "stage": stage, "t": t,
                                 "request_id": rid, "status": item.status}) + b"\n"
            return
        if event in STAGE_FIELDS:
            fields["deltas"] = stage_deltas(event, fields["deltas"])
        if "headers" in fields:
            fields["headers"] = redact_headers(fields["headers"])
        if "body" in fields:
            fields["body"] = redact(fields["body"], self.secrets)
        yield dumps({"event": event, "stage": stage, "t": t, **fields}) + b"\n"

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join()
        self._drain()
        self._sink.close()


# -- reading -------------------------------------------------------------------------------
def event_files(path: str | Path) -> list[Path]:
    """A log and its rotated files (PATH.N ... PATH.1, PATH), oldest first."""
    path = Path(path)
    rotated = []
    for p in path.parent.glob(path.name + ".*"):
        suffix = p.name[len(path.name) + 1:]
        if suffix.isdigit():
            rotated.append((int(suffix), p))
    return [p for _, p in sorted(rotated, reverse=True)] + ([path] if path.exists() else [])


def read_events(path: str | Path, warn: Callable[[str], None] | None = None) -> Iterator[dict]:
    """Every event of a log and its rotated files, oldest first; a header repeated at the
    top of a rotated file is yielded once. A line that does not parse is skipped with a
    warning (`warn`, default: warnings.warn)."""
    warn = warn or (lambda message: warnings.warn(message, stacklevel=2))
    files = event_files(path)
    if not files:
        raise FileNotFoundError(f"no event log at {path}")
    seen_header = False
    for p in files:
        with open(p, "rb") as f:
            lines = f.read().split(b"\n")
        last = len(lines) - 1
        while last >= 0 and not lines[last].strip():
            last -= 1
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                ev = orjson.loads(line)
            except orjson.JSONDecodeError:
                where = ("its last line is truncated" if i == last
                         else f"line {i + 1} is not JSON")
                warn(f"{p}: {where}; skipped")
                continue
            if not isinstance(ev, dict):
                warn(f"{p}: line {i + 1} is not an event object; skipped")
                continue
            if ev.get("event") == "header":
                if seen_header:
                    continue
                seen_header = True
            yield ev
