"""Single-process serving against --api-server-count N on the H200 stand-in: CPU per
streamed token of the server (summed over all its processes, from /proc, during the
run only) and of the client, the engine process's CPU per step against offline, and
output tok/s over HTTP as a fraction of offline. CPU figures are the robust ones on a
loaded machine; wall-clock ones move with the other load.

    .venv/bin/python scripts/bench_procs.py [--modes offline,single,1,2] [--num-prompts 256]

Each mode runs (SMOL: the bundled SmolLM2's path, for the tokenizer):
    offline: tailrace bench throughput gpu/configs/qwen3-0.6b --tokenizer $SMOL
             --simulate-gpu h200 --workload nano-vllm --num-prompts P
    single / N: tailrace serve gpu/configs/qwen3-0.6b --tokenizer $SMOL --simulate-gpu h200
             --port 0 --max-model-len 2064 [--api-server-count N], then
             tailrace bench serve --backend openai-completions --num-prompts P
             --max-concurrency 256 --random-input-len 562 --random-output-len 562
             --random-range-ratio 0.822 --ignore-eos --tokenizer $SMOL
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

TICK = os.sysconf("SC_CLK_TCK")
MODEL = "gpu/configs/qwen3-0.6b"


def smol() -> str:
    from gpu.loader.decoder import default_model_path
    return str(default_model_path())


def tailrace() -> list[str]:
    exe = Path(sys.executable).with_name("tailrace")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "web.cli"]


def cpu_s(pid: int) -> float:
    """utime + stime of one process (its own threads), seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def tree(root: int) -> dict[int, str]:
    """root and its children: pid -> role (server, engine, frontend)."""
    out = {root: "server"}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                cmd = Path(f"/proc/{entry}/cmdline").read_text()
            except OSError:
                continue
            if int(stat[1]) == root:
                out[int(entry)] = "engine" if "\0engine" in cmd else "frontend"
    return out


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def run_timed(cmd: list[str]) -> tuple[str, float, float]:
    """stdout, CPU seconds of the command (with its children), wall seconds."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{cmd[:4]} exited {proc.returncode}: {out[-2000:]}")
    return out, usage.ru_utime + usage.ru_stime, time.monotonic() - t0


def _throughput(*flags: str) -> tuple[dict, float]:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        _, cpu, _ = run_timed([*tailrace(), "bench", "throughput", MODEL, "--tokenizer", smol(),
                               "--simulate-gpu", "h200", *flags, "--output-json", f.name])
        return json.loads(Path(f.name).read_text()), cpu


def offline(args) -> dict:
    """CPU of the timed window only (bench throughput's cpu_s), not start-up."""
    r, _ = _throughput("--workload", "nano-vllm", "--num-prompts", str(args.num_prompts))
    cpu = r["cpu_s"]
    return {"mode": "offline", "tok_s": r["output_tokens_per_s"], "tokens": r["output_tokens"],
            "steps": r["gpu_steps"], "fraction_of_ceiling": r.get("fraction_of_ceiling"), "engine_cpu_ms_per_step": cpu * 1e3 / r["gpu_steps"],
            "host_ms_per_step": r["host_ms_per_step"], "cpu_us_per_token": cpu * 1e6 / r["output_tokens"]}


def served(args, count: int | None) -> dict:
    flags = [] if count is None else ["--api-server-count", str(count)]
    with tempfile.TemporaryDirectory() as tmp:
        out_path = Path(tmp) / "out.txt"
        with open(out_path, "wb") as out:
            server = subprocess.Popen([*tailrace(), "serve", MODEL, "--tokenizer", smol(),
                                       "--simulate-gpu", "h200", "--port", "0",
                                       "--max-model-len", "2064", "--log-level", "warning",
                                       *flags], stdout=out, stderr=subprocess.DEVNULL)
        try:
            while not (m := re.search(r"listening on (\S+)", out_path.read_text())):
                if server.poll() is not None:
                    raise RuntimeError("the server exited")
                time.sleep(0.5)
            url = m.group(1)
            while httpx.get(f"{url}/health").status_code != 200:
                time.sleep(0.5)
            procs = tree(server.pid)
            before = {pid: cpu_s(pid) for pid in procs}
            steps0 = metric(url, "tailrace:engine_steps_total")
            tokens0 = metric(url, "vllm:generation_tokens_total")
            text, client_cpu, wall = run_timed([
                *tailrace(), "bench", "serve", "--backend", "openai-completions",
                "--base-url", url, "--num-prompts", str(args.num_prompts),
                "--max-concurrency", "256", "--random-input-len", "562",
                "--random-output-len", "562", "--random-range-ratio", "0.822", "--ignore-eos",
                "--tokenizer", smol()])
            after = {pid: cpu_s(pid) for pid in procs}
            steps = metric(url, "tailrace:engine_steps_total") - steps0
            tokens = metric(url, "vllm:generation_tokens_total") - tokens0
        finally:
            server.terminate()
            server.wait(timeout=60)
    used = {pid: after[pid] - before[pid] for pid in procs}
    engine = [p for p, role in procs.items() if role == "engine"] or [server.pid]
    tput = re.search(r"Output token throughput \(tok/s\):\s+([\d.]+)", text)
    return {"mode": "single" if count is None else f"asc {count}",
            "tok_s": float(tput.group(1)) if tput else tokens / wall, "tokens": tokens,
            "steps": steps, "server_cpu_us_per_token": sum(used.values()) * 1e6 / tokens,
            "client_cpu_us_per_token": client_cpu * 1e6 / tokens,
            "engine_cpu_ms_per_step": sum(used[p] for p in engine) * 1e3 / steps,
            "frontend_cpu_us_per_token": sum(v for p, v in used.items()
                                             if procs[p] == "frontend") * 1e6 / tokens,
            "by_process": {f"{procs[p]} {p}": round(v, 2) for p, v in used.items()}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--modes", default="offline,single,1,2")
    p.add_argument("--num-prompts", type=int, default=256)
    args = p.parse_args()
    for mode in args.modes.split(","):
        if mode == "offline":
            row = offline(args)
        else:
            row = served(args, None if mode == "single" else int(mode))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
