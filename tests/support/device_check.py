"""A device-checking shim: find host tensors that meet device tensors, without a GPU.

Run the code under test with its data on the "meta" device inside ``DeviceCheck()``.
A tensor the code creates without naming a device lands on the CPU, and the first op
that combines it with a meta tensor raises ``DeviceMismatch`` naming the op: the same
mistake that fails on CUDA with "Expected all tensors to be on the same device". Meta
kernels check devices only now and then (index_select, for one, takes a CPU index for
a meta tensor), so the shim checks every call itself. 0-dim CPU tensors may mix, as on
CUDA; ``.to``/``.copy_`` are the sanctioned crossings.

Meta tensors hold no data: with ``host_reads=True`` the shim answers ``.tolist()``,
``.item()`` and ``.cpu()`` of a meta tensor with zeros of its shape, so code that reads
a result back (the runner's sampled tokens) runs to its end; it records each read in
``reads`` (one per step is the budget of the device path).
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves


class DeviceMismatch(AssertionError):
    pass


_CROSSING = {"to", "copy_", "cpu", "cuda", "pin_memory", "new_tensor", "__get__", "__set__"}
_READS = {"tolist", "item", "cpu", "numpy"}


class DeviceCheck(TorchFunctionMode):
    def __init__(self, host_reads: bool = False) -> None:
        super().__init__()
        self.host_reads = host_reads
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if self.host_reads and name in _READS and args and isinstance(args[0], torch.Tensor) \
                and args[0].device.type == "meta":
            self.reads.append(name)
            host = torch.zeros(args[0].shape, dtype=args[0].dtype)
            return host if name == "cpu" else (host.numpy() if name == "numpy" else
                                               host.tolist() if name == "tolist" else host.item())
        if name not in _CROSSING:
            devices = {t.device for t in tree_leaves((args, kwargs))
                       if isinstance(t, torch.Tensor) and t.dim() > 0}
            if len(devices) > 1:
                shapes = [(tuple(t.shape), str(t.device)) for t in tree_leaves((args, kwargs))
                          if isinstance(t, torch.Tensor)]
                raise DeviceMismatch(f"{name} mixes devices {sorted(map(str, devices))}: {shapes}")
        return func(*args, **kwargs)
