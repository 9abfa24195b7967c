"""pipeline/layouts/process.py on its own, with tiny children (no server): waiting on a
child, supervising several, dying with the parent; and the switch interval, which the
runtime sets and a stage leaves alone."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import trio

from gpu.interface import SeqChunk, StepPlan
from pipeline.layouts import process
from pipeline.tools.harness import ScriptedRunner
from stages import gpu_step


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


async def test_wait_returns_the_exit_code_without_a_thread():
    proc = process.spawn(_python("import sys, time; time.sleep(0.2); sys.exit(3)"))
    with trio.fail_after(30):
        assert await process.wait(proc) == 3
    assert await process.wait(proc) == 3           # an exited one: at once


async def test_supervise_returns_every_code_in_order():
    procs = [process.spawn(_python(f"import sys; sys.exit({code})")) for code in (0, 2, 0)]
    with trio.fail_after(30):
        assert await process.supervise(procs, forward_to=procs) == [0, 2, 0]


async def test_a_cancelled_supervision_leaves_no_child_behind():
    procs = [process.spawn(_python("import time; time.sleep(60)")) for _ in range(2)]
    with trio.move_on_after(0.5):
        await process.supervise(procs, forward_to=procs)
    assert all(p.returncode == -signal.SIGKILL for p in procs)


GRANDCHILD = """
import os, sys, time
from pipeline.layouts import process
process.die_with_parent()
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(60)
"""
PARENT = """
import os, sys, time
from pipeline.layouts import process
process.spawn([sys.executable, "-c", sys.argv[1], sys.argv[2]])
deadline = time.monotonic() + 30
while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def test_a_child_dies_with_its_parent(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    # the parent starts a grandchild that calls die_with_parent, and exits once it has
    parent = subprocess.run([sys.executable, "-c", PARENT, GRANDCHILD, str(pid_file)],
                            timeout=60)
    assert parent.returncode == 0
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_runner_switch_interval_is_set_for_the_block_and_restored():
    outer = sys.getswitchinterval()        # the session's (tests/conftest.py)
    try:
        sys.setswitchinterval(0.005)       # CPython's default
        with process.runner_switch_interval():
            assert sys.getswitchinterval() == pytest.approx(process.SWITCH_INTERVAL_S, abs=1e-6)
        assert sys.getswitchinterval() == pytest.approx(0.005, abs=1e-6)
        with process.runner_switch_interval(1.0):        # lowers it only, never raises it
            assert sys.getswitchinterval() == pytest.approx(0.005, abs=1e-6)
    finally:
        sys.setswitchinterval(outer)


async def test_the_gpu_stage_leaves_the_switch_interval_alone():
    seen = []

    def token(sid, n):
        seen.append(sys.getswitchinterval())
        return 7
    before = sys.getswitchinterval()
    plans_in, plans_out = trio.open_memory_channel(1)
    results_in, results_out = trio.open_memory_channel(1)
    plan = StepPlan(step=0, chunks=(SeqChunk("a", (1, 2), 0, (0,), sample=True),))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(gpu_step.run, plans_out, results_in, ScriptedRunner(token))
        await plans_in.send(plan)
        await results_out.receive()
        await plans_in.aclose()
    assert seen == [before] and sys.getswitchinterval() == before
