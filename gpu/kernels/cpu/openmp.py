"""The calling thread's OpenMP team, given back (libgomp's omp_pause_resource_all).

Why: the engine loads the model on its main thread, whose OpenMP parallel regions (torch's
and oneDNN's) leave a team of worker threads behind, and then runs every step on its
runner thread, which gets a team of its own. libgomp counts the threads of both teams;
once they outnumber the CPUs it stops spinning between parallel regions ("throttled"
waiting) and each of the step's few hundred regions pays a futex wake-up. Measured on 2
cores (Intel Xeon with AMX), a bf16 [32 x 576] x [576 x 3072] GEMM on a second thread:
162 us alone, 297 us once the main thread had run one; a SmolLM2 decode step of 32:
46 ms against 70 ms. Pausing the main thread's team after start-up (hard pause: its
threads exit) gives the runner thread's team the machine again (docs/benchmarks.md).

Only libgomp (torch's CPU wheels) is handled; another OpenMP runtime makes this a no-op.
"""
from __future__ import annotations

import ctypes
import glob
import os

_OMP_PAUSE_HARD = 2


def _libgomp():
    import torch

    for path in glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")):
        try:
            return ctypes.CDLL(path, mode=os.RTLD_NOLOAD)   # only if torch loaded it
        except OSError:
            continue
    return None


def release_team() -> bool:
    """Free the calling thread's OpenMP team (its worker threads exit; a later parallel
    region on this thread starts a new one). True when libgomp did it."""
    lib = _libgomp()
    if lib is None or not hasattr(lib, "omp_pause_resource_all"):
        return False
    return lib.omp_pause_resource_all(_OMP_PAUSE_HARD) == 0
