"""Speculative decoding, spec on against off, in one process on the CPU (docs/benchmarks.md).

Workloads: `code` (a 40-80-line source file and "rename X to Y and return the whole
file", each prompt its own file and names so the prefix cache does not serve it), `copy`
(the same file on /v1/completions, followed by a heading for the edited file and its first
two lines, so that the model goes on to write the file out again: SmolLM2-135M does not
return the file in chat, it talks about it, so `code` copies little) and `chat` (short
questions, little to copy). Runs alternate off, on, off, on, ... so that
the load other processes put on the machine falls on both; each run prints output tok/s
(prefill included), the process's CPU time, the median request's TPOT (its decode phase alone: first to last
token) and, with spec, the tokens per verify pass.

    PYTHONPATH=. .venv/bin/python scripts/bench_spec.py --workload code --streams 1 --requests 2
"""
from __future__ import annotations

import argparse
import json
import time

import orjson
import torch
import trio

from pipeline.core.config import EngineConfig
from pipeline.core.engine import open_engine
from pipeline.layouts.process import runner_switch_interval

FILE = '''import json
import os


class {cls}:
    """Keeps {noun} records in a JSON file."""

    def __init__(self, path):
        self.path = path
        self.{field} = {{}}
        if os.path.exists(path):
            with open(path) as f:
                self.{field} = json.load(f)

    def add(self, key, value):
        if key in self.{field}:
            raise KeyError(key)
        self.{field}[key] = value
        self.save()

    def get(self, key, default=None):
        return self.{field}.get(key, default)

    def remove(self, key):
        value = self.{field}.pop(key)
        self.save()
        return value

    def save(self):
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.{field}, f, indent=2)
        os.replace(tmp, self.path)

    def __len__(self):
        return len(self.{field})

    def __contains__(self, key):
        return key in self.{field}


def load_{noun}s(path):
    store = {cls}(path)
    return [store.get(k) for k in sorted(store.{field})]


def count_{noun}s(path):
    return len({cls}(path))


def main():
    store = {cls}("{noun}s.json")
    store.add("first", 1)
    store.add("second", 2)
    print(count_{noun}s("{noun}s.json"))


if __name__ == "__main__":
    main()
'''
NOUNS = ["user", "order", "book", "ticket", "song", "city", "team", "device", "invoice",
         "recipe", "player", "course", "movie", "plant", "sensor", "report"]
QUESTIONS = ["What is the capital of France?", "Give me three tips for better sleep.",
             "Why is the sky blue?", "Write a haiku about autumn.",
             "What does a compiler do?", "How do plants make food?",
             "Name a few uses of copper.", "What is the tallest mountain on Earth?"]


def requests(workload: str, n: int, max_tokens: int) -> list[dict]:
    out = []
    for i in range(n):
        if workload in ("copy", "code"):    # a file per request, its nouns the request's own
            noun = NOUNS[i % len(NOUNS)] + ("" if i < len(NOUNS) else str(i))
            src = FILE.format(cls=noun.capitalize() + "Store", noun=noun, field="items")
        if workload == "copy":
            out.append({"prompt": f"# {noun}s.py\n```python\n{src}```\n\n# {noun}s.py, with "
                                  f"`items` renamed to `entries`\n```python\nimport json\n"
                                  f"import os\n", "max_tokens": max_tokens, "temperature": 0})
            continue
        if workload == "code":
            text = (f"Rename the attribute `items` to `entries` in this file and return the "
                    f"whole file.\n\n```python\n{src}```")
        else:
            text = QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" ({i})")
        out.append({"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                    "temperature": 0})
    return out


async def run(cfg: EngineConfig, reqs: list[dict], streams: int, loaded=None) -> dict:
    async with open_engine(cfg, loaded) as engine:
        limit = trio.CapacityLimiter(streams)
        tpots: list[float] = []

        async def one(body):
            # streamed, so that the decode phase is timed apart from the prompt's prefill:
            # TPOT = (last token's time - first token's) / (completion tokens - 1)
            async with limit:
                api = "completions" if "prompt" in body else "chat"
                reply = await engine.submit(api, {"model": engine.model_names[0], **body,
                                                     "stream": True,
                                                     "stream_options": {"include_usage": True}})
                first = last = None
                usage = None
                async for chunk in reply:
                    now = time.perf_counter()
                    for line in bytes(chunk).split(b"\n"):
                        if not line.startswith(b"data: {"):
                            continue
                        event = orjson.loads(line[6:])
                        if event.get("usage"):
                            usage = event["usage"]
                        if any(c.get("delta", {}).get("content") or c.get("text")
                               for c in event.get("choices", ())):
                            first = now if first is None else first
                            last = now
                assert usage is not None, "the stream ended without usage"
                if first is not None and usage["completion_tokens"] > 1:
                    tpots.append((last - first) / (usage["completion_tokens"] - 1))

        t0, c0 = time.perf_counter(), time.process_time()
        async with trio.open_nursery() as n:
            for body in reqs:
                n.start_soon(one, body)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        stats = engine.stats()
    gen = stats.generation_tokens_total      # the engine's own count of emitted tokens
    # cpu_s: this process's CPU time (all threads), less swayed than elapsed_s by what
    # other processes run on a shared machine
    res = {"output_tokens": gen, "elapsed_s": round(elapsed, 2), "cpu_s": round(cpu, 2),
           "output_tok_s": round(gen / elapsed, 2), "steps": stats.steps_total,
           "preemptions": stats.num_preemptions, "kv_blocks": stats.kv_blocks_total}
    if tpots:       # the decode phase alone, without the prompts' prefill
        res["tpot_ms"] = round(1000 * sorted(tpots)[len(tpots) // 2], 2)
    if stats.spec_decode is not None and stats.spec_decode.num_drafts:
        s = stats.spec_decode
        res.update(acceptance_length=round(1 + s.num_accepted_tokens / s.num_drafts, 2),
                   accepted=s.num_accepted_tokens, drafted=s.num_draft_tokens, passes=s.num_drafts)
    return res


_LOG_AT: dict = {}


def _log_steps(path: str) -> None:
    """Each step the gate measures, as a JSON line in `path` (what the gate saw and decided)."""
    from stages.schedule.spec import CostGate
    observe = CostGate.observe
    out = open(path, "a")

    def logged(self, num_seqs, drafted, tokens, seconds, rows=None):
        b = self.buckets.get(num_seqs.bit_length())
        out.write(json.dumps({**_LOG_AT, "n": num_seqs, "rows": rows, "drafted": drafted,
                              "tokens": tokens, "ms": round(1000 * seconds, 3),
                              "rates": b and [round(b[0], 1), round(b[1], 1)]}) + "\n")
        observe(self, num_seqs, drafted, tokens, seconds, rows)
    CostGate.observe = logged


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", choices=("code", "copy", "chat"), default="code")
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--requests", type=int, default=None, help="default: streams (at least 2)")
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--rounds", type=int, default=2, help="off/on pairs")
    p.add_argument("--spec", action="append", default=None,
                   help="a --speculative-config; repeat it for several (each round runs off, "
                        "then each in turn); 'draft-self' is draft_model with the bundled "
                        "SmolLM2 drafting for itself; a trailing '+async' adds "
                        "--async-scheduling (e.g. 'draft-self+async'). Default: n-gram 3 "
                        "tokens, lookup 2-4")
    p.add_argument("--log-steps", default=None, metavar="PATH",
                   help="append each decode step the cost gate measured to PATH, one JSON line "
                        "each: batch size, rows, drafted, tokens, ms, the bucket's A/B rates "
                        "(tok/s with drafts, without) before the step")
    a = p.parse_args()
    if a.log_steps:
        _log_steps(a.log_steps)
    from gpu.tokenizers.files import default_model_path
    specs = []      # (a --speculative-config, EngineConfig's other fields)
    for s in a.spec or ['{"method": "ngram", "num_speculative_tokens": 3, '
                        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}']:
        s, plus = (s[:-len("+async")], {"async_scheduling": True}) if s.endswith("+async") else (s, {})
        specs.append((s if s != "draft-self" else json.dumps(
            {"method": "draft_model", "model": str(default_model_path()),
             "num_speculative_tokens": 3}), plus))
    reqs = requests(a.workload, a.requests or max(2, a.streams), a.max_tokens)
    base = dict(max_model_len=2048, max_num_seqs=max(8, a.streams))
    # the model loaded once (loading the GGUF takes a minute under load) and shared
    from gpu.loader.decoder import choose_dtype, load_model
    dtype, _ = choose_dtype("auto", torch.device("cpu"))
    loaded = load_model(None, dtype=dtype, device="cpu", progress=False)
    with runner_switch_interval():       # the GPU step runs in this process, as in serve
        trio.run(run, EngineConfig(**base), requests(a.workload, 1, 8), 1, loaded)   # warm
        for r in range(a.rounds):
            for label, extra in (("off", {}), *((s, {"speculative_config": s, **plus})
                                                 for s, plus in specs)):
                _LOG_AT.update(streams=a.streams, round=r, spec=label if label == "off" else "on")
                res = trio.run(run, EngineConfig(**base, **extra), reqs, a.streams, loaded)
                label = label if label == "off" else json.loads(label)["method"] + (
                    "" if json.loads(label).get("adaptive", True) else " (every step)") + (
                    " +async" if extra.get("async_scheduling") else "")
                print(json.dumps({"workload": a.workload, "streams": a.streams, "round": r,
                                  "spec": label, **res}), flush=True)


if __name__ == "__main__":
    main()
