"""Separate "hosts" on one machine for the real-engine tests: one Linux network namespace
per host, each joined by a veth pair to a bridge in the test's own namespace, which
has an address on the bridge too (the router's host: the test, the proxy).

Every packet between two hosts crosses two veth pairs and the bridge, as it would
cross a switch between machines; a host's link is cut by setting its veth down inside
its namespace. Needs root and iproute2 (``ip``); creation fails with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass


class HostsUnavailable(RuntimeError):
    """Namespaces or a bridge cannot be created here (not root, no iproute2)."""


def _ip(*args: str, check: bool = True) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and proc.returncode != 0:
        raise HostsUnavailable(f"'ip {' '.join(args)}' failed: {proc.stderr.strip()}")
    return proc.stdout


@dataclass(frozen=True)
class Host:
    name: str
    namespace: str
    addr: str
    dev: str  # its end of the veth pair, inside its namespace
    outside: str  # the other end, on the bridge

    def exec_prefix(self) -> list[str]:
        """The command prefix that runs a program on this host."""
        return ["ip", "netns", "exec", self.namespace]

    def link(self, up: bool) -> None:
        """Set this host's link up or down (a cable pulled: no FIN, no RST)."""
        _ip("-n", self.namespace, "link", "set", self.dev, "up" if up else "down")

    def rx_tx_bytes(self) -> tuple[int, int]:
        """Bytes received and sent on this host's link so far."""
        (info,) = json.loads(_ip("-n", self.namespace, "-s", "-j", "link", "show", "dev",
                                 self.dev))
        stats = info["stats64"]
        return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])


@dataclass(frozen=True)
class Hosts:
    bridge: str
    router_addr: str  # the test's own namespace, on the bridge
    hosts: dict[str, Host]

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]


def create(tag: str, names: tuple[str, ...], subnet: str = "10.231.9") -> Hosts:
    """Hosts ``names`` (``<subnet>.2``, ``.3``, ...) on bridge ``rd2hbr<tag>``
    (``<subnet>.1``). Leftovers of an earlier run with the same tag are removed first."""
    if os.geteuid() != 0:
        raise HostsUnavailable("network namespaces need root")
    if shutil.which("ip") is None:
        raise HostsUnavailable("the 'ip' command (Debian package iproute2) is not installed")
    bridge = f"rd2hbr{tag}"[:15]
    hosts = {
        name: Host(name, f"rd2h-{name}-{tag}", f"{subnet}.{i + 2}", f"eth-{name}"[:15],
                   f"rd2hv{tag}{i}"[:15])
        for i, name in enumerate(names)
    }
    made = Hosts(bridge, f"{subnet}.1", hosts)
    delete(made)
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{made.router_addr}/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for h in hosts.values():
            _ip("netns", "add", h.namespace)
            _ip("link", "add", h.outside, "type", "veth", "peer", "name", h.dev,
                "netns", h.namespace)
            _ip("link", "set", h.outside, "master", bridge)
            _ip("link", "set", h.outside, "up")
            _ip("-n", h.namespace, "addr", "add", f"{h.addr}/24", "dev", h.dev)
            _ip("-n", h.namespace, "link", "set", h.dev, "up")
            _ip("-n", h.namespace, "link", "set", "lo", "up")
    except (HostsUnavailable, OSError, subprocess.SubprocessError) as exc:
        delete(made)
        raise HostsUnavailable(str(exc)) from exc
    return made


def delete(hosts: Hosts) -> None:
    """Remove the veth pairs, the namespaces and the bridge. Never raises. (A namespace
    outlives ``ip netns delete`` while a process still runs in it, and its veth pair
    with it: each pair is deleted by its outside end.)"""
    for h in hosts.hosts.values():
        subprocess.run(["ip", "link", "delete", h.outside], capture_output=True, timeout=20)
        subprocess.run(["ip", "netns", "delete", h.namespace], capture_output=True, timeout=20)
    subprocess.run(["ip", "link", "delete", hosts.bridge], capture_output=True, timeout=20)
