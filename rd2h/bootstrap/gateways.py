"""The harness's gateways to the host and to the proxy: what the command line, the demo
and the probe need beyond the library's roles (cross-memory read permission, a MemFabric
config store, network namespaces, the proxy server, CURVE keys). Each imports its adapter
when called; with the composition root, the only app modules that reach adapters."""

from __future__ import annotations

from typing import Any

from rd2h.bootstrap.container import logger_for, timeline_at


def allow_reads_by(pid: int) -> bool:
    """Let process ``pid`` read this process's memory (cma under Yama ptrace scope 1)."""
    from rd2h.adapters.cma.ptrace import allow_reads_by as allow

    return allow(pid)


def start_memfabric_store(store_url: str) -> None:
    """Run a MemFabric config store in this process."""
    from rd2h.adapters.memfabric import start_config_store

    start_config_store(store_url)


def network_namespaces() -> Any:
    """Network namespaces for two-host runs on one machine (``create_host_pair``,
    ``delete_host_pair``, ``enter``, ``NetnsUnavailable``)."""
    from rd2h.adapters import netns

    return netns


def proxy_config(**fields: Any) -> Any:
    """The validated ``rd2h proxy`` configuration (``ValueError`` names a bad field)."""
    from rd2h.proxy.service import ProxyConfig

    return ProxyConfig(**fields)


def serve_proxy(config: Any, host: str, port: int, log_level: str,
                timeline_dir: str | None = None) -> None:
    """Run ``rd2h proxy`` until interrupted (stamps: ``timeline_dir`` or the env's)."""
    from rd2h.adapters.http.server import serve
    from rd2h.proxy.service import create_app

    log = logger_for("proxy", 0, log_level)
    log.info("proxy starting", listen=f"{host}:{port}", prefill=config.prefill,
             decode=config.decode, metaserver=config.metaserver_url)
    serve(create_app(config, log=log, timeline=timeline_at(timeline_dir)), host, port,
          log_level=log_level,
          keep_alive_s=config.client_keepalive_s)


def curve_keypair() -> tuple[str, str]:
    """A new ZeroMQ CURVE key pair ``(public, secret)`` as Z85 text (``rd2h keys``)."""
    from rd2h.adapters.zmq import generate_keypair

    return generate_keypair()
