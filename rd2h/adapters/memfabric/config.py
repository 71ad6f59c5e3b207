"""What binds a process's MemFabric engine: role, device, host, store and transfer type.

Pure stdlib (the address checks are the domain's, ``rd2h.domain.wire.addresses``), so it
never imports the library.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal, get_args

from rd2h.domain.wire.addresses import (
    TRANSFER_TYPE_NAMES,
    TransferTypeName,
    parse_host_port,
    parse_ipv4,
    parse_store_url,
)

__all__ = [
    "ROLES", "TRANSFER_TYPES", "MemFabricConfig", "RoleName", "TransferTypeName",
    "parse_host_port", "parse_ipv4", "parse_store_url",
]

TRANSFER_TYPES: dict[str, int] = {
    "SDMA": 1,
    "HOST_RDMA": 2,
    "DEVICE_RDMA": 8,
    "DEVICE_URMA": 64,
    "DEVICE_UBOE": 128,
}
"""The library's ``TransDataOpType`` values, by name (memfabric-hybrid 1.3.0)."""

RoleName = Literal["Prefill", "Decode"]
ROLES: tuple[str, ...] = get_args(RoleName)
"""The only role strings the library's ``initialize`` accepts."""

assert set(TRANSFER_TYPES) == set(TRANSFER_TYPE_NAMES)


@dataclass(frozen=True)
class MemFabricConfig:
    """One process's MemFabric engine. Two configurations are the same engine only if
    every field is equal; the process refuses a second, different one.

    ``store_url`` is the config store every endpoint of a deployment shares; ``host`` is
    this endpoint's IPv4 address as peers reach it (its session id is
    ``"<host>:<rpc port>"``); ``nic`` is passed through to the library (RDMA NIC, or empty).
    """

    store_url: str
    role: RoleName
    device_id: int = 0
    host: str = "127.0.0.1"
    transfer_type: TransferTypeName = "SDMA"
    store_server_role: RoleName = "Decode"
    nic: str = ""

    def __post_init__(self) -> None:
        parse_store_url(self.store_url)
        if self.role not in ROLES:
            raise ValueError(f"MemFabric role must be one of {list(ROLES)}, got {self.role!r}")
        if self.store_server_role not in ROLES:
            raise ValueError(
                f"MemFabric store_server_role must be one of {list(ROLES)}, "
                f"got {self.store_server_role!r}"
            )
        device = self.device_id
        if not isinstance(device, int) or isinstance(device, bool) or device < 0:
            raise ValueError(f"MemFabric device_id must be an integer >= 0, got {device!r}")
        parse_ipv4(self.host, "MemFabric host")
        if self.transfer_type not in TRANSFER_TYPES:
            raise ValueError(
                f"MemFabric transfer_type must be one of {list(TRANSFER_TYPES)}, "
                f"got {self.transfer_type!r}"
            )
        if not isinstance(self.nic, str):
            raise ValueError(f"MemFabric nic must be a string, got {self.nic!r}")

    def differences(self, other: MemFabricConfig) -> list[str]:
        """``"field: mine -> theirs"`` for every field that differs."""
        return [
            f"{f.name}: {getattr(self, f.name)!r} -> {getattr(other, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
