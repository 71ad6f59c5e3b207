"""The composition root: the one module that knows the concrete adapters and builds
rd2h's objects from ``Rd2hSettings``. Every entrypoint comes through here: the vLLM
connector (``build_scheduler_role`` / ``build_prefill_worker`` /
``build_decode_worker``), the demo's rank processes and the probe's endpoints
(``build_container``), the proxy (``serve_proxy``) and the host set-up the harness
needs (network namespaces, cross-memory read permission, a MemFabric store).

Only the selected transport is constructed (``providers.Selector``), so a CPU
machine never imports an Ascend library. Tests build through ``bootstrap`` with
overrides (``bootstrap(settings, transport=fake)``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dependency_injector import containers, providers

from rd2h.adapters.hashing import digest_blocks
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
from rd2h.app.connector.prefill_scheduler import PrefillScheduler
from rd2h.app.connector.prefill_worker import PrefillWorker
from rd2h.app.decode import DecodeReceiver
from rd2h.app.prefill import PrefillSender
from rd2h.app.settings import Rd2hSettings
from rd2h.app.timeline import read_stamper
from rd2h.domain.errors import Rd2hError
from rd2h.domain.planning.topology import plan_ports
from rd2h.ports.codec import WireCodec
from rd2h.ports.metaserver import MetaserverPoster
from rd2h.ports.runtime import DeviceEvents, Logger, Timeline, TpGroupExchange
from rd2h.ports.transfer import TransferEngine

# ====================================================================== providers


def _cma(threads: int) -> TransferEngine:
    from rd2h.adapters.cma import CmaTransferEngine

    return CmaTransferEngine(threads=threads)


def _inproc() -> TransferEngine:
    from rd2h.adapters.inproc import InprocTransferEngine

    return InprocTransferEngine()


def _mooncake(host: str, protocol: str, device: str, env: dict[str, str]) -> TransferEngine:
    from rd2h.adapters.mooncake import MooncakeTransferEngine

    return MooncakeTransferEngine(host=host, protocol=protocol, device_name=device, env=env)


def _memfabric(host: str, role: str, store_url: str, transfer_type: str, device_id: int | None,
               local_rank: int, nic: str, library: Any) -> TransferEngine:
    from rd2h.adapters.memfabric import MemFabricConfig, MemFabricTransferEngine

    config = MemFabricConfig(
        store_url=store_url, role="Prefill" if role == "prefill" else "Decode",
        device_id=local_rank if device_id is None else device_id, host=host,
        transfer_type=transfer_type, nic=nic,  # type: ignore[arg-type]
    )
    return MemFabricTransferEngine(config, library=library)


def _codec(max_frame_bytes: int, max_objects: int, auth_secret: Any = None,
           max_connections: int = 1024) -> WireCodec:
    """The wire codec; signing when a shared secret is configured."""
    codec = MsgpackCodec(max_frame_bytes=max_frame_bytes, max_objects=max_objects)
    if auth_secret is None:
        return codec
    return AuthenticatedCodec(codec, auth_secret.get_secret_value().encode(),
                              max_connections=max_connections)


def _server_keys(secret: Any, allowed: Sequence[str]) -> CurveServerKeys | None:
    """Decode's CURVE keys, or None (plain ZeroMQ)."""
    if secret is None:
        return None
    return CurveServerKeys(secret.get_secret_value(), tuple(allowed))


def _client_keys(secret: Any, server_key: str | None) -> CurveClientKeys | None:
    """Prefill's CURVE keys, or None (plain ZeroMQ)."""
    if secret is None or server_key is None:
        return None
    return CurveClientKeys(secret.get_secret_value(), server_key)


def logger_for(role: str, rank: int, level: str) -> Logger:
    configure_logging(level)
    return make_logger(role, rank)


def timeline_at(directory: str | None) -> Timeline:
    from rd2h.adapters.logging.timeline import timeline
    return timeline(directory)


def _device_events(kind: str) -> DeviceEvents:
    from rd2h.adapters.torch.events import CpuDeviceEvents, NpuDeviceEvents

    if kind == "auto":
        kind = "npu" if importlib.util.find_spec("torch_npu") is not None else "cpu"
    return NpuDeviceEvents() if kind == "npu" else CpuDeviceEvents()


def _rank_port(kv_port: int, global_dp_rank: int, tp_size: int, tp_rank: int) -> int:
    return plan_ports(kv_port, global_dp_rank, tp_size).rank_port(tp_rank)


def _metaserver(timeout_s: float, retries: int, retry_s: float, log: Logger
                ) -> MetaserverPoster:
    from rd2h.adapters.http import metaserver

    return metaserver.MetaserverClient(timeout_s=timeout_s, retries=retries,
                                       retry_delay_s=retry_s, log=log)


def _exchange(rank: int, world_size: int, timeout_s: float, group: Any = None,
              init_method: str | None = None) -> TpGroupExchange:
    """The Decode TP group's all-gather: gloo over an existing group (vLLM's TP CPU
    group) or a new one (``init_method``); a group of one needs no collective."""
    from rd2h.adapters.torch.exchange import SoloExchange, TorchDistExchange

    if group is None and init_method is None:
        if world_size != 1:
            raise Rd2hError(f"a Decode TP group of {world_size} ranks needs a process group")
        return SoloExchange()
    return TorchDistExchange(rank=rank, world_size=world_size, group=group,
                             init_method=init_method, timeout_s=timeout_s)


class Container(containers.DeclarativeContainer):
    config = providers.Configuration(strict=True)
    deadlines = config.deadlines

    clock = providers.Singleton(MonotonicClock)
    digest = providers.Object(digest_blocks)  # verify_kv's block digests (host memory)
    limits = config.limits
    codec = providers.Singleton(_codec, config.max_frame_bytes, limits.max_frame_objects,
                                config.auth_secret, limits.max_peers)
    # A plain codec with the same limits, for wrappers that only look at frames (a
    # signing codec would count a second look as a replay).
    peek_codec = providers.Singleton(_codec, config.max_frame_bytes, limits.max_frame_objects)
    logger = providers.Factory(logger_for, role=config.role, rank=config.tp_rank,
                               level=config.log_level)
    device_events = providers.Singleton(_device_events, config.device_events)
    timeline = providers.Singleton(timeline_at, config.timeline_dir)

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
        max_queued_bytes_per_peer=limits.max_queued_bytes_per_peer,
        max_queued_bytes=limits.max_queued_bytes,
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
        stop_timeout_s=deadlines.stop_s, max_layers_per_frame=limits.max_layers_per_frame,
    )
    decode_receiver = providers.Factory(
        DecodeReceiver, server_factory=control_server.provider, codec=codec,
        transfer=transport, d_rank=config.tp_rank, d_tp=config.tp_size, clock=clock,
        log=logger, request_timeout_s=deadlines.request_s, start_timeout_s=deadlines.start_s,
        stop_timeout_s=deadlines.stop_s, main_shared=providers.Callable(
            lambda d: d == "sparse_kv_pool", config.destinations),
        max_peers=limits.max_peers, max_orphans_per_peer=limits.max_orphans_per_peer,
        max_orphans=limits.max_orphans, timeline=timeline,
        on_read=providers.Callable(read_stamper, timeline),
        hold_margin_s=deadlines.hold_margin_s, digest=digest,
        park_s=deadlines.admission_wait_s,
        max_parked_bytes_per_peer=limits.max_parked_bytes_per_peer,
        max_parked_bytes=limits.max_parked_bytes,
    )
    prefill_scheduler = providers.Factory(PrefillScheduler, p_tp=config.tp_size, log=logger,
                                          timeline=timeline)
    prefill_worker = providers.Factory(
        PrefillWorker, events=device_events, p_rank=config.tp_rank, p_tp=config.tp_size,
        clock=clock, log=logger, buffer_reuse=config.buffer_reuse,
        stop_timeout_s=deadlines.stop_s, timeline=timeline,
        min_announce_bytes=limits.min_announce_bytes,
    )
    decode_scheduler = providers.Factory(
        DecodeScheduler, metaserver=metaserver, host=config.host, tp_size=config.tp_size,
        log=logger, stop_timeout_s=deadlines.stop_s, timeline=timeline,
    )
    decode_worker = providers.Factory(
        DecodeWorker, receiver=decode_receiver, log=logger,
        exchange_timeout_s=deadlines.tp_exchange_s, stop_timeout_s=deadlines.stop_s,
        timeline=timeline, idle_wait_s=providers.Callable(lambda ms: ms / 1e3,
                                                          config.idle_wait_ms),
    )


def build_container(settings: Rd2hSettings) -> Container:
    container = Container()
    container.config.from_dict(settings.model_dump())
    return container


@dataclass(frozen=True)
class InPlaceOf:
    """An override built in the provider's place from the provider's own arguments:
    ``bootstrap(s, metaserver=InPlaceOf(RecordingMetaserver))`` calls
    ``RecordingMetaserver(timeout_s=..., retries=..., ...)`` as the real client would be
    called, so a fake sees what the settings made of the real thing."""

    build: Callable[..., Any]


def bootstrap(settings: Rd2hSettings, **overrides: Any) -> Container:
    """The container for ``settings`` with providers replaced by objects (cosmicpython's
    bootstrap): ``bootstrap(s, clock=ManualClock(), transport=engine, control_clients=
    net.clients)``; a callable given for a ``*_factory`` style provider (``control_server``,
    ``control_clients``) is called for each instance; an ``InPlaceOf`` is built from the
    provider's own arguments. Unknown names raise ``ValueError``."""
    container = build_container(settings)
    for name, value in overrides.items():
        provider = getattr(container, name, None)
        if not isinstance(provider, providers.Provider):
            raise ValueError(f"the container has no provider {name!r}")
        if isinstance(value, InPlaceOf):
            if not isinstance(provider, (providers.Factory, providers.Singleton)):
                raise ValueError(f"{name!r} is not built from arguments: give an object")
            provider.override(type(provider)(value.build, *provider.args, **provider.kwargs))
        elif name in _MADE_PER_USE and callable(value):
            provider.override(providers.Callable(value))
        else:
            provider.override(providers.Object(value))
    return container


# Providers whose override is a factory (a new object each time it is used).
_MADE_PER_USE = frozenset({"control_server", "control_clients"})
