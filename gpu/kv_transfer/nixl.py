"""KV blocks between two engines' caches over NIXL (issue 36, the transfer half of a KV
connector): no transfer engine of our own, NIXL's agent (UCX; on the CPU DRAM to DRAM
over tcp/shared memory, on CUDA VRAM to VRAM over NVLink or RDMA) does the moving.

A cache (gpu.layers.attention.KVCache) is one K and one V tensor per layer, each
[num_blocks, block_size, kv_heads, head_dim] and contiguous, so block b of a layer is
one run of bytes at base + b * block_bytes. `NixlKV` registers every tensor with its
agent once; `layout()` is what the other side needs to read from it (the agent's
metadata, every tensor's base address, the bytes of one block per layer), plain data to
send over any side channel. The reading side (decode) pulls the blocks it is given
(`read`: one descriptor per layer, K and V, and run of consecutive blocks), and NIXL
tells the owner (prefill) by a notification carrying `notif` when the read is done, so
it can free them (`notifications`).

As vLLM's NixlConnector: the decode side READs, the prefill side only holds its blocks
until told (or a timeout of its own). A rank of a tensor-parallel model registers its own
cache, whose tensors hold its share of the KV heads: a rank reads its peer rank's."""
from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import torch

from gpu.layers.attention import KVCache


@attrs.frozen
class Layout:
    """What a reader needs of a registered cache (plain data: it crosses a side channel)."""
    agent_metadata: bytes
    bases: tuple[tuple[int, int], ...]       # per layer: (K tensor's address, V's)
    block_bytes: tuple[int, ...]             # per layer: one block's bytes (K or V)
    num_blocks: int
    device: str                              # "DRAM" | "VRAM"
    device_id: int = 0


class TransferFailed(RuntimeError):
    """NIXL reported the transfer failed (the other side gone, a bad descriptor)."""


def _runs(remote: Sequence[int], local: Sequence[int]) -> list[tuple[int, int, int]]:
    """(remote start, local start, count) runs of blocks consecutive on both sides."""
    runs: list[list[int]] = []
    for r, l in zip(remote, local):
        if runs and r == runs[-1][0] + runs[-1][2] and l == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([r, l, 1])
    return [tuple(x) for x in runs]


class NixlKV:
    """One engine's KV cache registered with a NIXL agent named `name`."""

    def __init__(self, name: str, cache: KVCache, *, backends: Sequence[str] = ("UCX",),
                 progress_thread: bool = True) -> None:
        """progress_thread: NIXL's own thread driving UCX (its default); without it the
        agent progresses only inside calls (`done`, `notifications`), which an owner must
        then make often: the thread busy-polls, ~10% of a core while idle on a CPU."""
        from nixl._api import nixl_agent, nixl_agent_config

        if cache.sliding_layers:
            raise ValueError("KV transfer does not take a hybrid (sliding-window) cache yet")
        self.name = name
        self.cache = cache
        self.agent = nixl_agent(name, nixl_agent_config(
            enable_prog_thread=progress_thread, backends=list(backends)))
        tensors = [t for pair in zip(cache.k, cache.v) for t in pair]
        self._registered = self.agent.register_memory(tensors)
        dev = cache.k[0].device
        self.device = "VRAM" if dev.type == "cuda" else "DRAM"
        self.device_id = (dev.index or 0) if dev.type == "cuda" else 0
        self.block_bytes = tuple(k[0].numel() * k.element_size() for k in cache.k)

    def layout(self) -> Layout:
        return Layout(self.agent.get_agent_metadata(),
                      tuple((k.data_ptr(), v.data_ptr()) for k, v in zip(self.cache.k, self.cache.v)),
                      self.block_bytes, self.cache.num_blocks, self.device, self.device_id)

    def add_remote(self, layout: Layout) -> str:
        """Know another cache's agent (idempotent); its name, for `read`."""
        if layout.block_bytes != self.block_bytes:
            raise ValueError(f"the remote KV cache's blocks ({layout.block_bytes[0]} bytes a "
                             f"layer) are not this one's ({self.block_bytes[0]}): another model, "
                             f"block size, dtype or TP split")
        try:
            return self.agent.add_remote_agent(layout.agent_metadata)
        except Exception as exc:       # nixl's own (NIXL_ERR_NOT_ALLOWED: a name known already)
            raise TransferFailed(f"NIXL refused the remote agent: {type(exc).__name__}") from exc

    def _descs(self, bases, blocks: list[tuple[int, int]], device_id: int):
        rows = []
        for (k, v), bb in zip(bases, self.block_bytes):
            for base in (k, v):
                for start, count in blocks:
                    rows.append((base + start * bb, count * bb, device_id))
        return self.agent.get_xfer_descs(np.array(rows, dtype=np.uint64), self.device)

    def read(self, remote: str, layout: Layout, remote_blocks: Sequence[int],
             local_blocks: Sequence[int], notif: bytes = b""):
        """Start reading `remote_blocks` of the remote cache into `local_blocks` of this one,
        every layer's K and V; NIXL notifies the remote agent with `notif` when done. The
        transfer's handle, for `done`."""
        if len(remote_blocks) != len(local_blocks):
            raise ValueError("as many local blocks as remote ones")
        if any(not 0 <= b < layout.num_blocks for b in remote_blocks):
            raise ValueError(f"a remote block id is outside the remote cache "
                             f"(0 to {layout.num_blocks - 1})")
        runs = _runs(remote_blocks, local_blocks)
        local = self._descs([(k.data_ptr(), v.data_ptr()) for k, v in zip(self.cache.k, self.cache.v)],
                            [(l, n) for _, l, n in runs], self.device_id)
        far = self._descs(layout.bases, [(r, n) for r, _, n in runs], layout.device_id)
        try:
            handle = self.agent.initialize_xfer("READ", local, far, remote, notif)
        except Exception as exc:       # nixl's own errors (nixlNotFoundError: an unknown agent)
            raise TransferFailed(f"NIXL could not start the KV read from {remote!r}: "
                                 f"{type(exc).__name__}") from exc
        try:
            state = self.agent.transfer(handle)
        except Exception as exc:       # nixlRemoteDisconnectError: the remote agent is gone
            state = type(exc).__name__
        if state not in ("DONE", "PROC"):
            self._release(handle)
            raise TransferFailed(f"NIXL could not start the KV read from {remote!r} ({state})")
        return handle

    def done(self, handle) -> bool:
        """True once the read has landed (its handle released); TransferFailed on an error
        (the handle released too: the remote agent gone mid-read, a bad descriptor)."""
        try:
            state = self.agent.check_xfer_state(handle)
        except Exception as exc:       # nixl's own errors (nixlRemoteDisconnectError)
            state = type(exc).__name__
        if state == "PROC":
            return False
        self._release(handle)
        if state != "DONE":
            raise TransferFailed(f"the KV read failed ({state})")
        return True

    def _release(self, handle) -> None:
        try:
            self.agent.release_xfer_handle(handle)
        except Exception:              # a handle NIXL already dropped with its remote agent
            pass

    def notifications(self) -> dict[str, list[bytes]]:
        """The notifications that arrived since the last call, by agent name (the owner's
        side: a reader's `notif` once its read is done)."""
        return self.agent.get_new_notifs()

    def notify(self, remote: str, message: bytes) -> None:
        """Send the other agent a notification (a decode side that will not read: free)."""
        self.agent.send_notif(remote, message)

    def remove_remote(self, remote: str) -> None:
        self.agent.remove_remote_agent(remote)

    def close(self) -> None:
        self.agent.deregister_memory(self._registered)


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of every layer for one token."""
    return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
