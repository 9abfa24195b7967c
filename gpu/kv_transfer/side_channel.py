"""The KV connector's side channel (issue 36; stages/kv_transfer.py has the protocol
around it), torch-free: a TCP listener of the prefill instance's engine at
`remote_host`:`remote_port`, one JSON line in and one out per connection.
`{"op": "layout", "rank": R}` answers the engine's id, its tensor-parallel size and TP
rank R's KV cache NIXL layout (that rank's agent metadata and tensors' addresses:
gpu/kv_transfer/nixl.py `Layout`; rank 0 when "rank" is absent), which the decode side's rank R
reads before its first transfer from that engine: one side channel per engine, every
rank's layout behind it (as vLLM's handshake listener serves each TP rank's metadata on
one port). A rank the engine does not have answers the id and the size without a layout.
`{"op": "free", "request_id": ID}` frees a held request at once (a decode side that
refused it)."""
from __future__ import annotations

import base64
import json
import socket

SIDE_CHANNEL_TIMEOUT_S = 5.0          # a side-channel exchange that takes longer fails


def layout_message(engine_id: str, layout, tp_size: int = 1, rank: int = 0) -> bytes:
    """The answer to {"op": "layout", "rank": rank}: the engine's id and TP size, and that
    rank's cache's Layout, as JSON."""
    return json.dumps({
        "engine_id": engine_id, "tp_size": tp_size, "rank": rank,
        "agent_metadata": base64.b64encode(layout.agent_metadata).decode(),
        "bases": [list(b) for b in layout.bases], "block_bytes": list(layout.block_bytes),
        "num_blocks": layout.num_blocks, "device": layout.device,
        "device_id": layout.device_id}).encode() + b"\n"


def _exchange(host: str, port: int, message: dict, timeout: float) -> dict:
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(json.dumps(message).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            got = s.recv(1 << 16)
            if not got:
                break
            data += got
    if not data:
        raise ConnectionError("the side channel closed without an answer")
    return json.loads(data)


def no_rank_message(engine_id: str, tp_size: int) -> bytes:
    """The answer to a layout asked of a TP rank the engine does not have."""
    return json.dumps({"engine_id": engine_id, "tp_size": tp_size}).encode() + b"\n"


def fetch_layout(host: str, port: int, rank: int = 0,
                 timeout: float = SIDE_CHANNEL_TIMEOUT_S) -> dict:
    """The remote engine's {"op": "layout"} answer for TP rank `rank` (blocking: the runner
    thread calls it)."""
    return _exchange(host, port, {"op": "layout", "rank": rank}, timeout)


def send_free(host: str, port: int, request_id: str,
              timeout: float = SIDE_CHANNEL_TIMEOUT_S) -> None:
    """Tell a prefill instance to free a held request now (blocking)."""
    _exchange(host, port, {"op": "free", "request_id": request_id}, timeout)
