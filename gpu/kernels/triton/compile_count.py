"""How many Triton kernels this process has compiled: the sum of the launch caches of every
@triton.jit kernel in gpu/. `pipeline.tools.bench` reads it at the start and the end of the timed
window; any difference is a compile in the middle of a run (1-2 s each on an H200), which
must not happen (issue 26): the warm-up and graph capture compile every variant a run meets,
and the kernels' do_not_specialize / do_not_specialize_on_alignment lists keep the variants
from multiplying with the batch.

Read from the caches rather than through a compile hook: the hooks are one global slot each
(another user would replace ours) and their names moved between Triton releases. Each
JITFunction keeps ``device_caches[device] = (kernel_cache, ...)`` (Triton 3.3 to 3.9;
``cache[device]`` before). Under the interpreter nothing is compiled: None.
"""
from __future__ import annotations

import sys


def _kernels():
    seen = set()
    for name, module in list(sys.modules.items()):
        if not (name == "gpu" or name.startswith("gpu.")) or module is None:
            continue
        for obj in list(vars(module).values()):
            if id(obj) not in seen and (hasattr(obj, "device_caches") or hasattr(obj, "cache")) \
                    and hasattr(obj, "fn") and hasattr(obj, "params"):
                seen.add(id(obj))
                yield obj


def compiled_kernels() -> int | None:
    """Compiled variants held by gpu/'s kernels, over every device; None when no kernel is
    compiled here (the interpreter) or this Triton keeps its cache elsewhere."""
    total, found = 0, False
    for fn in _kernels():
        caches = getattr(fn, "device_caches", None)
        if caches is not None:
            for entry in list(caches.values()):
                total += len(entry[0])
            found = True
        elif isinstance(getattr(fn, "cache", None), dict):
            total += sum(len(c) for c in fn.cache.values())
            found = True
    return total if found else None
