"""The composition root: the one module that knows the concrete adapters and builds
rd2h's objects from ``Rd2hSettings``. Every entrypoint comes through here: the vLLM
connector (``build_scheduler_role`` / ``build_prefill_worker`` /
``build_decode_worker``), the demo's rank processes and the probe's endpoints
(``build_container``), the proxy (``serve_proxy``) and the host set-up the harness
needs (network namespaces, cross-memory read permission, a MemFabric store).

Only the selected transport is constructed (``providers.Selector``), so a CPU
machine never imports an Ascend library. Tests override providers
(``with container.transport.override(fake): ...``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from typing import Any

from dependency_injector import containers, providers

from rd2h.adapters.logging import configure_logging, make_logger
from rd2h.adapters.msgpack import AuthenticatedCodec, MsgpackCodec
from rd2h.adapters.zmq import (
    CurveClientKeys,
    CurveServerKeys,
    ZmqControlClients,
    ZmqControlServer,
)
from rd2h.app.clock import MonotonicClock
from rd2h.app.connector.decode_scheduler import DecodeScheduler
from rd2h.app.connector.decode_worker import DecodeWorker
from rd2h.app.connector.facts import EngineFacts
from rd2h.app.connector.prefill_scheduler import PrefillScheduler
from rd2h.app.connector.prefill_worker import PrefillWorker
from rd2h.app.connector.roles import ConnectorRole
from rd2h.app.decode import DecodeReceiver
from rd2h.app.prefill import PrefillSender
from rd2h.app.settings import Rd2hOptions, Rd2hSettings
from rd2h.domain.chunks import discover_cache_groups, layer_index
from rd2h.domain.errors import Rd2hError
from rd2h.domain.layout import SourceLayout
from rd2h.domain.topology import plan_ports
from rd2h.ports.destinations import DecodeDestinations
from rd2h.ports.runtime import TpGroupExchange

# ====================================================================== providers


def _cma(threads: int) -> Any:
    from rd2h.adapters.cma import CmaTransferEngine

    return CmaTransferEngine(threads=threads)


def _inproc() -> Any:
    from rd2h.adapters.inproc import InprocTransferEngine

    return InprocTransferEngine()


def _mooncake(host: str, protocol: str, device: str, env: dict[str, str]) -> Any:
    from rd2h.adapters.mooncake import MooncakeTransferEngine

    return MooncakeTransferEngine(host=host, protocol=protocol, device_name=device, env=env)


def _memfabric(host: str, role: str, store_url: str, transfer_type: str, device_id: int | None,
               local_rank: int, nic: str, library: Any) -> Any:
    from rd2h.adapters.memfabric import MemFabricConfig, MemFabricTransferEngine

    config = MemFabricConfig(
        store_url=store_url, role="Prefill" if role == "prefill" else "Decode",
        device_id=local_rank if device_id is None else device_id, host=host,
        transfer_type=transfer_type, nic=nic,  # type: ignore[arg-type]
    )
    return MemFabricTransferEngine(config, library=library)


def _codec(max_frame_bytes: int, max_objects: int, auth_secret: Any = None,
           max_connections: int = 1024) -> Any:
    """The wire codec; signing when a shared secret is configured."""
    codec = MsgpackCodec(max_frame_bytes=max_frame_bytes, max_objects=max_objects)
    if auth_secret is None:
        return codec
    return AuthenticatedCodec(codec, auth_secret.get_secret_value().encode(),
                              max_connections=max_connections)


def _server_keys(secret: Any, allowed: Sequence[str]) -> Any:
    """Decode's CURVE keys, or None (plain ZeroMQ)."""
    if secret is None:
        return None
    return CurveServerKeys(secret.get_secret_value(), tuple(allowed))


def _client_keys(secret: Any, server_key: str | None) -> Any:
    """Prefill's CURVE keys, or None (plain ZeroMQ)."""
    if secret is None or server_key is None:
        return None
    return CurveClientKeys(secret.get_secret_value(), server_key)


def _logger(role: str, rank: int, level: str) -> Any:
    configure_logging(level)
    return make_logger(role, rank)


def _timeline(directory: str | None) -> Any:
    from rd2h.adapters.logging.timeline import timeline
    return timeline(directory)


def _device_events(kind: str) -> Any:
    from rd2h.adapters.torch.events import CpuDeviceEvents, NpuDeviceEvents

    if kind == "auto":
        kind = "npu" if importlib.util.find_spec("torch_npu") is not None else "cpu"
    return NpuDeviceEvents() if kind == "npu" else CpuDeviceEvents()


def _rank_port(kv_port: int, global_dp_rank: int, tp_size: int, tp_rank: int) -> int:
    return plan_ports(kv_port, global_dp_rank, tp_size).rank_port(tp_rank)


def _metaserver(timeout_s: float, retries: int, retry_s: float, log: Any) -> Any:
    from rd2h.adapters.http import metaserver

    return metaserver.MetaserverClient(timeout_s=timeout_s, retries=retries,
                                       retry_delay_s=retry_s, log=log)


def _exchange(rank: int, world_size: int, timeout_s: float, group: Any = None,
              init_method: str | None = None) -> Any:
    """The Decode TP group's all-gather: gloo over an existing group (vLLM's TP CPU
    group) or a new one (``init_method``); a group of one needs no collective."""
    from rd2h.adapters.torch.exchange import InMemoryExchangeGroup, TorchDistExchange

    if group is None and init_method is None:
        if world_size != 1:
            raise Rd2hError(f"a Decode TP group of {world_size} ranks needs a process group")
        return InMemoryExchangeGroup(1).member(0)
    return TorchDistExchange(rank=rank, world_size=world_size, group=group,
                             init_method=init_method, timeout_s=timeout_s)


class Container(containers.DeclarativeContainer):
    config = providers.Configuration(strict=True)
    deadlines = config.deadlines

    clock = providers.Singleton(MonotonicClock)
    limits = config.limits
    codec = providers.Singleton(_codec, config.max_frame_bytes, limits.max_frame_objects,
                                config.auth_secret, limits.max_peers)
    # A plain codec with the same limits, for wrappers that only look at frames (a
    # signing codec would count a second look as a replay).
    peek_codec = providers.Singleton(_codec, config.max_frame_bytes, limits.max_frame_objects)
    logger = providers.Factory(_logger, role=config.role, rank=config.tp_rank,
                               level=config.log_level)
    device_events = providers.Singleton(_device_events, config.device_events)
    timeline = providers.Singleton(_timeline, config.timeline_dir)

    # None: import memfabric_hybrid when the engine is built; tests override with a fake.
    memfabric_library = providers.Object(None)
    transport = providers.Selector(
        config.transport,
        cma=providers.Singleton(_cma, config.cma_threads),
        inproc=providers.Singleton(_inproc),
        memfabric=providers.Singleton(
            _memfabric, config.host, config.role, config.memfabric_store_url,
            config.memfabric_transfer_type, config.memfabric_device_id, config.local_rank,
            config.memfabric_nic, memfabric_library,
        ),
        mooncake=providers.Singleton(
            _mooncake, config.host, config.mooncake_protocol, config.mooncake_device,
            config.mooncake_env,
        ),
    )

    control_server = providers.Factory(
        ZmqControlServer, host=config.host,
        port=providers.Callable(_rank_port, config.kv_port, config.global_dp_rank,
                                config.tp_size, config.tp_rank),
        # ZeroMQ's own cap leaves room for a signature envelope on a full-size frame.
        max_frame_bytes=providers.Callable(lambda n: n + 4096, config.max_frame_bytes),
        heartbeat_ivl_s=deadlines.heartbeat_ivl_s,
        heartbeat_timeout_s=deadlines.heartbeat_timeout_s, recv_hwm=limits.recv_hwm,
        curve=providers.Callable(_server_keys, config.curve_secret_key,
                                 config.curve_allowed_keys),
    )
    control_clients = providers.Factory(
        ZmqControlClients, heartbeat_ivl_s=deadlines.heartbeat_ivl_s,
        heartbeat_timeout_s=deadlines.heartbeat_timeout_s, recv_hwm=limits.recv_hwm,
        curve=providers.Callable(_client_keys, config.curve_secret_key,
                                 config.curve_server_key),
    )
    tp_exchange = providers.Factory(_exchange, config.tp_rank, config.tp_size,
                                    deadlines.tp_exchange_s)
    metaserver = providers.Singleton(
        _metaserver, timeout_s=config.metaserver_timeout_s, retries=config.metaserver_retries,
        retry_s=config.metaserver_retry_interval_s, log=logger,
    )

    prefill_sender = providers.Factory(
        PrefillSender, clients_factory=control_clients.provider, codec=codec, clock=clock,
        log=logger, meta_ack_timeout_s=deadlines.meta_ack_s,
        layer_ack_timeout_s=deadlines.layer_ack_s, event_timeout_s=deadlines.device_event_s,
        idle_link_s=deadlines.idle_link_s, start_timeout_s=deadlines.start_s,
        stop_timeout_s=deadlines.stop_s,
    )
    decode_receiver = providers.Factory(
        DecodeReceiver, server_factory=control_server.provider, codec=codec,
        transfer=transport, d_rank=config.tp_rank, d_tp=config.tp_size, clock=clock,
        log=logger, request_timeout_s=deadlines.request_s, start_timeout_s=deadlines.start_s,
        stop_timeout_s=deadlines.stop_s, main_shared=providers.Callable(
            lambda d: d == "sparse_kv_pool", config.destinations),
        max_peers=limits.max_peers, max_orphans_per_peer=limits.max_orphans_per_peer,
        max_orphans=limits.max_orphans, timeline=timeline,
    )
    prefill_scheduler = providers.Factory(PrefillScheduler, p_tp=config.tp_size, log=logger,
                                          timeline=timeline)
    prefill_worker = providers.Factory(
        PrefillWorker, events=device_events, p_rank=config.tp_rank, p_tp=config.tp_size,
        clock=clock, log=logger, buffer_reuse=config.buffer_reuse,
        stop_timeout_s=deadlines.stop_s, timeline=timeline,
    )


def build_container(settings: Rd2hSettings) -> Container:
    container = Container()
    container.config.from_dict(settings.model_dump())
    return container


# ====================================================================== the vLLM connector


def build_scheduler_role(options: Rd2hOptions, facts: EngineFacts) -> ConnectorRole:
    settings = facts.settings(options)  # validates ports up front
    groups = discover_cache_groups(facts.group_layer_names)
    container = build_container(settings)
    if facts.side == "prefill":
        return container.prefill_scheduler(
            block_size=facts.block_size, main_group=groups.main, indexer_group=groups.indexer,
            log=container.logger(role="prefill-scheduler"),
        )
    log = container.logger(role="decode-scheduler")
    return DecodeScheduler(
        metaserver=container.metaserver(log=log), host=options.host,
        base_port=settings.base_port, tp_size=facts.tp_size,
        engine_id=options.engine_id or facts.engine_id, log=log, main_group=groups.main,
        indexer_group=groups.indexer, stop_timeout_s=options.deadlines.stop_s,
        timeline=container.timeline(),
    )


def build_prefill_worker(
    options: Rd2hOptions,
    facts: EngineFacts,
    layouts: Mapping[str, SourceLayout],
    regions: Sequence[tuple[int, int]],
    *,
    memfabric_library: Any = None,
) -> PrefillWorker:
    """Register the source caches with the transport and start the sender."""
    if not layouts:
        raise Rd2hError("no KV cache layers to expose")
    container = build_container(facts.settings(options))
    if memfabric_library is not None:
        container.memfabric_library.override(memfabric_library)
    transport = container.transport()
    for addr, size in regions:
        transport.register_memory(addr, size)
    by_idx = {layer_index(name): lay for name, lay in layouts.items()}
    worker = container.prefill_worker(  # reuse waits: the sender's gate budget
        sender=container.prefill_sender(p_session=transport.session_id, layers=by_idx,
                                        compat=facts.compat),
        layer_names={i: lay.layer_name for i, lay in by_idx.items()}, transport=transport,
    )
    worker.start()
    return worker


def build_decode_worker(
    options: Rd2hOptions,
    facts: EngineFacts,
    destinations: DecodeDestinations,
    *,
    tp_group: Any = None,
    exchange: TpGroupExchange | None = None,
    memfabric_library: Any = None,
) -> DecodeWorker:
    """Register destinations, bind this rank's control socket and start receiving.

    Every destination region (for the Ascend pool: the host addresses the transfer engine
    sees) is registered with the transport before the receiver can be told to read.
    ``tp_group``: the Decode TP ranks' CPU process group (vLLM's), when there are several;
    ``exchange``: an all-gather to use instead (tests: threads standing in for ranks)."""
    wanted = "shared_pool" if options.main_shared else "rank_local"
    if destinations.main_sharing != wanted:
        raise Rd2hError(
            f"destinations hold main KV as {destinations.main_sharing!r} but the "
            f"connector is configured for {wanted!r}"
        )
    container = build_container(facts.settings(options))
    if memfabric_library is not None:
        container.memfabric_library.override(memfabric_library)
    transport = container.transport()
    for addr, size in destinations.regions():
        transport.register_memory(addr, size)
    worker = DecodeWorker(
        receiver=container.decode_receiver(destinations=destinations.layouts(),
                                           compat=facts.compat),
        exchange=exchange or container.tp_exchange(group=tp_group if facts.tp_size > 1 else None),
        log=container.logger(), exchange_timeout_s=options.deadlines.tp_exchange_s,
        stop_timeout_s=options.deadlines.stop_s,
        report_invalid_blocks=len(facts.group_layer_names) <= 1,
        timeline=container.timeline(), idle_wait_s=options.idle_wait_ms / 1e3,
    )
    worker.start()
    return worker


# ====================================================================== the harness's host


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
    from rd2h.adapters.http.proxy import ProxyConfig

    return ProxyConfig(**fields)


def serve_proxy(config: Any, host: str, port: int, log_level: str,
                timeline_dir: str | None = None) -> None:
    """Run ``rd2h proxy`` until interrupted (stamps: ``timeline_dir`` or the env's)."""
    from rd2h.adapters.http.proxy import create_app
    from rd2h.adapters.http.server import serve

    log = _logger("proxy", 0, log_level)
    log.info("proxy starting", listen=f"{host}:{port}", prefill=config.prefill,
             decode=config.decode, metaserver=config.metaserver_url)
    serve(create_app(config, log=log, timeline=_timeline(timeline_dir)), host, port,
          log_level=log_level,
          keep_alive_s=config.client_keepalive_s)


def curve_keypair() -> tuple[str, str]:
    """A new ZeroMQ CURVE key pair ``(public, secret)`` as Z85 text (``rd2h keys``)."""
    from rd2h.adapters.zmq import generate_keypair

    return generate_keypair()
