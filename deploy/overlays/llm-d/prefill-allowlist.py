"""Keep a sidecar proxy's Prefill allowlist equal to the Prefill pods.

llm-d's endpoint picker names a Prefill pod by its address (x-prefiller-host-port:
IP:port), and `rd2h proxy --prefiller-header` admits only the Prefill instances it
lists. Every INTERVAL seconds this resolves NAME (the headless Service that selects the
Prefill pods by label: one address per pod) and, through the proxy's admin API, adds
http://ADDRESS:PORT for each new pod ([ADDRESS] for IPv6) and removes the addresses it
added once their pod is gone. Instances it did not add (the --prefill list) are left
alone. Environment: RD2H_ALLOWLIST_NAME, RD2H_ALLOWLIST_PORT, RD2H_ALLOWLIST_INTERVAL_S,
RD2H_PROXY (the sidecar's URL), RD2H_PROXY_ADMIN_TOKEN_FILE.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import time


def instance_url(address: str, port: int) -> str:
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    return f"http://{host}:{port}"


def resolve(name: str, port: int) -> set[str]:
    infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return {instance_url(str(info[4][0]).split("%")[0], port) for info in infos}


def plan(listed: set[str], ours: set[str], pods: set[str]) -> tuple[set[str], set[str]]:
    """(URLs to add, URLs to remove): add each pod the proxy does not list; remove what
    this loop added whose pod is gone."""
    return pods - listed, (ours - pods) & listed


def main() -> int:
    import httpx

    from rd2h.app.secrets import read_secret_file

    name = os.environ.get("RD2H_ALLOWLIST_NAME", "rd2h-prefill-kv")
    port = int(os.environ.get("RD2H_ALLOWLIST_PORT", "8100"))
    interval = float(os.environ.get("RD2H_ALLOWLIST_INTERVAL_S", "5"))
    base = os.environ.get("RD2H_PROXY", "http://127.0.0.1:8000").rstrip("/")
    token = read_secret_file(os.environ["RD2H_PROXY_ADMIN_TOKEN_FILE"], "admin token")
    api = f"{base}/admin/instances"
    ours: set[str] = set()
    with httpx.Client(timeout=10, headers={"Authorization": f"Bearer {token}"}) as client:
        while True:
            try:
                pods = resolve(name, port)
            except OSError as exc:  # no Prefill pod yet, or DNS briefly down: keep all
                print(f"prefill-allowlist: {name}: {exc}", file=sys.stderr)
                pods = set(ours)
            try:
                answer = client.get(api)
                answer.raise_for_status()
                listed = {i["url"] for i in answer.json()["instances"]["prefill"]
                          if i.get("state") != "removed"}
                add, remove = plan(listed, ours, pods)
                for url in sorted(add):
                    client.post(api, json={"role": "prefill", "url": url}).raise_for_status()
                    ours.add(url)
                    print(f"prefill-allowlist: added {url}", file=sys.stderr)
                for url in sorted(remove):
                    client.post(f"{api}/remove", json={"role": "prefill", "url": url})
                    ours.discard(url)
                    print(f"prefill-allowlist: removed {url}", file=sys.stderr)
            except (httpx.HTTPError, ValueError, KeyError) as exc:  # the sidecar is starting
                print(f"prefill-allowlist: {base}: {type(exc).__name__}: {exc}",
                      file=sys.stderr)
            time.sleep(interval)


if __name__ == "__main__":
    sys.exit(main())
