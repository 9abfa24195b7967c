"""The KV connector's torch-free half (issue 36): `--kv-transfer-config`, vLLM's
`kv_transfer_params` request and response fields, and the side channel the two
instances of a disaggregated (P/D) deployment talk over.

The protocol is vLLM's NixlConnector's, field for field:

- the proxy sends the prefill instance the request with `max_tokens: 1` and
  `kv_transfer_params: {"do_remote_decode": true}`; it runs the prefill, answers, and keeps
  the request's prompt blocks (`PrefillHolds` in the scheduler) until the decode side has
  read them or `VLLM_NIXL_ABORT_REQUEST_TIMEOUT` seconds have passed. Its reply carries
  `kv_transfer_params`: `do_remote_prefill` true, `do_remote_decode` false,
  `remote_engine_id`, `remote_request_id`, `remote_block_ids`, `remote_host`,
  `remote_port`, `tp_size` (`response_params`);
- the proxy sends the decode instance the request again with those params: it allocates
  blocks, reads the remote ones through NIXL, and decodes with the prompt counted as
  cached (`RemotePrefill`).

The side channel: a TCP listener of the prefill instance's engine at `remote_host`:
`remote_port` (vLLM's `VLLM_NIXL_SIDE_CHANNEL_HOST`/`_PORT`). One JSON line in, one out,
per connection: `{"op": "layout"}` answers the engine's id and its KV cache's NIXL layout
(the agent's metadata and the tensors' addresses, gpu/kv_transfer/nixl.py `Layout`), which the
decode side reads before each transfer; `{"op": "free", "request_id": ID}` frees a held
request at once (a decode side that refused it). A finished read frees too, by the NIXL
notification the read carries (the request id); under tensor parallelism, where every rank
reads its own shard, the decode side's rank 0 sends that notification once every rank's
read has landed (gpu/kv_transfer/connector.py)."""
from __future__ import annotations

import json
import os
import uuid
from typing import Any

import attrs

from gpu.kv_transfer.side_channel import send_free

KV_CONNECTORS = ("NixlConnector",)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_BUFFER_DEVICES = ("cpu", "cuda")
ABORT_TIMEOUT_ENV = "VLLM_NIXL_ABORT_REQUEST_TIMEOUT"
ABORT_TIMEOUT_DEFAULT_S = 480.0       # vLLM's default
SIDE_CHANNEL_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
SIDE_CHANNEL_PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"
SIDE_CHANNEL_PORT_DEFAULT = 5600      # vLLM's default
PARAM = "kv_transfer_params"


@attrs.frozen
class KVTransferConfig:
    """`--kv-transfer-config` (vLLM's keys; those vLLM has that do not apply here are
    refused by name). The side channel and the hold's timeout come from vLLM's
    environment variables, read once, at construction."""
    kv_connector: str
    kv_role: str
    kv_buffer_device: str = "cpu"
    engine_id: str = attrs.field(factory=lambda: str(uuid.uuid4()))
    kv_connector_extra_config: dict = attrs.field(factory=dict)
    side_channel_host: str = attrs.field(
        factory=lambda: os.environ.get(SIDE_CHANNEL_HOST_ENV, "127.0.0.1"))
    side_channel_port: int = attrs.field(
        factory=lambda: int(os.environ.get(SIDE_CHANNEL_PORT_ENV, SIDE_CHANNEL_PORT_DEFAULT)))
    abort_timeout_s: float = attrs.field(
        factory=lambda: float(os.environ.get(ABORT_TIMEOUT_ENV, ABORT_TIMEOUT_DEFAULT_S)))

    def flag(self) -> str:
        """The --kv-transfer-config JSON that parses back to this config (the engine id
        included: a tensor-parallel worker rank gets rank 0's)."""
        return json.dumps({"kv_connector": self.kv_connector, "kv_role": self.kv_role,
                           "kv_buffer_device": self.kv_buffer_device,
                           "engine_id": self.engine_id,
                           "kv_connector_extra_config": self.kv_connector_extra_config})

    @property
    def producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, value) -> KVTransferConfig | None:
        """From the flag's JSON text or a dict (None stays None), with a clear error for
        an unknown key, connector, role or buffer device."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        flag = "--kv-transfer-config"
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"{flag} is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"{flag} must be a JSON object")
        known = ("kv_connector", "kv_role", "kv_buffer_device", "engine_id",
                 "kv_connector_extra_config")
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"{flag}: unknown key {unknown[0]!r} (known: {', '.join(known)})")
        connector = value.get("kv_connector")
        if connector not in KV_CONNECTORS:
            raise ValueError(f"{flag}: kv_connector {connector!r} is not served (supported: "
                             f"{', '.join(KV_CONNECTORS)})")
        role = value.get("kv_role")
        if role not in KV_ROLES:
            raise ValueError(f"{flag}: kv_role {role!r} is not one of {', '.join(KV_ROLES)}")
        device = value.get("kv_buffer_device", "cpu")
        if device not in KV_BUFFER_DEVICES:
            raise ValueError(f"{flag}: kv_buffer_device {device!r} is not one of "
                             f"{', '.join(KV_BUFFER_DEVICES)}")
        extra = value.get("kv_connector_extra_config") or {}
        if not isinstance(extra, dict):
            raise ValueError(f"{flag}: kv_connector_extra_config must be a JSON object")
        kwargs = {"engine_id": str(value["engine_id"])} if value.get("engine_id") else {}
        try:
            return cls(connector, role, device, kv_connector_extra_config=extra, **kwargs)
        except ValueError as exc:     # the environment variables
            raise ValueError(f"{flag}: {ABORT_TIMEOUT_ENV} and {SIDE_CHANNEL_PORT_ENV} must be "
                             f"numbers ({exc})") from None


# -- kv_transfer_params on a request ---------------------------------------------------------
class KVParamsError(ValueError):
    """A request's kv_transfer_params that cannot be served (render answers 400)."""

    def __init__(self, message: str, param: str = PARAM) -> None:
        super().__init__(message)
        self.message, self.param = message, param


class IncompleteRemotePrefill(KVParamsError):
    """do_remote_prefill without the prefill instance's fields (or with bad ones): vLLM's
    NixlConnector logs it and prefills locally."""


@attrs.frozen
class RemotePrefill:
    """The decode side's request: the prompt's KV is in these blocks of that engine's cache."""
    engine_id: str
    request_id: str          # the prefill side's id for it (what frees its blocks)
    block_ids: tuple[int, ...]
    host: str
    port: int


@attrs.frozen
class KVTransfer:
    """What a request asks of the KV connector: hold its blocks for a decode instance
    (`remote_decode`, the prefill side), or start from a remote prefill's blocks."""
    remote_decode: bool = False
    remote_prefill: RemotePrefill | None = None


def request_params(params: Any) -> KVTransfer | None:
    """A request's kv_transfer_params as the connector reads them; None when they ask for
    no transfer (absent, or both flags false: vLLM's shape of a plain request)."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise KVParamsError(f"'{PARAM}' must be an object.")
    decode, prefill = params.get("do_remote_decode"), params.get("do_remote_prefill")
    for name, v in (("do_remote_decode", decode), ("do_remote_prefill", prefill)):
        if v is not None and type(v) is not bool:
            raise KVParamsError(f"'{PARAM}.{name}' must be a boolean.", f"{PARAM}.{name}")
    if decode and prefill:
        raise KVParamsError(f"'{PARAM}': do_remote_decode and do_remote_prefill are not both "
                            "true on one request.")
    if not prefill:
        return KVTransfer(remote_decode=True) if decode else None

    def field(name: str, kind, check=lambda v: True, what: str = ""):
        v = params.get(name)
        if type(v) is not kind or not check(v):
            raise IncompleteRemotePrefill(
                f"'{PARAM}.{name}' must be {what} (do_remote_prefill needs the prefill "
                "instance's kv_transfer_params)", f"{PARAM}.{name}")
        return v

    blocks = params.get("remote_block_ids")
    if (type(blocks) is not list
            or not all(type(b) is int and b >= 0 for b in blocks)):
        raise IncompleteRemotePrefill(f"'{PARAM}.remote_block_ids' must be an array of "
                                      "non-negative integers", f"{PARAM}.remote_block_ids")
    return KVTransfer(remote_prefill=RemotePrefill(
        field("remote_engine_id", str, bool, "a non-empty string"),
        field("remote_request_id", str, bool, "a non-empty string"),
        tuple(blocks),
        field("remote_host", str, bool, "a host name"),
        field("remote_port", int, lambda p: 0 < p < 65536, "a port number")))


def response_params(config: KVTransferConfig, request_id: str, block_ids, port: int,
                    tp_size: int = 1) -> dict:
    """The prefill side's reply's kv_transfer_params (vLLM's NixlConnector's keys; tp_size:
    the prefill engine's --tensor-parallel-size, as vLLM's)."""
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": config.engine_id, "remote_request_id": request_id,
            "remote_block_ids": list(block_ids), "remote_host": config.side_channel_host,
            "remote_port": port, "tp_size": tp_size}


def refused_remote_prefill(body: Any) -> RemotePrefill | None:
    """The remote prefill a refused request's body named, if it names one well enough to
    free (the refusal may be of the params themselves: then nothing is named)."""
    params = body.get(PARAM) if isinstance(body, dict) else None
    try:
        kv = request_params(params)
    except KVParamsError:
        return None
    return kv.remote_prefill if kv is not None else None


def notify_refused(rp: RemotePrefill) -> None:
    """A request that came with a remote prefill's params was refused here (render's or
    admit's 400/503): tell the prefill instance to free its blocks now, in a task of its
    own (the refusal is already on its way to the client); a failure is logged only (the
    prefill instance frees them at its timeout anyway)."""
    import logging

    import trio

    async def send() -> None:
        try:
            await trio.to_thread.run_sync(send_free, rp.host, rp.port, rp.request_id)
        except Exception as exc:     # noqa: BLE001 - never let it reach the trio run
            logging.getLogger("tailrace.kv").warning(
                "could not tell the prefill instance at %s:%d to free request %s: %s",
                rp.host, rp.port, rp.request_id, exc)

    trio.lowlevel.spawn_system_task(send)
