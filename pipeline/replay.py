"""Replay an event log: re-run detokenize, parse, account and emit from the logged
``scheduled`` messages and compare with the logged ``emitted`` bytes.

    tailrace replay events.jsonl [--model M] [--request-id ID]

Those four stages are deterministic functions of the sampled tokens, so a correct
pipeline reproduces every reply byte for byte; a mismatch pinpoints the first stage
whose output differs from what the client saw.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from pipeline.events import read_events, structure_step
from stages.account import Accountant
from stages.detokenize import Detokenizer
from stages.emit import Emitter, ReplyEnd
from stages.parse import Parser


def replay(path: str | Path, tokenizer, reasoning_parser: str | None = None
           ) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """Returns (reproduced, logged) reply bytes per request id."""
    detok, parser, accountant, emitter = Detokenizer(tokenizer), Parser(reasoning_parser), Accountant(), Emitter()
    reproduced: dict[str, bytes] = defaultdict(bytes)
    logged: dict[str, bytes] = defaultdict(bytes)
    for ev in read_events(path):
        if ev.get("event") == "scheduled":
            step = structure_step(ev["message"])
            out, _ = detok.process(step)
            acc, _ = accountant.process(parser.process(out))
            for rid, item in emitter.process(acc):
                if not isinstance(item, ReplyEnd):
                    reproduced[rid] += item
        elif ev.get("event") == "emitted":
            logged[ev["request_id"]] += ev["data"].encode()
    return dict(reproduced), dict(logged)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("event_log", help="the JSON-lines file written by `tailrace serve --event-log`")
    p.add_argument("--model", default=None, help="the model the server ran (for its tokenizer)")
    p.add_argument("--reasoning-parser", default=None, help="as given to the server")
    p.add_argument("--request-id", default=None, help="print this request's reproduced reply")


def main(args: argparse.Namespace) -> int:
    from gpu.loader import load_tokenizer

    tok = load_tokenizer(args.model)
    reproduced, logged = replay(args.event_log, tok, args.reasoning_parser)
    bad = sorted(rid for rid in logged if reproduced.get(rid) != logged[rid])
    print(f"replayed {len(reproduced)} requests: {len(reproduced) - len(bad)} identical, {len(bad)} differ")
    for rid in bad:
        a, b = reproduced.get(rid, b""), logged[rid]
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        print(f"  {rid}: first difference at byte {at}: logged {b[at:at + 60]!r} replayed {a[at:at + 60]!r}")
    if args.request_id:
        sys.stdout.write(reproduced.get(args.request_id, b"").decode(errors="replace"))
    return 1 if bad else 0
