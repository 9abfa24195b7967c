"""A stand-in for NIXL's transfer agent in the KV connector's tests (tests/gpu/
test_kv_connector_late.py, test_kv_connector_tp.py): handles whose state the test sets."""
from __future__ import annotations

from gpu.kv_transfer.nixl import TransferFailed


class FakeNixl:
    """Handles whose state the test sets: "PROC", "DONE" or an error."""

    def __init__(self) -> None:
        self.state: dict[object, str] = {}
        self.removed: list[str] = []

    def done(self, handle) -> bool:
        state = self.state[handle]
        if state == "PROC":
            return False
        if state != "DONE":
            raise TransferFailed(f"the KV read failed ({state})")
        return True

    def remove_remote(self, name: str) -> None:
        self.removed.append(name)
