"""What binds a process's MemFabric engine: role, device, host, store and transfer type.

Pure stdlib, so settings can validate MemFabric fields without importing the library.
The library wants numeric IPv4 addresses (it parses them with ``inet_pton``), so host
names are refused here with a clear message instead of failing inside ``initialize``.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, fields
from typing import Literal, get_args

TransferTypeName = Literal["SDMA", "HOST_RDMA", "DEVICE_RDMA", "DEVICE_URMA", "DEVICE_UBOE"]
"""Names of ``memfabric_hybrid.TransDataOpType`` members (the data path between devices)."""

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

assert set(TRANSFER_TYPES) == set(get_args(TransferTypeName))


def parse_ipv4(text: str, what: str) -> str:
    """Return ``text`` if it is a dotted IPv4 address, else raise ``ValueError``."""
    try:
        ipaddress.IPv4Address(text)
    except (ipaddress.AddressValueError, TypeError, ValueError):
        raise ValueError(
            f"{what} must be a numeric IPv4 address (MemFabric does not resolve host "
            f"names), got {text!r}"
        ) from None
    return text


def parse_host_port(text: str, what: str, *, allow_zero_port: bool = False) -> tuple[str, int]:
    """Split ``"<IPv4>:<port>"``; raise ``ValueError`` naming ``what`` when malformed."""
    host, sep, port = str(text).rpartition(":")
    low = 0 if allow_zero_port else 1
    if not sep or not port.isdigit() or not low <= int(port) <= 65535:
        raise ValueError(f"{what} must look like '<IPv4>:<port>', got {text!r}")
    return parse_ipv4(host, what), int(port)


def parse_store_url(url: str) -> tuple[str, int]:
    """Check a config-store URL ``tcp://<IPv4>:<port>`` and return (address, port)."""
    if not isinstance(url, str) or not url.startswith("tcp://"):
        raise ValueError(f"MemFabric store URL must look like 'tcp://<IPv4>:<port>', got {url!r}")
    return parse_host_port(url[len("tcp://") :], "MemFabric store URL")


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
