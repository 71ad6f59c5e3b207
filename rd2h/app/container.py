"""The composition root: builds rd2h's objects from ``Rd2hSettings``.

Only the selected transport and role are constructed (``providers.Selector``),
so a CPU machine never imports an Ascend library. Tests override providers
(``with container.transport.override(fake): ...``).
"""

from __future__ import annotations

from typing import Any

from dependency_injector import containers, providers

from rd2h.adapters.logging import configure_logging, make_logger
from rd2h.adapters.msgpack import AuthenticatedCodec, MsgpackCodec
from rd2h.adapters.torch.events import CpuDeviceEvents
from rd2h.adapters.zmq import ZmqControlClients, ZmqControlServer
from rd2h.app.clock import MonotonicClock
from rd2h.app.decode import DecodeReceiver
from rd2h.app.prefill import PrefillSender
from rd2h.app.settings import Rd2hSettings
from rd2h.domain.errors import Rd2hError
from rd2h.domain.topology import plan_ports


class TransportUnavailable(Rd2hError):
    """The configured transport is not part of this build or cannot start here."""


def _cma(threads: int) -> Any:
    from rd2h.adapters.cma import CmaTransferEngine

    return CmaTransferEngine(threads=threads)


def _inproc() -> Any:
    from rd2h.adapters.inproc import InprocTransferEngine

    return InprocTransferEngine()


def _mooncake(host: str, protocol: str, device: str, env: dict[str, str]) -> Any:
    from rd2h.adapters.mooncake import MooncakeTransferEngine

    return MooncakeTransferEngine(host=host, protocol=protocol, device_name=device, env=env)


def _memfabric(
    host: str, role: str, store_url: str, transfer_type: str, device_id: int, nic: str,
    library: Any,
) -> Any:
    from rd2h.adapters.memfabric import MemFabricConfig, MemFabricTransferEngine

    config = MemFabricConfig(
        store_url=store_url, role="Prefill" if role == "prefill" else "Decode",
        device_id=device_id, host=host, transfer_type=transfer_type, nic=nic,  # type: ignore[arg-type]
    )
    return MemFabricTransferEngine(config, library=library)


def _codec(max_frame_bytes: int, auth_secret: Any) -> Any:
    """The wire codec; signing when a shared secret is configured."""
    codec = MsgpackCodec(max_frame_bytes=max_frame_bytes)
    if auth_secret is None:
        return codec
    return AuthenticatedCodec(codec, auth_secret.get_secret_value().encode())


def _logger(role: str, rank: int, level: str) -> Any:
    configure_logging(level)
    return make_logger(role, rank)


def _rank_port(kv_port: int, global_dp_rank: int, tp_size: int, tp_rank: int) -> int:
    return plan_ports(kv_port, global_dp_rank, tp_size).rank_port(tp_rank)


class Container(containers.DeclarativeContainer):
    config = providers.Configuration(strict=True)

    clock = providers.Singleton(MonotonicClock)
    codec = providers.Singleton(_codec, config.max_frame_bytes, config.auth_secret)
    logger = providers.Singleton(_logger, config.role, config.tp_rank, config.log_level)
    device_events = providers.Singleton(CpuDeviceEvents)

    # None: import memfabric_hybrid when the engine is built; tests override with a fake.
    memfabric_library = providers.Object(None)
    transport = providers.Selector(
        config.transport,
        cma=providers.Singleton(_cma, threads=config.cma_threads),
        inproc=providers.Singleton(_inproc),
        memfabric=providers.Singleton(
            _memfabric, config.host, config.role, config.memfabric_store_url,
            config.memfabric_transfer_type, config.memfabric_device_id, config.memfabric_nic,
            memfabric_library,
        ),
        mooncake=providers.Singleton(
            _mooncake, config.host, config.mooncake_protocol, config.mooncake_device,
            config.mooncake_env,
        ),
    )

    rank_port = providers.Callable(
        _rank_port, config.kv_port, config.global_dp_rank, config.tp_size, config.tp_rank
    )
    control_server = providers.Factory(
        ZmqControlServer, host=config.host, port=rank_port,
        max_frame_bytes=config.max_frame_bytes,
        heartbeat_ivl_s=config.deadlines.heartbeat_ivl_s,
        heartbeat_timeout_s=config.deadlines.heartbeat_timeout_s,
    )
    control_clients = providers.Factory(
        ZmqControlClients,
        heartbeat_ivl_s=config.deadlines.heartbeat_ivl_s,
        heartbeat_timeout_s=config.deadlines.heartbeat_timeout_s,
    )

    prefill_sender = providers.Factory(
        PrefillSender,
        clients_factory=control_clients.provider,
        codec=codec,
        clock=clock,
        log=logger,
        meta_ack_timeout_s=config.deadlines.meta_ack_s,
        layer_ack_timeout_s=config.deadlines.layer_ack_s,
        event_timeout_s=config.deadlines.device_event_s,
        start_timeout_s=config.deadlines.start_s,
        stop_timeout_s=config.deadlines.stop_s,
    )
    decode_receiver = providers.Factory(
        DecodeReceiver,
        server_factory=control_server.provider,
        codec=codec,
        transfer=transport,
        d_rank=config.tp_rank,
        d_tp=config.tp_size,
        clock=clock,
        log=logger,
        request_timeout_s=config.deadlines.request_s,
        start_timeout_s=config.deadlines.start_s,
        stop_timeout_s=config.deadlines.stop_s,
    )
    # The role's service; callers pass the runtime pieces (layouts, destinations).
    endpoint = providers.Selector(config.role, prefill=prefill_sender, decode=decode_receiver)


def build_container(settings: Rd2hSettings) -> Container:
    container = Container()
    container.config.from_dict(settings.model_dump())
    return container
