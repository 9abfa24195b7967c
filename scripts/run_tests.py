"""`make test`: the suite in chunks (a folder of tests/ each), two pytest processes at a time.

Most e2e tests wait on a server (the suite ran at ~1.2 cores of 2 in one process), so a
second pytest process fills the idle core. Chunks are handed out longest first to whichever
worker is free (greedy list scheduling: no measured split to keep up to date, and a chunk
that grows only delays its own worker). The tests/e2e files that share its session servers
(tests/e2e/conftest.py) are one chunk, so those servers start once, as in one process.

    python scripts/run_tests.py                       # the whole suite, 2 workers (the default)
    TAILRACE_TEST_JOBS=1 python scripts/run_tests.py  # the whole suite in one pytest process
    python scripts/run_tests.py ARGS...               # one pytest process with ARGS

Two processes side by side were slower than one until the suite's OpenMP teams stopped
spinning at barriers (tests/conftest.py sets OMP_WAIT_POLICY=PASSIVE, which every process
and server the tests start inherits): oversubscribed spinning teams waited out whole time
slices (docs/benchmarks.md, "The test suite's time").

Each chunk writes to its own log and temporary directory; a chunk's log is printed whole
when it ends, and the exit status is the first non-zero one.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the chunks, longest first (by the chunks' wall in the CI run of 2026-12-07 on the 2-core AVX2
# machine, docs/benchmarks.md): a folder of tests/, or a part of one (PARTS); a folder not named
# here (nor in RIDES) runs in the pipeline chunk, with the top-level files
CHUNKS = ["e2e-shared", "e2e-2", "e2e", "engine-spec", "procs", "gpu", "gpu-n", "reliability",
          "engine", "kernels", "tp", "cluster", "pipeline"]
# folders that run in another one's chunk: each pytest process costs ~5.5 s of CPU before its
# first test (Python, pytest's plugins, torch, the conftests), 7-11 s of wall beside the other
# worker, so a folder of a few seconds of tests rides with another (docs/benchmarks.md, "Fewer
# pytest starts and a leaner install")
RIDES = {"stages": "gpu-n", "web": "pipeline"}
# parts of a folder: (chunk, its files); the folder's own chunk runs the files no part names.
# tests/e2e's first part is the files that use tests/e2e/conftest.py's session servers, so that
# those servers start once. A file in the wrong list still passes: it starts its own copy of a
# session server, which costs time only.
PARTS = {
    "e2e": [("e2e-shared", ["test_e2e_beam.py", "test_e2e_data_parallel.py", "test_e2e_gguf_packed.py",
                            "test_e2e_gpt_oss.py", "test_e2e_logit_controls.py", "test_e2e_lora.py",
                            "test_e2e_reasoning.py", "test_e2e_spec_harmony.py", "test_e2e_structured.py",
                            "test_e2e_tools.py", "test_e2e_vision.py", "test_e2e_vllm_parity.py",
                            "test_openai_api.py", "test_surface.py"]),
            ("e2e-2", ["test_e2e_pd.py", "test_e2e_gemma3_gguf.py", "test_e2e_responses_state.py"])],
    "engine": [("engine-spec", ["test_engine_eagle.py", "test_engine_spec.py"])],
    "gpu": [("gpu-n", "test_n")],         # a name: its files from that name on
}
COMMON = ["-q", "--durations=15", "-p", "no:cacheprovider"]


def _progress(log: Path) -> str:
    """The last `[ NN%]` pytest -q wrote to a chunk's log."""
    tail = log.read_bytes()[-400:].decode(errors="replace")
    i = tail.rfind("%]")
    return tail[max(tail.rfind("[", 0, i), 0):i + 2] if i > 0 else "starting"


def chunks() -> list[tuple[str, list[str]]]:
    """(name, pytest arguments) for each chunk, in CHUNKS' order, then everything else."""
    args: dict[str, list[str]] = {}
    for folder, parts in PARTS.items():
        files = sorted(p.name for p in (ROOT / "tests" / folder).glob("test_*.py"))
        named: list[str] = []
        for chunk, which in parts:
            mine = [f for f in files if f >= which] if isinstance(which, str) else \
                [f for f in which if f in files]
            args[chunk] = [f"tests/{folder}/{f}" for f in mine]
            named += args[chunk]
        args[folder] = [f"tests/{folder}", *(f"--ignore={f}" for f in named)]
    names = [c for c in CHUNKS if args.get(c) or (ROOT / "tests" / c).is_dir()]
    out = {c: args.get(c, [f"tests/{c}"]) for c in names}
    covered = {c for c in names if (ROOT / "tests" / c).is_dir()}    # whole folders
    for folder, host in RIDES.items():
        if (ROOT / "tests" / folder).is_dir() and host in out:
            out[host] = out[host] + [f"tests/{folder}"]
            covered.add(folder)
    rest = ["tests", *(f"--ignore=tests/{c}" for c in sorted(covered))]
    if "pipeline" in out:       # the top-level files ride with the smallest chunk too
        out["pipeline"] = out["pipeline"] + [str(p.relative_to(ROOT)) for p in sorted(ROOT.glob("tests/test_*.py"))]
        extra = sorted(p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and p.name not in covered
                       and any(p.rglob("test_*.py")))
        out["pipeline"] += [f"tests/{d}" for d in extra]
        return list(out.items())
    return list(out.items()) + [("rest", rest)]


def main(argv: list[str]) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")     # before any child loads libgomp
    jobs = int(os.environ.get("TAILRACE_TEST_JOBS", "2"))
    if jobs <= 1 or argv:
        return subprocess.call([sys.executable, "-m", "pytest", *COMMON, *argv], cwd=ROOT)
    tmp = Path(tempfile.mkdtemp(prefix="tailrace-tests-"))
    todo = chunks()
    running: dict[str, tuple[subprocess.Popen, Path, float]] = {}
    status, t_start, last_note = 0, time.monotonic(), time.monotonic()
    try:
        while todo or running:
            while todo and len(running) < jobs:
                name, paths = todo.pop(0)
                log = tmp / f"{name}.log"
                cmd = [sys.executable, "-m", "pytest", *COMMON, "--basetemp", str(tmp / name), *paths]
                print(f"run_tests: [{name}] {' '.join(cmd[2:])}", flush=True)
                with open(log, "wb") as f:
                    running[name] = (subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                                      start_new_session=True), log, time.monotonic())
            if time.monotonic() - last_note > 60:      # a heartbeat: each chunk's progress
                last_note = time.monotonic()
                print("run_tests: " + ", ".join(f"[{n}] {_progress(log)}" for n, (_, log, _) in running.items()),
                      flush=True)
            for name, (proc, log, t0) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[name]
                print(f"\n===== run_tests: [{name}] exit {proc.returncode} after "
                      f"{time.monotonic() - t0:.0f} s =====", flush=True)
                sys.stdout.write(log.read_text(errors="replace"))
                sys.stdout.flush()
                # 5: no tests collected is not a failure
                if proc.returncode not in (0, 5) and status == 0:
                    status = proc.returncode
            time.sleep(0.5)
    finally:
        for proc, _, _ in running.values():      # interrupted: stop the other chunks' trees
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    print(f"run_tests: every chunk done in {time.monotonic() - t_start:.0f} s, exit {status}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
