"""Two Linux network namespaces joined by a veth pair: Prefill and Decode on
separate "hosts" of one machine, so control messages and data really cross a
network interface between two addresses. Needs root and iproute2 (``ip``)."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from dataclasses import dataclass

CLONE_NEWNET = 0x40000000
NETNS_DIR = "/var/run/netns"


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be created here (not root, no iproute2, no permission)."""


@dataclass(frozen=True)
class HostPair:
    """Namespace names and addresses of the Prefill and Decode "hosts"."""

    prefill_ns: str
    decode_ns: str
    prefill_addr: str
    decode_addr: str


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if proc.returncode != 0:
        raise NetnsUnavailable(f"'ip {' '.join(args)}' failed: {proc.stderr.strip()}")


def create_host_pair(tag: str, subnet: str = "10.231.7") -> HostPair:
    """Create ``rd2h-p-<tag>`` and ``rd2h-d-<tag>`` joined by a veth pair
    (``<subnet>.2`` for Prefill, ``<subnet>.1`` for Decode). Raises NetnsUnavailable."""
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root")
    if shutil.which("ip") is None:
        raise NetnsUnavailable("the 'ip' command (Debian package iproute2) is not installed")
    pair = HostPair(f"rd2h-p-{tag}", f"rd2h-d-{tag}", f"{subnet}.2", f"{subnet}.1")
    vp, vd = f"rd2hp{tag}"[:15], f"rd2hd{tag}"[:15]
    try:
        _ip("netns", "add", pair.prefill_ns)
        _ip("netns", "add", pair.decode_ns)
        _ip("link", "add", vp, "type", "veth", "peer", "name", vd)
        _ip("link", "set", vp, "netns", pair.prefill_ns)
        _ip("link", "set", vd, "netns", pair.decode_ns)
        for ns, dev, addr in ((pair.prefill_ns, vp, pair.prefill_addr),
                              (pair.decode_ns, vd, pair.decode_addr)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except (NetnsUnavailable, OSError, subprocess.SubprocessError) as exc:
        delete_host_pair(pair)
        raise NetnsUnavailable(str(exc)) from exc
    return pair


def delete_host_pair(pair: HostPair) -> None:
    """Remove both namespaces (the veth pair goes with them). Never raises."""
    for ns in (pair.prefill_ns, pair.decode_ns):
        subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=20)


def enter(namespace: str) -> None:
    """Move the calling process (all of it: call before starting threads or opening
    sockets) into ``namespace``'s network stack."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(NETNS_DIR, namespace), os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {namespace!r} failed: {os.strerror(err)}")
    finally:
        os.close(fd)
