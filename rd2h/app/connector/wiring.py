"""The connector's composition root: builds each role from the validated options
and the facts vLLM gives (ranks, ports, caches). The vLLM adapter calls these; the
shared pieces (transport, codec, sockets, logger) come from ``rd2h.app.container``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from rd2h.app.clock import MonotonicClock
from rd2h.app.connector.decode_scheduler import DecodeScheduler
from rd2h.app.connector.decode_worker import DecodeWorker
from rd2h.app.connector.options import ConnectorOptions
from rd2h.app.connector.prefill_scheduler import PrefillScheduler
from rd2h.app.connector.prefill_worker import PrefillWorker
from rd2h.app.container import build_container
from rd2h.app.settings import Rd2hSettings
from rd2h.domain.chunks import discover_cache_groups, layer_index
from rd2h.domain.errors import Rd2hError
from rd2h.domain.layout import SourceLayout
from rd2h.domain.topology import plan_ports
from rd2h.ports.destinations import DecodeDestinations
from rd2h.ports.runtime import TpGroupExchange

Side = Literal["prefill", "decode"]


@dataclass(frozen=True)
class EngineFacts:
    """What vLLM tells the connector about this engine and rank."""

    side: Side
    kv_port: int
    global_dp_rank: int
    tp_size: int
    tp_rank: int
    engine_id: str
    block_size: int
    group_layer_names: tuple[tuple[str, ...], ...]
    local_rank: int = 0  # the rank's accelerator on its host, as vLLM assigned it


def settings_for(options: ConnectorOptions, facts: EngineFacts) -> Rd2hSettings:
    return Rd2hSettings(
        role=facts.side, transport=options.transport, host=options.host,
        kv_port=facts.kv_port, global_dp_rank=facts.global_dp_rank, tp_size=facts.tp_size,
        tp_rank=facts.tp_rank, cma_threads=options.cma_threads,
        mooncake_protocol=options.mooncake_protocol, mooncake_device=options.mooncake_device,
        mooncake_env=options.mooncake_env, max_frame_bytes=options.max_frame_bytes,
        log_level=options.log_level, deadlines=options.deadlines,
        memfabric_store_url=options.memfabric_store_url,
        memfabric_transfer_type=options.memfabric_transfer_type,
        memfabric_device_id=(facts.local_rank if options.memfabric_device_id is None
                             else options.memfabric_device_id),
        memfabric_nic=options.memfabric_nic,
    )


def _container(settings: Rd2hSettings, memfabric_library: Any) -> Any:
    """The composition root; ``memfabric_library`` stands in for ``memfabric_hybrid``
    (tests pass a recording fake; None imports the real module when the engine starts)."""
    container = build_container(settings)
    if memfabric_library is not None:
        container.memfabric_library.override(memfabric_library)
    return container


def _logger(options: ConnectorOptions, role: str, rank: int) -> Any:
    from rd2h.adapters.logging import configure_logging, make_logger

    configure_logging(options.log_level)
    return make_logger(role, rank)


def build_decode_scheduler(
    options: ConnectorOptions, facts: EngineFacts, metaserver: Any = None
) -> DecodeScheduler:
    settings_for(options, facts)  # validates ports up front
    if metaserver is None:
        from rd2h.adapters.http.metaserver import MetaserverClient

        metaserver = MetaserverClient(
            timeout_s=options.metaserver_timeout_s, retries=options.metaserver_retries,
            retry_delay_s=options.metaserver_retry_interval_s,
            log=_logger(options, "decode-scheduler", 0),
        )
    return DecodeScheduler(
        metaserver=metaserver, host=options.host,
        base_port=plan_ports(facts.kv_port, facts.global_dp_rank, facts.tp_size).base_port,
        tp_size=facts.tp_size, engine_id=options.engine_id or facts.engine_id,
        log=_logger(options, "decode-scheduler", 0),
    )


def build_prefill_scheduler(options: ConnectorOptions, facts: EngineFacts) -> PrefillScheduler:
    groups = discover_cache_groups(facts.group_layer_names)
    return PrefillScheduler(
        block_size=facts.block_size, main_group=groups.main, indexer_group=groups.indexer,
        p_tp=facts.tp_size, log=_logger(options, "prefill-scheduler", 0),
    )


def _device_events(options: ConnectorOptions) -> Any:
    from rd2h.adapters.torch.events import CpuDeviceEvents, NpuDeviceEvents

    kind = options.device_events
    if kind == "auto":
        import importlib.util

        kind = "npu" if importlib.util.find_spec("torch_npu") is not None else "cpu"
    return NpuDeviceEvents() if kind == "npu" else CpuDeviceEvents()


def build_prefill_worker(
    options: ConnectorOptions,
    facts: EngineFacts,
    layouts: Mapping[str, SourceLayout],
    regions: list[tuple[int, int]],
    *,
    memfabric_library: Any = None,
) -> PrefillWorker:
    """Register the source caches with the transport and start the sender."""
    if not layouts:
        raise Rd2hError("no KV cache layers to expose")
    settings = settings_for(options, facts)
    container = _container(settings, memfabric_library)
    transport = container.transport()
    for addr, size in regions:
        transport.register_memory(addr, size)
    by_idx = {layer_index(name): lay for name, lay in layouts.items()}
    sender = container.prefill_sender(p_session=transport.session_id, layers=by_idx)
    worker = PrefillWorker(
        sender=sender, events=_device_events(options), p_rank=facts.tp_rank,
        p_tp=facts.tp_size, layer_names={i: lay.layer_name for i, lay in by_idx.items()},
        clock=MonotonicClock(), log=container.logger(), buffer_reuse=options.buffer_reuse,
        reuse_timeout_s=options.deadlines.layer_ack_s + options.deadlines.meta_ack_s,
        stop_timeout_s=options.deadlines.stop_s,
    )
    worker.start()
    return worker


def build_decode_worker(
    options: ConnectorOptions,
    facts: EngineFacts,
    destinations: DecodeDestinations,
    exchange: TpGroupExchange,
    *,
    memfabric_library: Any = None,
) -> DecodeWorker:
    """Register destinations, bind this rank's control socket and start receiving.

    Every destination region (for the Ascend pool: the host addresses the transfer engine
    sees) is registered with the transport before the receiver can be told to read."""
    wanted = "shared_pool" if options.main_shared else "rank_local"
    if destinations.main_sharing != wanted:
        raise Rd2hError(
            f"destinations hold main KV as {destinations.main_sharing!r} but the "
            f"connector is configured for {wanted!r}"
        )
    settings = settings_for(options, facts)
    container = _container(settings, memfabric_library)
    transport = container.transport()
    for addr, size in destinations.regions():
        transport.register_memory(addr, size)
    receiver = container.decode_receiver(
        destinations=destinations.layouts(), main_shared=options.main_shared,
    )
    worker = DecodeWorker(
        receiver=receiver, exchange=exchange, log=container.logger(),
        exchange_timeout_s=options.deadlines.tp_exchange_s,
        stop_timeout_s=options.deadlines.stop_s,
    )
    worker.start()
    return worker
