"""The vLLM connector's roles, assembled from the container's providers: what
``SfaRemoteD2HConnector`` builds for its scheduler and for each worker (Prefill: register
the source caches and start the sender; Decode: register the destinations, bind the
control socket and start receiving). Adapters come only through the container."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rd2h.app.connector.decode_worker import DecodeWorker
from rd2h.app.connector.facts import EngineFacts
from rd2h.app.connector.prefill_worker import PrefillWorker
from rd2h.app.connector.roles import ConnectorRole
from rd2h.app.settings import Rd2hOptions
from rd2h.bootstrap.container import Container, bootstrap
from rd2h.domain.errors import Rd2hError
from rd2h.domain.planning.chunks import discover_cache_groups, wire_layer_ids
from rd2h.domain.planning.layout import SourceLayout
from rd2h.ports.destinations import DecodeDestinations
from rd2h.ports.runtime import TpGroupExchange


def _container(options: Rd2hOptions, facts: EngineFacts,
               overrides: Mapping[str, Any] | None) -> Container:
    """The container for this engine's settings (validated up front, ports included),
    with the caller's overrides (``bootstrap``'s keywords; tests hand fakes this way)."""
    return bootstrap(facts.settings(options), **dict(overrides or {}))


def build_scheduler_role(options: Rd2hOptions, facts: EngineFacts,
                         overrides: Mapping[str, Any] | None = None) -> ConnectorRole:
    settings = facts.settings(options)
    # Main KV is an attention group's: a state group's one block per request is no main.
    groups = discover_cache_groups(tuple(
        () if i in facts.state_groups else names
        for i, names in enumerate(facts.group_layer_names)))
    # The N-1 scheme: with state (its state must be after N-1 tokens), and with
    # DeepSeek-V4's caches (vLLM's window bookkeeping for a hit of all N tokens drops
    # the block that holds token N-128, which the recomputed last token still reads;
    # with N-1 tokens loaded, the window Decode keeps is the one that token needs).
    backoff = bool(facts.state_groups or facts.hookless_groups)
    container = _container(options, facts, overrides)
    container.logger(role=f"{facts.side}-scheduler").info(
        "rd2h moves KV cache groups", groups=facts.groups_text or "one group (no config)",
        compat=dict(facts.compat.values) if facts.compat is not None else None)
    if facts.side == "prefill":
        return container.prefill_scheduler(
            block_size=facts.block_size, main_group=groups.main, indexer_group=groups.indexer,
            log=container.logger(role="prefill-scheduler"), state_groups=facts.state_groups,
            group_block_sizes=facts.group_block_sizes, prompt_backoff=backoff,
        )
    log = container.logger(role="decode-scheduler")
    return container.decode_scheduler(
        metaserver=container.metaserver(log=log), base_port=settings.base_port,
        engine_id=options.engine_id or facts.engine_id, log=log, main_group=groups.main,
        indexer_group=groups.indexer, state_groups=facts.state_groups,
        block_size=facts.block_size, group_block_sizes=facts.group_block_sizes,
        prompt_backoff=backoff,
    )


def _pages_text(layouts: Mapping[str, Any]) -> dict[str, str]:
    """Per KV cache group, the distinct ``page/block`` byte sizes of its layers' main
    tensors (a packed or padded layout moves less than a block): for operators and
    tests to see exactly what each block moves."""
    out: dict[str, set[str]] = {}
    for lay in layouts.values():
        key = "main" if lay.group is None else f"group {lay.group}"
        out.setdefault(key, set()).update(f"{t.page}/{t.bytes_per_block}" for t in lay.main)
    return {k: ",".join(sorted(v)) for k, v in sorted(out.items())}


def _split_text(facts: EngineFacts) -> str | None:
    """How this rank's state layers split over TP (None: no state)."""
    if not facts.state_groups:
        return None
    if facts.state_geometry is None:
        return "equal TP only" + (f" ({facts.state_note})" if facts.state_note else "")
    return f"rank {facts.tp_rank} of TP {facts.tp_size}, {facts.state_geometry.kind}"


def _log_channel(container: Container, role: str, options: Rd2hOptions) -> None:
    """Say how the control channel is protected (never with what)."""
    container.logger(role=role).info(
        "control channel",
        signing="HMAC-SHA256" if options.auth_secret is not None else "off",
        encryption="CURVE" if options.curve_secret_key is not None else "off")


def build_prefill_worker(
    options: Rd2hOptions,
    facts: EngineFacts,
    layouts: Mapping[str, SourceLayout],
    regions: Sequence[tuple[int, int]],
    *,
    host_memory: bool = True,
    overrides: Mapping[str, Any] | None = None,
) -> PrefillWorker:
    """Register the source caches with the transport and start the sender.
    ``host_memory``: the caches are in this process's host memory (``verify_kv`` hashes
    them in place; refused otherwise). ``overrides``: ``bootstrap``'s keywords (a fake
    ``memfabric_library``, in-memory control sockets)."""
    if not layouts:
        raise Rd2hError("no KV cache layers to expose")
    if options.verify_kv and not host_memory:
        raise Rd2hError("verify_kv hashes the KV cache where it lies, which needs it in host "
                        "memory: this engine's cache is on a device (not supported yet)")
    container = _container(options, facts, overrides)
    transport = container.transport()
    for addr, size in regions:
        transport.register_memory(addr, size)
    ids = wire_layer_ids(tuple(layouts))
    by_idx = {ids[name]: lay for name, lay in layouts.items()}
    groups = facts.layer_groups() or {}
    worker = container.prefill_worker(  # reuse waits: the sender's gate budget
        sender=container.prefill_sender(p_session=transport.session_id, layers=by_idx,
                                        compat=facts.compat),
        layer_names={i: lay.layer_name for i, lay in by_idx.items()}, transport=transport,
        layer_groups={i: groups[lay.layer_name] for i, lay in by_idx.items()
                      if lay.layer_name in groups}, state_groups=facts.state_groups,
        hookless_groups=facts.hookless_groups,
        layouts=by_idx, digest=container.digest() if options.verify_kv else None,
        main_shared=(facts.compat is not None
                     and facts.compat.values.get("main_sharing") == "shared_pool"),
        state_geometry=facts.state_geometry,
    )
    container.logger(role="prefill").info(
        "verify_kv: " + ("every announced block states its digest" if options.verify_kv
                         else "off (no digests stated)"))
    if facts.state_groups:
        container.logger(role="prefill").info(
            "state layers", state_split=_split_text(facts),
            split_layers=sum(1 for lay in layouts.values() if lay.state is not None))
    _log_channel(container, "prefill", options)
    worker.start()
    return worker


def build_decode_worker(
    options: Rd2hOptions,
    facts: EngineFacts,
    destinations: DecodeDestinations,
    *,
    tp_group: Any = None,
    exchange: TpGroupExchange | None = None,
    host_memory: bool = True,
    overrides: Mapping[str, Any] | None = None,
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
    container = _container(options, facts, overrides)
    transport = container.transport()
    for addr, size in destinations.regions():
        transport.register_memory(addr, size)
    worker = container.decode_worker(
        receiver=container.decode_receiver(destinations=destinations.layouts(),
                                           compat=facts.compat,
                                           digest=container.digest() if host_memory else None),
        exchange=exchange or container.tp_exchange(group=tp_group if facts.tp_size > 1 else None),
        report_invalid_blocks=len(facts.group_layer_names) <= 1,
    )
    container.logger(role="decode").info(
        "KV cache pages (bytes moved of each block / bytes between blocks, per group)",
        pages=_pages_text(destinations.layouts()), state_split=_split_text(facts),
        split_layers=sum(1 for lay in destinations.layouts().values()
                         if getattr(lay, "state", None) is not None))
    container.logger(role="decode").info(
        "verify_kv: " + ("the digests a Prefill states are checked after each read"
                         if host_memory else "digests are not checked (destination memory "
                         "is not host memory here)"))
    _log_channel(container, "decode", options)
    worker.start()
    return worker
