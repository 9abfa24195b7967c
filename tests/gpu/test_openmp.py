"""gpu/kernels/cpu/openmp.py: the calling thread's OpenMP team is given back (its worker threads
exit), and torch works on afterwards. Why it matters: docs/benchmarks.md (a runner
thread's GEMMs ran at half speed while start-up's team lived)."""
import subprocess
import sys

CHECK = r"""
import os, threading, torch
from gpu.kernels.cpu.openmp import release_team
def tasks(): return len(os.listdir("/proc/self/task"))
torch.set_num_threads(2)                # a team of two whatever the CPU count
base = tasks()
a = torch.randn(512, 512)
a @ a                                   # a parallel region: this thread's team starts
with_team = tasks()
released = release_team()
after = tasks()
b = (a @ a).sum().item()               # a new team, same answer
print(base, with_team, released, after, round(b, 3) == round((a @ a).sum().item(), 3))
"""


def test_release_team_ends_the_calling_threads_workers():
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    base, with_team, released, after, same = done.stdout.split()
    assert released == "True"
    assert int(with_team) > int(base)                 # the team's worker threads
    assert int(after) < int(with_team)                # ... gone
    assert same == "True"
