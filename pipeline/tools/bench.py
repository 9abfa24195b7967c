"""`tailrace bench throughput`: N prompts through the whole engine, no HTTP.

Requests enter at render (as token-id completions prompts) and leave at emit, so the
figure includes every stage, not just the model. Reports output tokens/s.

A request that fails (an error reply, a refused submission, an engine that stops) is
counted, not fatal to the bookkeeping: the result (and --output-json) carries
``failed_requests`` and ``first_error``, and the command exits 1.
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time

import attrs
import trio
from tqdm import tqdm

from gpu.worker.runner import ModelRunner
from gpu.worker.simulate import SimulatedRunner
from pipeline.core.config import EngineConfig, add_engine_arguments, engine_config
from pipeline.core.engine import open_engine
from pipeline.core.reply import describe
from pipeline.layouts.process import runner_switch_interval

log = logging.getLogger("tailrace.bench")

WORKLOADS = {
    # nano-vllm's published benchmark (its bench.py): 256 sequences, lengths uniform in
    # [100, 1024], token ids uniform in [0, 10000], drawn from random.seed(0) in its order
    # (every prompt, then every output length), so 133,966 output tokens in all.
    "nano-vllm": dict(num_prompts=256, min_input_len=100, input_len=1024, min_output_len=100,
                      output_len=1024, seed=0, ignore_eos=True, order="nano-vllm"),
}
NANO_VLLM_OUTPUT_TOKENS = 133_966   # nano-vllm's README: "Total: 133966tok"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.add_argument("--workload", choices=sorted(WORKLOADS),
                   help="a preset (nano-vllm: 256 prompts, lengths uniform in [100, 1024]); "
                        "explicit flags still win")
    p.add_argument("--num-prompts", type=int, default=None, help="requests to run (default 32)")
    p.add_argument("--input-len", type=int, default=None,
                   help="prompt tokens, or the top of a range with --min-input-len (default 128)")
    p.add_argument("--output-len", type=int, default=None,
                   help="output tokens, or the top of a range with --min-output-len (default 128)")
    p.add_argument("--min-input-len", type=int, default=None, help="lower end of a uniform prompt length range")
    p.add_argument("--min-output-len", type=int, default=None, help="lower end of a uniform output length range")
    p.add_argument("--temperature", type=float, default=0.6, help="sampling temperature (nano-vllm uses 0.6)")
    p.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS")
    p.add_argument("--json-schema", default=None, metavar="SCHEMA",
                   help="constrain every request's output to this JSON schema (JSON text; "
                        "'small' for a built-in small object schema); measures "
                        "structured-output overhead")
    p.add_argument("--output-json", default=None, help="write the result as JSON to this path")


def _settings(args: argparse.Namespace) -> dict:
    s = dict(num_prompts=32, min_input_len=None, input_len=128, min_output_len=None, output_len=128,
             seed=args.seed, ignore_eos=True)
    if args.workload:
        s.update(WORKLOADS[args.workload])
    for k in ("num_prompts", "input_len", "output_len", "min_input_len", "min_output_len"):
        if getattr(args, k) is not None:
            s[k] = getattr(args, k)
    if args.no_ignore_eos:
        s["ignore_eos"] = False
    if args.json_schema:
        s["json_schema"] = SMALL_SCHEMA if args.json_schema == "small" else json.loads(args.json_schema)
    return s


# A small schema whose output can run to any length (an array of short strings), so a
# constrained run generates about as many tokens as a free one.
SMALL_SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "items": {
    "type": "string", "maxLength": 40}}}, "required": ["notes"]}


def _draw(s: dict, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """(prompts, output lengths) from random.Random(seed)."""
    rng = random.Random(s["seed"])
    n = s["num_prompts"]

    def length(lo, hi):
        return rng.randint(lo, hi) if lo else hi

    if s.get("order") == "nano-vllm":
        # nano-vllm's bench.py, draw for draw: each prompt's length then its tokens
        # (randint(0, 10000), both ends included), then every output length
        prompts = [[rng.randint(0, 10000) % vocab_size
                    for _ in range(length(s["min_input_len"], s["input_len"]))] for _ in range(n)]
        outputs = [length(s["min_output_len"], s["output_len"]) for _ in range(n)]
        return prompts, outputs
    hi = min(vocab_size, 10000)
    prompts, outputs = [], []
    for _ in range(n):
        n_in = length(s["min_input_len"], s["input_len"])
        outputs.append(length(s["min_output_len"], s["output_len"]))
        prompts.append([rng.randrange(hi) for _ in range(n_in)])
    return prompts, outputs


def make_requests(s: dict, vocab_size: int, temperature: float) -> list[dict]:
    reqs = []
    for prompt, n_out in zip(*_draw(s, vocab_size)):
        reqs.append({"prompt": prompt, "max_tokens": n_out,
                     "ignore_eos": s["ignore_eos"], "temperature": temperature})
        if s.get("json_schema") is not None:
            reqs[-1]["structured_outputs"] = {"json": s["json_schema"]}
    return reqs


def _error_of(status: int, raw: bytes) -> str | None:
    """The error a non-streamed reply carries, or None for a completed one."""
    try:
        data = json.loads(raw)
    except ValueError:
        return f"HTTP {status}: {raw[:200]!r}"
    if status == 200 and isinstance(data, dict) and isinstance(data.get("usage"), dict):
        return None
    error = data.get("error") if isinstance(data, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return f"HTTP {status}: {message or str(data)[:200]}"


async def _bench(cfg: EngineConfig, s: dict, temperature: float, so_far: dict | None = None) -> dict:
    """Runs the benchmark; `so_far` (if given) is kept up to date as requests finish, so
    an interrupted run can still report how far it got."""
    failures: list[str] = []
    so_far = {} if so_far is None else so_far
    so_far.update(done=0, output_tokens=0, failures=failures, t0=None)
    async with open_engine(cfg) as engine:
        reqs = make_requests(s, engine.loaded.config.vocab_size, temperature)
        for r in reqs:
            r["model"] = engine.model_names[0]
        out_tokens = in_tokens = 0
        progress = tqdm(total=len(reqs), desc="requests", unit="req", disable=not sys.stderr.isatty())

        async def one(body: dict) -> None:
            nonlocal out_tokens, in_tokens
            try:
                reply = await engine.submit("completions", body)
                raw = await reply.read()
                error = _error_of(reply.status, raw)
            except Exception as exc:  # refused at admission, or the engine stopped
                error = describe(exc)
            if error is None:
                usage = json.loads(raw)["usage"]
                out_tokens += usage["completion_tokens"]
                in_tokens += usage["prompt_tokens"]
            else:
                failures.append(error)
            progress.update()
            so_far.update(done=so_far["done"] + 1, output_tokens=out_tokens)
            if not progress.disable:
                return
            if so_far["done"] % max(1, len(reqs) // 8) == 0 or so_far["done"] == len(reqs):
                # no tty (a log file): a line now and then instead of the bar
                elapsed = time.perf_counter() - so_far["t0"]
                log.info("%d/%d requests done, %d output tokens in %.1f s (%.0f tok/s), %d failed",
                         so_far["done"], len(reqs), out_tokens, elapsed, out_tokens / max(elapsed, 1e-9),
                         len(failures))

        compiles0 = _compiles(engine.runner)
        t0 = so_far["t0"] = time.perf_counter()
        cpu0 = time.process_time()       # every thread of the process: the host's whole work
        async with trio.open_nursery() as reqs_nursery:
            for body in reqs:
                reqs_nursery.start_soon(one, body)
        elapsed = time.perf_counter() - t0
        cpu_s = time.process_time() - cpu0
        compiles1 = _compiles(engine.runner)
        progress.close()
        stats = engine.stats()
    result = {
        "model": engine.model_names[0], "device": str(engine.device),
        "dtype": str(engine.loaded.model.dtype).removeprefix("torch."), "num_prompts": len(reqs),
        "input_tokens": in_tokens, "output_tokens": out_tokens, "elapsed_s": round(elapsed, 3),
        "cpu_s": round(cpu_s, 3),
        "output_tokens_per_s": round(out_tokens / elapsed, 2),
        "total_tokens_per_s": round((in_tokens + out_tokens) / elapsed, 2),
        "preemptions": stats.num_preemptions, "steps": stats.steps_total,
        "constrained": s.get("json_schema") is not None,
        "failed_requests": len(failures), "first_error": failures[0] if failures else None,
    }
    result.update(_runner_facts(engine.runner))
    spec = stats.spec_decode
    if spec is not None and spec.num_drafts:   # --speculative-config
        result.update(spec_num_drafts=spec.num_drafts, spec_num_draft_tokens=spec.num_draft_tokens,
                      spec_num_accepted_tokens=spec.num_accepted_tokens,
                      spec_acceptance_length=round(1 + spec.num_accepted_tokens / spec.num_drafts, 3))
    if compiles0 is not None and compiles1 is not None:
        # Triton compiles inside the timed window: must be 0 (each costs 1-2 s on a GPU)
        result["triton_compiles_in_timed_window"] = compiles1 - compiles0
    waited = engine.runner.waited_s if isinstance(engine.runner, SimulatedRunner) else 0.0
    if waited:  # a simulated GPU: its waits are the ceiling, the rest is host time
        steps = engine.runner.steps
        result.update(simulate_gpu=cfg.simulate_gpu, gpu_wait_s=round(waited, 3),
                      ceiling_output_tokens_per_s=round(out_tokens / waited, 2),
                      fraction_of_ceiling=round(waited / elapsed, 3), gpu_steps=steps,
                      gpu_wait_ms_per_step=round(waited / steps * 1e3, 3),
                      host_ms_per_step=round((elapsed - waited) / steps * 1e3, 3),
                      # of which: back late from the waits (the OS and the GIL), and the
                      # runner waiting for its next plan (the event loop's share)
                      late_ms_per_step=round(engine.runner.late_s / steps * 1e3, 3),
                      starved_ms_per_step=round(engine.runner.starved_s / steps * 1e3, 3))
    return result


def _compiles(runner) -> int | None:
    """Triton kernels compiled so far (gpu/kernels/triton/compile_count.py); None without Triton."""
    if not (isinstance(runner, ModelRunner) and runner.use_triton):
        return None
    from gpu.kernels.triton.compile_count import compiled_kernels
    return compiled_kernels()


def _runner_facts(runner) -> dict:
    """What the runner did before t0 (graphs, warm-up) and the kernel stack."""
    facts = {}
    if isinstance(runner, ModelRunner):
        facts.update(cuda_graphs=runner.cuda_graphs, cuda_graph_sizes=runner.cuda_graph_sizes,
                     cuda_graph_capture_s=runner.cuda_graph_capture_s,
                     cuda_graph_error=runner.cuda_graph_error, warmup_s=runner.warmup_s,
                     use_triton=runner.use_triton)
    if isinstance(runner, ModelRunner) and runner.use_triton:
        import triton
        facts["triton"] = triton.__version__
    import torch
    facts["torch"] = torch.__version__
    return facts


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    s = _settings(args)
    if engine_config(args).pooling:
        print("bench throughput measures generation; for a pooling model (embeddings) use "
              "scripts/bench_pooling.py, or `tailrace bench serve --backend openai-embeddings` "
              "against `tailrace serve`", file=sys.stderr)
        return 2
    cfg = attrs.evolve(engine_config(args),
                       max_model_len=args.max_model_len or (s["input_len"] + s["output_len"] + 16),
                       max_queued_requests=max(args.max_queued_requests, s["num_prompts"]))
    so_far: dict = {}
    try:
        with runner_switch_interval():     # the GPU step runs in this process, as in serve
            result = trio.run(_bench, cfg, s, args.temperature, so_far)
    except KeyboardInterrupt:  # Ctrl-C, or `timeout -s INT`: say how far it got
        t0 = so_far.get("t0")
        elapsed = time.perf_counter() - t0 if t0 else None
        failures = so_far.get("failures") or []
        result = {"num_prompts": s["num_prompts"], "interrupted": True,
                  "error": "interrupted before the end (a time limit?)",
                  "completed_requests": so_far.get("done", 0),
                  "output_tokens": so_far.get("output_tokens", 0),
                  "elapsed_s": round(elapsed, 3) if elapsed else None,
                  "stage": "running requests" if t0 else "starting the engine",
                  "failed_requests": len(failures), "first_error": failures[0] if failures else None}
        _write(args.output_json, result)
        print(f"bench throughput interrupted: {json.dumps(result)}", file=sys.stderr)
        return 1
    except Exception as exc:  # the engine failed to start or stopped: report it, exit 1
        log.exception("bench throughput failed")
        result = {"num_prompts": s["num_prompts"], "failed_requests": s["num_prompts"],
                  "first_error": describe(exc), "error": describe(exc)}
        _write(args.output_json, result)
        print(f"bench throughput failed: {result['error']}", file=sys.stderr)
        return 1
    if result["failed_requests"]:
        print(f"{result['failed_requests']} of {result['num_prompts']} requests failed; the first: "
              f"{result['first_error']}", file=sys.stderr)
    print(f"Throughput ({result['dtype']}): {result['output_tokens_per_s']:.2f} output tokens/s "
          f"({result['output_tokens']} tokens from {result['num_prompts']} requests in "
          f"{result['elapsed_s']:.2f} s; total {result['total_tokens_per_s']:.2f} tokens/s)")
    if "spec_acceptance_length" in result:
        print(f"Speculative decoding: {result['spec_acceptance_length']:.2f} tokens per verify pass "
              f"({result['spec_num_accepted_tokens']} of {result['spec_num_draft_tokens']} drafts "
              f"accepted in {result['spec_num_drafts']} passes)")
    if "gpu_wait_s" in result:
        print(f"Simulated {result['simulate_gpu']}: ceiling {result['ceiling_output_tokens_per_s']:.2f} "
              f"output tokens/s (the waits alone, {result['gpu_wait_s']:.2f} s); reached "
              f"{result['fraction_of_ceiling']:.1%}; {result['gpu_steps']} steps, "
              f"{result['gpu_wait_ms_per_step']:.3f} ms of wait and {result['host_ms_per_step']:.3f} ms "
              f"of host time per step on the critical path ({result['late_ms_per_step']:.3f} ms back "
              f"late from the wait, {result['starved_ms_per_step']:.3f} ms waiting for the plan)")
    _write(args.output_json, result)
    return 1 if result["failed_requests"] else 0


def _write(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="tailrace bench throughput", description=__doc__)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
