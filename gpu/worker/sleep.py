"""Sleep mode (--enable-sleep-mode, as vLLM's): the runner lets go of its memory while no
request runs, and gets it back on wake.

- level 1: the KV cache is dropped (its contents are lost: the scheduler forgets its
  cached prefixes); the weights stay, in host memory (on CUDA they are moved there).
- level 2: the KV cache and the weights are dropped; waking reloads the weights from the
  checkpoint (`reload`, start-up's loader with the same flags).

Waking allocates the KV cache again (zeros, the shapes it had). On CUDA the captured
graphs read the old addresses: they are dropped and the runner runs eagerly from then on.
Called in a worker thread by the schedule stage while no step is in flight."""
from __future__ import annotations

import gc
import logging
from collections.abc import Callable

import torch

_log = logging.getLogger("tailrace.gpu")


class Sleeper:
    def __init__(self, runner, reload: Callable[[], torch.nn.Module] | None) -> None:
        self.runner = runner
        self.reload = reload
        self.level = 0                   # 0: awake
        # (shape, dtype, device, index of the first entry holding the same tensor: a shared-KV
        # layer's are its source's, KVCache kv_sources, and stay so after waking)
        self._kv: list[tuple[torch.Size, torch.dtype, torch.device, int]] = []
        self._device: torch.device | None = None

    @property
    def _model(self) -> torch.nn.Module | None:
        return getattr(self.runner, "model", None)

    def sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.level:
            return                       # already asleep: as vLLM, a second sleep is a no-op
        cache = getattr(self.runner, "cache", None)
        if cache is not None:            # a stand-in runner (--simulate-gpu) holds none
            first: dict[int, int] = {}
            self._kv = [(t.shape, t.dtype, t.device, first.setdefault(id(t), i))
                        for i, t in enumerate((*cache.k, *cache.v))]
            n = len(cache.k)
            for i in range(n):
                cache.k[i] = torch.empty(0, dtype=cache.k[i].dtype, device=cache.k[i].device)
                cache.v[i] = torch.empty(0, dtype=cache.v[i].dtype, device=cache.v[i].device)
        model = self._model
        if model is not None:
            tensors = list(_tensors(model))
            self._device = tensors[0].device if tensors else None
            for t in tensors:
                if level == 2:
                    t.data = torch.empty(0, dtype=t.dtype, device=t.device)
                elif t.device.type != "cpu":
                    t.data = t.data.to("cpu")
        self.level = level
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        _log.info("asleep at level %d", level)

    def wake_up(self) -> None:
        if not self.level:
            return
        model = self._model
        if model is not None:
            if self.level == 2:
                if self.reload is None:
                    raise RuntimeError("this runner's weights cannot be reloaded")
                fresh = dict(_named_tensors(self.reload()))
                for name, t in _named_tensors(model):
                    t.data = fresh[name].data
                del fresh
            elif self._device is not None and self._device.type != "cpu":
                for t in _tensors(model):
                    t.data = t.data.to(self._device)
        cache = getattr(self.runner, "cache", None)
        if cache is not None and self._kv:
            n, fresh = len(cache.k), []
            for i, (shape, dtype, device, same) in enumerate(self._kv):
                fresh.append(fresh[same] if same < i else torch.zeros(shape, dtype=dtype, device=device))
            cache.k[:], cache.v[:] = fresh[:n], fresh[n:]
        if getattr(model, "fused_decode", None) is not None:
            model.fused_decode.invalidate()   # gpu/kernels/cpu/layer.py holds the old addresses
        if getattr(self.runner, "graphs", None) is not None:
            _log.warning("woken up: the CUDA graphs read the old memory; running eagerly from now on")
            self.runner.graphs = None
        _log.info("awake (was at level %d)", self.level)
        self.level = 0


def _named_tensors(model: torch.nn.Module):
    yield from model.named_parameters()
    yield from model.named_buffers()


def _tensors(model: torch.nn.Module):
    for _, t in _named_tensors(model):
        yield t
