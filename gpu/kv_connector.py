"""The KV connector's worker half (issue 36): the engine's KV cache registered with NIXL
(gpu/kv_transfer.py `NixlKV`), the remote prefills the runner reads for the decode side,
and the notifications the prefill side gets when a decode side's read has landed.

The runner calls `start` for each `KVRead` a plan brings and `poll` every step (the
scheduler keeps sending plans while reads are in flight); the engine core's connector
task (pipeline/core/kv_task.py) calls `released` for the prefill side. One lock around
the agent: the runner thread and the event loop both use it."""
from __future__ import annotations

import base64
import logging
import os
import socket
import threading
import time

from gpu.interface import KVRead
from gpu.kv_transfer import Layout, NixlKV, TransferFailed
from gpu.kv_side_channel import fetch_layout, layout_message

_log = logging.getLogger("tailrace.kv")

READ_TIMEOUT_ENV = "TAILRACE_KV_READ_TIMEOUT_S"


class KVConnector:
    def __init__(self, config, cache) -> None:
        """config: --kv-transfer-config (stages/lib/kv_transfer.py KVTransferConfig)."""
        if config.kv_buffer_device == "cuda" and cache.k[0].device.type != "cuda":
            raise ValueError('--kv-transfer-config: kv_buffer_device "cuda" needs the KV '
                             'cache on a CUDA device (this engine runs on the CPU: "cpu")')
        self.config = config
        # on the CPU without NIXL's progress thread (it busy-polls a core's tenth while
        # idle): the runner's polls and this side's notification watch drive UCX
        self.kv = NixlKV(f"tailrace-{config.engine_id}", cache,
                         progress_thread=cache.k[0].device.type == "cuda")
        self.lock = threading.Lock()
        self.read_timeout_s = float(os.environ.get(READ_TIMEOUT_ENV, "30"))
        self._reads: dict[str, tuple[object, float]] = {}     # seq id -> (handle, deadline)
        self._failed: list[tuple[str, str]] = []
        # the side channel's socket, bound at start-up so that its port is known (0: any)
        self.sock = socket.create_server((config.side_channel_host, config.side_channel_port))
        self.port = self.sock.getsockname()[1]
        with self.lock:
            self.layout = layout_message(config.engine_id, self.kv.layout())

    # -- the decode side (the runner thread) --------------------------------------------
    def start(self, read: KVRead) -> None:
        """Begin a remote prefill's read; a failure is reported by the next `poll`."""
        where = f"{read.host}:{read.port}"
        try:
            msg = fetch_layout(read.host, read.port)
        except (OSError, ValueError) as exc:
            self._failed.append((read.seq_id, f"the prefill instance's KV side channel at "
                                 f"{where} did not answer ({type(exc).__name__}: {exc}): it "
                                 f"is gone or unreachable, so its KV cannot be read"))
            return
        if msg.get("engine_id") != read.engine_id:
            self._failed.append((read.seq_id, f"the KV side channel at {where} is engine "
                                 f"{msg.get('engine_id')!r}, not remote_engine_id "
                                 f"{read.engine_id!r} (the prefill instance restarted?)"))
            return
        layout = Layout(base64.b64decode(msg["agent_metadata"]),
                        tuple(tuple(b) for b in msg["bases"]), tuple(msg["block_bytes"]),
                        msg["num_blocks"], msg["device"], msg["device_id"])
        try:
            with self.lock:
                remote = self.kv.add_remote(layout)
                handle = self.kv.read(remote, layout, read.block_ids, read.local_block_ids,
                                      notif=read.request_id.encode())
        except (ValueError, TransferFailed) as exc:
            self._failed.append((read.seq_id, f"the KV read from {where} failed: {exc}"))
            return
        self._reads[read.seq_id] = (handle, time.monotonic() + self.read_timeout_s)

    def poll(self) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
        """The reads that have landed and those that failed since the last poll."""
        done = []
        now = time.monotonic()
        for sid, (handle, deadline) in list(self._reads.items()):
            try:
                with self.lock:
                    landed = self.kv.done(handle)
            except TransferFailed as exc:
                del self._reads[sid]
                self._failed.append((sid, f"the KV read from the prefill instance failed: {exc}"))
                continue
            if landed:
                del self._reads[sid]
                done.append(sid)
            elif now > deadline:
                del self._reads[sid]   # its handle is left to NIXL: the blocks stay held
                self._failed.append((sid, f"the KV read from the prefill instance took over "
                                     f"{self.read_timeout_s:g} s ({READ_TIMEOUT_ENV})"))
        failed, self._failed = tuple(self._failed), []
        return tuple(done), failed

    @property
    def reading(self) -> bool:
        return bool(self._reads or self._failed)

    # -- the prefill side (the event loop) ----------------------------------------------
    def released(self) -> tuple[str, ...]:
        """Request ids whose blocks a decode side has read (NIXL's notifications)."""
        with self.lock:
            notes = self.kv.notifications()
        return tuple(n.decode() for got in notes.values() for n in got)

    def close(self) -> None:
        self.sock.close()
        with self.lock:
            self.kv.close()
