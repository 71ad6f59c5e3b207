"""Checks of the addresses a deployment configures (pure stdlib).

MemFabric wants numeric IPv4 addresses (the library parses them with
``inet_pton``) and a config store at ``tcp://<IPv4>:<port>``; settings refuse
anything else up front with a message naming the field, instead of failing
inside the library. The data path names are the library's ``TransDataOpType``
members (their numeric values live in the MemFabric adapter).
"""

from __future__ import annotations

import ipaddress
from typing import Literal, get_args

TransferTypeName = Literal["SDMA", "HOST_RDMA", "DEVICE_RDMA", "DEVICE_URMA", "DEVICE_UBOE"]
TRANSFER_TYPE_NAMES: tuple[str, ...] = get_args(TransferTypeName)


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
