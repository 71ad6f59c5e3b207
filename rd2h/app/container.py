"""The composition root: builds rd2h's objects from ``Rd2hSettings``.

Only the selected transport and role are constructed (``providers.Selector``),
so a CPU machine never imports an Ascend library. Tests override providers
(``with container.transport.override(fake): ...``).
"""

from __future__ import annotations

from typing import Any

from dependency_injector import containers, providers

from rd2h.adapters.logging import configure_logging, make_logger
from rd2h.adapters.msgpack import MsgpackCodec
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


def _unavailable(name: str) -> Any:
    raise TransportUnavailable(
        f"transport {name!r} is not available in this build of rd2h; "
        "use 'cma', 'mooncake' or 'inproc'"
    )


def _logger(role: str, rank: int, level: str) -> Any:
    configure_logging(level)
    return make_logger(role, rank)


def _rank_port(kv_port: int, global_dp_rank: int, tp_size: int, tp_rank: int) -> int:
    return plan_ports(kv_port, global_dp_rank, tp_size).rank_port(tp_rank)


class Container(containers.DeclarativeContainer):
    config = providers.Configuration(strict=True)

    clock = providers.Singleton(MonotonicClock)
    codec = providers.Singleton(MsgpackCodec, max_frame_bytes=config.max_frame_bytes)
    logger = providers.Singleton(_logger, config.role, config.tp_rank, config.log_level)
    device_events = providers.Singleton(CpuDeviceEvents)

    transport = providers.Selector(
        config.transport,
        cma=providers.Singleton(_cma, threads=config.cma_threads),
        inproc=providers.Singleton(_inproc),
        memfabric=providers.Singleton(_unavailable, "memfabric"),
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
    )
    control_clients = providers.Factory(ZmqControlClients)

    prefill_sender = providers.Factory(
        PrefillSender,
        clients_factory=control_clients.provider,
        codec=codec,
        clock=clock,
        log=logger,
        meta_ack_timeout_s=config.deadlines.meta_ack_s,
        layer_ack_timeout_s=config.deadlines.layer_ack_s,
        event_timeout_s=config.deadlines.device_event_s,
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
    )
    # The role's service; callers pass the runtime pieces (layouts, destinations).
    endpoint = providers.Selector(config.role, prefill=prefill_sender, decode=decode_receiver)


def build_container(settings: Rd2hSettings) -> Container:
    container = Container()
    container.config.from_dict(settings.model_dump())
    return container
