"""The KV connector's worker half (issue 36): the engine's KV cache registered with NIXL
(gpu/kv_transfer.py `NixlKV`), the remote prefills the runner reads for the decode side,
and the notifications the prefill side gets when a decode side's read has landed.

The runner calls `start` for each `KVRead` a plan brings and `poll` every step (the
scheduler keeps sending plans while reads are in flight); the engine core's connector
task (pipeline/core/kv_task.py) calls `released` for the prefill side. One lock around
the agent: the runner thread and the event loop both use it.

The decode side asks a prefill engine's side channel for its layout once and keeps it
(by host, port and engine id; another engine id on that port asks again). A read that
fails (NIXL: the remote agent disconnected, as when the prefill instance is killed, before
or during the read) ends its request with the error and drops that engine's agent and
layout, so that the next request asks the side channel again (and gets a clear "did not
answer" if the instance is gone)."""
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


class Unreadable(Exception):
    """A prefill engine's KV cannot be read: its side channel did not answer, or it is
    another engine than remote_engine_id, or its cache is not like this one."""


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
        # seq id -> (handle, deadline, (host, port), remote agent)
        self._reads: dict[str, tuple[object, float, tuple[str, int], str]] = {}
        # (host, port) -> (engine id, remote agent, Layout): prefill engines read from
        self._remotes: dict[tuple[str, int], tuple[str, str, Layout]] = {}
        # seq id -> (handle, (host, port), remote agent): reads past the timeout, their
        # requests ended, that NIXL still holds; watched until they land or fail, so that
        # the scheduler frees their blocks only then
        self._late: dict[str, tuple[object, tuple[str, int], str]] = {}
        self._stale: set[str] = set()     # remote agents to drop once their reads end
        self._failed: list[tuple[str, str]] = []
        # the side channel's socket, bound at start-up so that its port is known (0: any)
        self.sock = socket.create_server((config.side_channel_host, config.side_channel_port))
        self.port = self.sock.getsockname()[1]
        with self.lock:
            self.layout = layout_message(config.engine_id, self.kv.layout())

    # -- the decode side (the runner thread) --------------------------------------------
    def _remote(self, read: KVRead) -> tuple[str, Layout]:
        """The prefill engine's NIXL agent and cache layout: asked of its side channel once
        per engine (id), then kept; Unreadable or TransferFailed as `start` reports."""
        where = (read.host, read.port)
        got = self._remotes.get(where)
        if got is not None and got[0] == read.engine_id:
            return got[1], got[2]
        try:
            msg = fetch_layout(read.host, read.port)
        except (OSError, ValueError) as exc:
            raise Unreadable(f"the prefill instance's KV side channel at {read.host}:"
                             f"{read.port} did not answer ({type(exc).__name__}: {exc}): it "
                             f"is gone or unreachable, so its KV cannot be read") from exc
        if msg.get("engine_id") != read.engine_id:
            raise Unreadable(f"the KV side channel at {read.host}:{read.port} is engine "
                             f"{msg.get('engine_id')!r}, not remote_engine_id "
                             f"{read.engine_id!r} (the prefill instance restarted?)")
        try:
            layout = Layout(base64.b64decode(msg["agent_metadata"]),
                            tuple(tuple(b) for b in msg["bases"]), tuple(msg["block_bytes"]),
                            msg["num_blocks"], msg["device"], msg["device_id"])
        except (KeyError, TypeError, ValueError) as exc:
            raise Unreadable(f"the KV side channel at {read.host}:{read.port} answered no "
                             f"layout ({type(exc).__name__}: {exc})") from exc
        if got is not None:               # another engine on that port now: forget the old
            self._forget(where)
        with self.lock:
            try:
                name = self.kv.add_remote(layout)
            except ValueError as exc:
                raise Unreadable(str(exc)) from exc
        self._remotes[where] = (read.engine_id, name, layout)
        return name, layout

    def _forget(self, where: tuple[str, int]) -> None:
        """Drop a prefill engine whose read failed (gone, most likely): its agent leaves
        NIXL once no other read of it is in flight (a dead agent left in would take the
        next reads' errors with it, and UCX aborts at exit over its queued requests)."""
        got = self._remotes.pop(where, None)
        if got is not None:
            self._stale.add(got[1])
        busy = {r[3] for r in self._reads.values()} | {r[2] for r in self._late.values()}
        for name in list(self._stale - busy):
            self._stale.discard(name)
            with self.lock:
                try:
                    self.kv.remove_remote(name)
                except Exception:      # nixl's errors: already dropped with its connection
                    pass

    def start(self, read: KVRead) -> None:
        """Begin a remote prefill's read; a failure is reported by the next `poll`."""
        where = f"{read.host}:{read.port}"
        try:
            name, layout = self._remote(read)
        except (Unreadable, TransferFailed) as exc:
            self._failed.append((read.seq_id, str(exc)))
            return
        try:
            with self.lock:
                handle = self.kv.read(name, layout, read.block_ids, read.local_block_ids,
                                      notif=read.request_id.encode())
        except (ValueError, TransferFailed) as exc:
            gone = isinstance(exc, TransferFailed)
            self._failed.append((read.seq_id, f"the KV read from the prefill instance at "
                                 f"{where} failed: {exc}" + (" (is it gone?)" if gone else "")))
            if gone:
                self._forget((read.host, read.port))
            return
        self._reads[read.seq_id] = (handle, time.monotonic() + self.read_timeout_s,
                                    (read.host, read.port), name)

    def poll(self) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...], tuple[str, ...]]:
        """The reads that have landed and those that failed since the last poll, and of
        those failed the ones that timed out with NIXL still holding them (StepResult's
        kv_late: their blocks stay held until a later poll names them again, landed or
        failed). NIXL has no cancel of a read in flight that is known to stop the remote
        side's write; releasing the handle of an unfinished read is not that, so a late
        read is watched to its end instead."""
        done, late = [], []
        now = time.monotonic()
        for sid, (handle, where, _) in list(self._late.items()):
            try:
                with self.lock:
                    landed = self.kv.done(handle)
            except TransferFailed as exc:
                del self._late[sid]
                self._failed.append((sid, f"the late KV read failed: {exc}"))
                self._forget(where)
                continue
            if landed:
                del self._late[sid]
                done.append(sid)       # the scheduler frees the blocks it kept for it
        for sid, (handle, deadline, where, name) in list(self._reads.items()):
            try:
                with self.lock:
                    landed = self.kv.done(handle)
            except TransferFailed as exc:
                del self._reads[sid]
                self._failed.append((sid, f"the KV read from the prefill instance at "
                                     f"{where[0]}:{where[1]} failed: {exc} (is it gone?)"))
                self._forget(where)
                continue
            if landed:
                del self._reads[sid]
                done.append(sid)
            elif now > deadline:
                del self._reads[sid]
                self._late[sid] = (handle, where, name)
                late.append(sid)
                _log.warning("KV read %s from %s:%s past %g s: its request ends, its blocks "
                             "stay held until NIXL ends the read", sid, *where,
                             self.read_timeout_s)
                self._failed.append((sid, f"the KV read from the prefill instance at "
                                     f"{where[0]}:{where[1]} took over "
                                     f"{self.read_timeout_s:g} s ({READ_TIMEOUT_ENV})"))
        if self._stale:
            self._forget(("", -1))
        failed, self._failed = tuple(self._failed), []
        return tuple(done), failed, tuple(late)

    @property
    def reading(self) -> bool:
        return bool(self._reads or self._failed or self._late)

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
