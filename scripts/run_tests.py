"""`make test`: the suite as two pytest processes side by side, each on its own part of tests/.

Most e2e tests wait on a server (the suite ran at ~1.2 cores of 2 serially), so a second
pytest process fills the idle core. The parts do not share session servers (tests/e2e's
servers live in its conftest), so nothing is started twice, unlike pytest-xdist, whose
workers each started every session server (docs/benchmarks.md, "The test suite's time").

    python scripts/run_tests.py [pytest args...]      # one process, the whole suite (the default)
    TAILRACE_TEST_JOBS=2 python scripts/run_tests.py  # two processes; extra args go to both

Measured on the 2-core machine (docs/benchmarks.md, "The test suite's time"): two parts
side by side were slower than one process, not faster: each process's OpenMP team (and
its servers') wants both cores, and oversubscribed OpenMP barriers wait out time slices.
So the default is one process; two stay for a machine with more cores.

Each part writes to its own log and temporary directory; a part's log is printed whole
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
# (name, pytest arguments): tests/e2e (its session servers) beside everything else
PARTS = [
    ("e2e", ["tests/e2e"]),
    ("rest", ["tests", "--ignore=tests/e2e"]),
]
COMMON = ["-q", "--durations=25", "-p", "no:cacheprovider"]


def _progress(log: Path) -> str:
    """The last `[ NN%]` pytest -q wrote to a part's log."""
    tail = log.read_bytes()[-400:].decode(errors="replace")
    i = tail.rfind("%]")
    return tail[max(tail.rfind("[", 0, i), 0):i + 2] if i > 0 else "starting"


def main(argv: list[str]) -> int:
    jobs = int(os.environ.get("TAILRACE_TEST_JOBS", "1"))
    if jobs <= 1:
        return subprocess.call([sys.executable, "-m", "pytest", *COMMON, *argv], cwd=ROOT)
    tmp = Path(tempfile.mkdtemp(prefix="tailrace-tests-"))
    running: dict[str, tuple[subprocess.Popen, Path, float]] = {}
    for name, paths in PARTS:
        log = tmp / f"{name}.log"
        cmd = [sys.executable, "-m", "pytest", *COMMON, "--basetemp", str(tmp / name), *paths, *argv]
        print(f"run_tests: [{name}] {' '.join(cmd[2:])} > {log}", flush=True)
        with open(log, "wb") as f:
            running[name] = (subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                              start_new_session=True), log, time.monotonic())
    status = 0
    last_note = time.monotonic()
    try:
        while running:
            if time.monotonic() - last_note > 60:      # a heartbeat: each part's progress
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
                # 5: no tests collected (a filter that selects none in one part) is not a failure
                if proc.returncode not in (0, 5) and status == 0:
                    status = proc.returncode
            time.sleep(0.5)
    finally:
        for proc, _, _ in running.values():      # interrupted: stop the other part's tree
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
