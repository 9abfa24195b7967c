"""The KV connector's worker half (issue 36): the engine's KV cache registered with NIXL
(gpu/kv_transfer/nixl.py `NixlKV`), the remote prefills the runner reads for the decode side,
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
answer" if the instance is gone).

Under tensor parallelism (`--tensor-parallel-size N`) every rank has a `KVConnector` of
its own on its own cache shard (its KV heads), with its own NIXL agent; only rank 0's has
the side channel's socket, and it serves every rank's layout (gathered at start-up,
gpu/worker/tp.py `gather_layouts`). The decode side's rank R reads the prefill side's rank
R's shard of the same blocks (the block ids are the schedulers', the same on every rank),
asking the side channel for rank R's layout; an engine whose TP size is not this one's is
Unreadable (NIXL's basic mode needs the same TP size on both sides, as vLLM's homogeneous
case). Rank 0's `TPKVConnector` starts each read on every rank and combines their polls
(`RankReads`): a read has landed when it has on every rank, has failed when it has on any,
and is over (its blocks free to reuse) when every rank's read is. The READs then carry no
NIXL notification: rank 0 sends the prefill side's rank 0 the request id once every rank's
read has landed (`notify_read`), so that the prefill side frees the blocks only then."""
from __future__ import annotations

import base64
import logging
import os
import socket
import threading
import time

import attrs

from gpu.interface import KVRead
from gpu.kv_transfer.nixl import Layout, NixlKV, TransferFailed
from gpu.kv_transfer.side_channel import fetch_layout, layout_message, no_rank_message, send_free

_log = logging.getLogger("tailrace.kv")

READ_TIMEOUT_ENV = "TAILRACE_KV_READ_TIMEOUT_S"
DRIVE_S = 0.02          # a worker rank's calls into its NIXL agent, this often (drive)


class Unreadable(Exception):
    """A prefill engine's KV cannot be read: its side channel did not answer, or it is
    another engine than remote_engine_id, or its cache is not like this one."""


class Mismatch(Unreadable):
    """The prefill engine answered, but its KV will never be readable here (another TP
    size): rank 0 tells it to free the request's blocks at once."""


class KVConnector:
    def __init__(self, config, cache, rank: int = 0, tp_size: int = 1) -> None:
        """config: --kv-transfer-config (stages/kv_transfer.py KVTransferConfig); rank
        and tp_size: this rank's place under tensor parallelism (the side channel's socket
        is rank 0's alone)."""
        if config.kv_buffer_device == "cuda" and cache.k[0].device.type != "cuda":
            raise ValueError('--kv-transfer-config: kv_buffer_device "cuda" needs the KV '
                             'cache on a CUDA device (this engine runs on the CPU: "cpu")')
        self.config = config
        self.rank, self.tp_size = rank, tp_size
        # on the CPU without NIXL's progress thread (it busy-polls a core's tenth while
        # idle): the runner's polls and this side's notification watch drive UCX
        self.progress_thread = cache.k[0].device.type == "cuda"
        self.kv = NixlKV(f"tailrace-{config.engine_id}" + (f"-tp{rank}" if rank else ""),
                         cache, progress_thread=self.progress_thread)
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
        self.sock = self.port = None
        if rank == 0:
            self.sock = socket.create_server((config.side_channel_host,
                                              config.side_channel_port))
            self.port = self.sock.getsockname()[1]
        with self.lock:
            self.own_layout: Layout = self.kv.layout()
        # what the side channel answers, by rank (rank 0's: every rank's once gathered)
        self.layouts: tuple[bytes, ...] = ()
        self.serve_layouts((self.own_layout,))
        self.no_rank = no_rank_message(config.engine_id, tp_size)

    def serve_layouts(self, layouts) -> None:
        """The side channel's answers: rank R's Layout under this engine's id and TP size
        (rank 0, once the worker ranks' layouts are gathered, by rank)."""
        self.layouts = tuple(layout_message(self.config.engine_id, layout, self.tp_size, r)
                             for r, layout in enumerate(layouts))

    # -- the decode side (the runner thread) --------------------------------------------
    def _remote(self, read: KVRead) -> tuple[str, Layout]:
        """The prefill engine's NIXL agent and cache layout: asked of its side channel once
        per engine (id), then kept; Unreadable or TransferFailed as `start` reports."""
        where = (read.host, read.port)
        got = self._remotes.get(where)
        if got is not None and got[0] == read.engine_id:
            return got[1], got[2]
        try:
            msg = fetch_layout(read.host, read.port, self.rank)
        except (OSError, ValueError) as exc:
            raise Unreadable(f"the prefill instance's KV side channel at {read.host}:"
                             f"{read.port} did not answer ({type(exc).__name__}: {exc}): it "
                             f"is gone or unreachable, so its KV cannot be read") from exc
        if msg.get("engine_id") != read.engine_id:
            raise Unreadable(f"the KV side channel at {read.host}:{read.port} is engine "
                             f"{msg.get('engine_id')!r}, not remote_engine_id "
                             f"{read.engine_id!r} (the prefill instance restarted?)")
        remote_tp = msg.get("tp_size", 1)
        if remote_tp != self.tp_size:
            raise Mismatch(f"the prefill instance at {read.host}:{read.port} runs "
                             f"--tensor-parallel-size {remote_tp}, this one "
                             f"{self.tp_size}: the NIXL KV connector moves each TP rank's "
                             f"KV-head shard to the same rank, so both instances need the "
                             f"same --tensor-parallel-size")
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

    @staticmethod
    def _free_remote(read: KVRead) -> None:
        """Tell the prefill instance to free a request this side will never read (its side
        channel has just answered); a failure is logged only (it frees at its timeout)."""
        try:
            send_free(read.host, read.port, read.request_id)
        except (OSError, ValueError) as exc:
            _log.warning("could not tell the prefill instance at %s:%d to free request %s: "
                         "%s", read.host, read.port, read.request_id, exc)

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
            if isinstance(exc, Mismatch) and self.rank == 0:
                self._free_remote(read)
            return
        try:
            with self.lock:
                # under TP rank 0 notifies once every rank's read has landed (notify_read)
                handle = self.kv.read(name, layout, read.block_ids, read.local_block_ids,
                                      notif=read.request_id.encode() if self.tp_size == 1
                                      else b"")
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

    def notify_read(self, read: KVRead) -> None:
        """Under TP: tell the prefill engine's rank 0 that every rank's read of `read` has
        landed (its READs carried no notification); a failure is logged only (it frees the
        blocks at its abort timeout then)."""
        got = self._remotes.get((read.host, read.port))
        try:
            if got is None or got[0] != read.engine_id:
                raise KeyError("its agent is no longer known here")
            with self.lock:
                self.kv.notify(got[1], read.request_id.encode())
        except Exception as exc:       # nixl's own errors: the remote agent gone
            _log.warning("could not tell the prefill instance at %s:%d that request %s was "
                         "read: %s", read.host, read.port, read.request_id, exc)

    # -- the prefill side (the event loop) ----------------------------------------------
    def released(self) -> tuple[str, ...]:
        """Request ids whose blocks a decode side has read (NIXL's notifications)."""
        with self.lock:
            notes = self.kv.notifications()
        return tuple(n.decode() for got in notes.values() for n in got)

    def drive(self, every_s: float = DRIVE_S) -> threading.Thread:
        """A worker rank on the CPU (no NIXL progress thread): a daemon thread that calls
        into the agent every `every_s`, as rank 0's notification watch does, so that UCX
        serves the decode side's reads of this rank's shard while the rank waits for steps
        (its READs carry no notification: rank 0 frees, gpu/kv_transfer/connector.py's docstring)."""
        def run() -> None:
            while True:
                time.sleep(every_s)
                self.released()

        thread = threading.Thread(target=run, name="tailrace-kv-drive", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        with self.lock:
            self.kv.close()

    def start_reads(self, reads) -> None:
        for read in reads:
            self.start(read)


@attrs.define
class _RankRead:
    read: KVRead
    landed: set = attrs.field(factory=set)      # ranks whose read has landed
    over: set = attrs.field(factory=set)        # ranks whose read has ended (landed or failed)
    error: str | None = None
    error_rank: int = 0
    reported: bool = False                      # its failure told (its blocks held till over)


class RankReads:
    """Rank 0's combination of every TP rank's polls (each a `KVConnector.poll` triple) into
    the one triple the scheduler reads (StepResult's kv_loaded, kv_failed, kv_late): a read
    has landed once it has on every rank; it has failed as soon as it has on any (the
    lowest rank's error), late while another rank's read of it may still write into its
    blocks, and is named again, as landed, once every rank's read is over."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._reads: dict[str, _RankRead] = {}

    def started(self, read: KVRead) -> None:
        self._reads[read.seq_id] = _RankRead(read)

    def add(self, rank: int, polled) -> None:
        done, failed, late = polled
        for sid in done:
            got = self._reads.get(sid)
            if got is not None:
                got.landed.add(rank)
                got.over.add(rank)
        for sid, error in failed:
            got = self._reads.get(sid)
            if got is None:
                continue
            if sid not in late:
                got.over.add(rank)
            if not got.reported and (got.error is None or rank < got.error_rank):
                got.error = error + (f" (tensor-parallel rank {rank})" if rank else "")
                got.error_rank = rank

    def results(self):
        """(loaded, failed, late, reads to notify) since the last call."""
        loaded, failed, late, notify = [], [], [], []
        for sid, got in list(self._reads.items()):
            over = len(got.over) == self.size
            everywhere = len(got.landed) == self.size
            if not got.reported:
                if got.error is not None:
                    got.reported = True
                    failed.append((sid, got.error))
                    if not over:          # another rank's read may still write its blocks
                        late.append(sid)
                        continue
                elif everywhere:
                    loaded.append(sid)
                    notify.append(got.read)
                else:
                    continue
            elif over:                    # a failure told before, now over: blocks free
                loaded.append(sid)
                if everywhere:            # only late, not failed: the data was read
                    notify.append(got.read)
            else:
                continue
            del self._reads[sid]
        return tuple(loaded), tuple(failed), tuple(late), notify

    @property
    def reading(self) -> bool:
        return bool(self._reads)


class TPKVConnector:
    """Rank 0's connector under tensor parallelism, as the runner uses it (`start_reads`,
    `poll`, `reading`): its own rank's `KVConnector` plus, through `exchange` (gpu/worker/tp.py
    StepBroadcast.kv_exchange), every worker rank's: the reads to start go to every rank,
    and every rank's poll comes back, combined by `RankReads`."""

    def __init__(self, local: KVConnector, exchange) -> None:
        self.local = local
        self.exchange = exchange
        self.ranks = RankReads(local.tp_size)
        self._loaded: list[str] = []
        self._failed: list[tuple[str, str]] = []
        self._late: list[str] = []

    def start_reads(self, reads) -> None:
        reads = tuple(reads)
        for read in reads:
            self.ranks.started(read)
            self.local.start(read)
        self._collect(reads)

    def start(self, read: KVRead) -> None:
        self.start_reads((read,))

    def _collect(self, reads) -> None:
        for rank, polled in enumerate(self.exchange(reads, self.local.poll)):
            self.ranks.add(rank, polled)
        loaded, failed, late, notify = self.ranks.results()
        for read in notify:
            self.local.notify_read(read)
        self._loaded += loaded
        self._failed += failed
        self._late += late

    def poll(self):
        self._collect(())
        out = tuple(self._loaded), tuple(self._failed), tuple(self._late)
        self._loaded, self._failed, self._late = [], [], []
        return out

    @property
    def reading(self) -> bool:
        return self.ranks.reading or bool(self._loaded or self._failed)
