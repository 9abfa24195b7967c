"""Replay an event log: re-run detokenize, parse, account and emit from the logged
``scheduled`` messages and compare with the logged ``emitted`` bytes.

    tailrace replay events.jsonl [--request-id ID] [--timeline] [--html FILE]

The log's header (docs/events.md) names the tokenizer and the parsers the server ran,
so no flag is needed; a flag given anyway overrides the header, and the difference is
reported. Those four stages are deterministic functions of the sampled tokens (timings
come from the logged messages), so a correct pipeline reproduces every reply byte for
byte. On a mismatch replay prints the request, the first SSE event that differs
(expected: what the client got; got: the replay) and the first stage whose output
differs from what that stage logged. Exit 0 when every reply matches, 1 otherwise.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import attrs
import orjson

from pipeline.core.events import STAGE_FIELDS, plain, stage_deltas, structure_step
from pipeline.core.logfile import Log
from stages.account import Accountant
from stages.detokenize import Detokenizer
from stages.emit import Emitter, ReplyEnd
from stages.parse import REASONING_PARSERS, Parser

# The replayed stages in pipeline order, by the event each logs.
STAGES = (("detokenized", "detokenize"), ("parsed", "parse"), ("accounted", "account"))


@attrs.define
class Difference:
    request_id: str
    stage: str | None = None          # the first stage whose output differs (emit: only the bytes)
    stage_detail: str = ""
    event_index: int = 0              # the first differing SSE event (0-based)
    expected: bytes = b""             # ... as the client got it
    got: bytes = b""                  # ... as replayed


@attrs.define
class Result:
    reproduced: dict[str, bytes]
    logged: dict[str, bytes]
    checked: list[str]                 # request ids compared
    differences: list[Difference]
    unfinished: list[str]              # no reply_end in the log: compared as far as it goes
    not_checked: list[str]             # began before the oldest file of a rotated set
    apis: dict[str, str]


def sse_events(data: bytes) -> list[bytes]:
    """A reply split into its SSE events (a non-streaming body is one)."""
    if not data.startswith((b"data:", b"event:")):
        return [data] if data else []
    parts = data.split(b"\n\n")
    out = [p + b"\n\n" for p in parts[:-1]]
    if parts[-1]:
        out.append(parts[-1])
    return out


def _first_event_difference(expected: bytes, got: bytes) -> tuple[int, bytes, bytes]:
    a, b = sse_events(expected), sse_events(got)
    for i in range(max(len(a), len(b))):
        x = a[i] if i < len(a) else b""
        y = b[i] if i < len(b) else b""
        if x != y:
            return i, x, y
    return 0, b"", b""


def replay_log(log: Log, tokenizer, reasoning_parser: str | None = None) -> Result:
    """Re-run the four stages over the log's `scheduled` messages."""
    detok, parser, accountant, emitter = (Detokenizer(tokenizer), Parser(reasoning_parser, tokenizer),
                                          Accountant(cache_block=log.header.get("cache_block", 0)),
                                          Emitter())
    reproduced: dict[str, bytes] = defaultdict(bytes)
    logged: dict[str, bytes] = defaultdict(bytes)
    ended: set[str] = set()
    known: set[str] = set()
    apis: dict[str, str] = {}
    pooled: set[str] = set()      # pooling requests: the server skips detokenize and parse
    # per stage event, per request: the rows logged, and the rows the replay produced
    logged_rows: dict[str, dict[str, list]] = {e: defaultdict(list) for e, _ in STAGES}
    replay_rows: dict[str, dict[str, list]] = {e: defaultdict(list) for e, _ in STAGES}

    def keep(rows: dict[str, list], step, deltas_rows: list[dict]) -> None:
        for row in deltas_rows:
            rows[row["request_id"]].append((step, row))

    for ev in log.events:
        kind = ev.get("event")
        if kind == "scheduled":
            step = structure_step(ev["message"])
            for req in step.new_requests:
                known.add(req.request_id)
                apis[req.request_id] = f"{req.api}, {'streaming' if req.stream else 'not streaming'}"
                if req.pooling is not None:
                    pooled.add(req.request_id)
            out = step
            if not (all(r.request_id in pooled for r in step.new_requests)
                    and all(d.request_id in pooled for d in step.deltas)):
                out, _ = detok.process(step)
                keep(replay_rows["detokenized"], out.step, plain(stage_deltas("detokenized", out.deltas)))
                out = parser.process(out)
                keep(replay_rows["parsed"], out.step, plain(stage_deltas("parsed", out.deltas)))
            out, _ = accountant.process(out)
            keep(replay_rows["accounted"], out.step, plain(stage_deltas("accounted", out.deltas)))
            for rid, item in emitter.process(out):
                if not isinstance(item, ReplyEnd):
                    reproduced[rid] += item
        elif kind in STAGE_FIELDS:
            keep(logged_rows[kind], ev.get("step"), ev.get("deltas") or [])
        elif kind == "emitted":
            for rid, data in ev.get("replies", ()):
                logged[rid] += data.encode()
        elif kind == "reply_end":
            ended.add(ev["request_id"])

    checked, differences, unfinished, not_checked = [], [], [], []
    for rid in logged:
        if rid not in known:
            not_checked.append(rid)
            continue
        got, expected = reproduced.get(rid, b""), logged[rid]
        if rid not in ended:
            unfinished.append(rid)
            got = got[:len(expected)]   # the log stops early: compare what it has
        checked.append(rid)
        if got == expected:
            continue
        diff = Difference(rid, *_first_stage_difference(rid, logged_rows, replay_rows))
        diff.event_index, diff.expected, diff.got = _first_event_difference(expected, got)
        differences.append(diff)
    return Result(dict(reproduced), dict(logged), checked, differences, unfinished,
                  not_checked, apis)


def _first_stage_difference(rid: str, logged_rows, replay_rows) -> tuple[str, str]:
    for event, stage in STAGES:
        if not any(logged_rows[event].values()):
            continue   # the log has no record of this stage (an older log)
        a, b = logged_rows[event].get(rid, []), replay_rows[event].get(rid, [])
        for i in range(max(len(a), len(b))):
            x = a[i] if i < len(a) else None
            y = b[i] if i < len(b) else None
            if x != y:
                step = (x or y)[0]
                def show(r):
                    return "nothing" if r is None else orjson.dumps(
                        {k: v for k, v in r[1].items() if k != "request_id"}).decode()
                return stage, f"step {step}: logged {show(x)}, replayed {show(y)}"
    return "emit", "every stage's output matches the log: the framing differs"


def replay(path: str | Path, tokenizer, reasoning_parser: str | None = None
           ) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """Returns (reproduced, logged) reply bytes per request id."""
    result = replay_log(Log.read(path), tokenizer, reasoning_parser)
    return result.reproduced, result.logged


# -- the command ---------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("event_log", help="the JSON-lines file written by `tailrace serve --event-log` "
                                     "(its rotated files PATH.1 ... are read too, oldest first)")
    p.add_argument("--model", default=None,
                   help="override the log's model (its tokenizer is what replay uses)")
    p.add_argument("--tokenizer", default=None, help="override the log's tokenizer")
    p.add_argument("--reasoning-parser", default=None, choices=(*REASONING_PARSERS, "none"),
                   help="override the log's reasoning parser (none: off)")
    p.add_argument("--request-id", default=None, help="print this request's reproduced reply")
    p.add_argument("--timeline", action="store_true",
                   help="print one line per request: its times, durations, tokens and finish")
    p.add_argument("--html", default=None, metavar="FILE",
                   help="write a self-contained waterfall page of the run to FILE")


def _show(data: bytes, limit: int = 400) -> str:
    text = data.decode(errors="replace").rstrip("\n")
    return text if len(text) <= limit else text[:limit] + f"... ({len(data)} bytes)"


def _setup(args: argparse.Namespace, log: Log) -> tuple[object, str | None, list[str]]:
    """The tokenizer and reasoning parser: the header's, or the flags' (noted)."""
    from gpu.tokenizers.files import load_tokenizer
    from pipeline.core.events import tokenizer_hash
    from stages.api.tool_parsers import load_plugin

    notes: list[str] = []
    header = log.header
    flags = header.get("flags", {})
    if flags.get("tool_parser_plugin"):
        try:
            load_plugin(flags["tool_parser_plugin"])
        except Exception as exc:   # replay can still check the other requests
            notes.append(f"cannot load the log's --tool-parser-plugin: {exc}")
    # the parsers the server resolved (gpt-oss implies Harmony's); an older log: its flags
    reasoning = (header.get("parsers") or flags).get("reasoning_parser")
    if args.reasoning_parser is not None:
        given = None if args.reasoning_parser == "none" else args.reasoning_parser
        if header and given != reasoning:
            notes.append(f"--reasoning-parser {args.reasoning_parser} overrides the log's "
                         f"{reasoning or 'none'}")
        reasoning = given
    source = args.tokenizer or args.model
    if source is None and flags.get("skip_tokenizer_init"):
        return None, reasoning, notes
    if source is None:
        source = header.get("tokenizer_path") or header.get("model")
    tok = load_tokenizer(source)
    logged_hash = header.get("tokenizer_hash")
    if logged_hash and tokenizer_hash(tok) != logged_hash:
        notes.append(f"the tokenizer of {source} ({tokenizer_hash(tok)[:19]}...) is not the one "
                     f"the server ran ({logged_hash[:19]}...)")
    elif header and (args.tokenizer or args.model):
        notes.append(f"tokenizer from {source} (the log's is {header.get('tokenizer_path')}; "
                     "same hash)")
    return tok, reasoning, notes


def main(args: argparse.Namespace) -> int:
    from pipeline.core.logfile import frontend_logs, joined

    try:
        log = Log.read(args.event_log)
        parts = frontend_logs(args.event_log)   # a run of --api-server-count
    except FileNotFoundError as exc:
        print(f"tailrace replay: {exc}", file=sys.stderr)
        return 2
    for w in log.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if args.timeline or args.html:
        from pipeline.tools import timeline

        tl = timeline.build(joined(args.event_log) if parts else log)
        if args.timeline:
            sys.stdout.write(timeline.text(tl))
        if args.html:
            Path(args.html).write_text(timeline.html(tl))
            print(f"wrote {args.html} ({len(tl.requests)} requests, {len(tl.steps)} steps)")
        if not args.request_id:
            return 0
    try:
        tok, reasoning, notes = _setup(args, log)
    except (OSError, ValueError) as exc:
        print(f"tailrace replay: cannot load the tokenizer: {exc}; pass --model or --tokenizer",
              file=sys.stderr)
        return 2
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    if parts:
        # each frontend's file holds its requests whole (the Steps it got, and its bytes)
        print(f"{len(parts)} frontend files beside the engine's: each replayed on its own")
        result = _merged([replay_log(Log.read(p), tok, reasoning) for p in parts])
    else:
        result = replay_log(log, tok, reasoning)
    bad = len(result.differences)
    print(f"replayed {len(result.checked)} requests: {len(result.checked) - bad} identical, "
          f"{bad} differ")
    if result.unfinished:
        print(f"  {len(result.unfinished)} had not finished when the log ends (compared as far "
              f"as it goes): {', '.join(result.unfinished[:5])}")
    if result.not_checked:
        print(f"  {len(result.not_checked)} began before the oldest file of the log (not "
              f"checked): {', '.join(result.not_checked[:5])}")
    for d in result.differences:
        print(f"request {d.request_id} ({result.apis.get(d.request_id, '?')}): the reply differs")
        print(f"  first differing stage: {d.stage}: {d.stage_detail}")
        print(f"  first differing SSE event: #{d.event_index}")
        print(f"    expected: {_show(d.expected)}")
        print(f"    got:      {_show(d.got)}")
    if args.request_id:
        if args.request_id not in result.reproduced and args.request_id not in result.logged:
            print(f"tailrace replay: no request {args.request_id!r} in the log", file=sys.stderr)
            return 1
        sys.stdout.write(result.reproduced.get(args.request_id, b"").decode(errors="replace"))
    return 1 if bad else 0


def _merged(results: list[Result]) -> Result:
    """The frontends' results as one (their request ids are each frontend's own: a
    difference is reported under the id that frontend gave it)."""
    out = results[0]
    for r in results[1:]:
        out = attrs.evolve(
            out, checked=out.checked + r.checked, differences=out.differences + r.differences,
            unfinished=out.unfinished + r.unfinished, not_checked=out.not_checked + r.not_checked,
            reproduced={**out.reproduced, **r.reproduced}, logged={**out.logged, **r.logged},
            apis={**out.apis, **r.apis})
    return out
