"""``Rd2hMultiConnector``: vLLM's ``MultiConnector`` with the layer-wise buffer-reuse
rules of spec 11, so rd2h cooperates with a layer-wise offload connector on vanilla
vLLM as it does under vllm-ascend's AscendMultiConnector.

Use with ``--kv-transfer-config '{"kv_connector": "Rd2hMultiConnector",
"kv_connector_module_path": "rd2h.adapters.vllm.multi", "kv_role": "kv_producer",
"kv_connector_extra_config": {"connectors": [{...}, {...}]}}'``; each entry of
``connectors`` is a KVTransferConfig of one sub-connector, exactly as for vLLM's
``MultiConnector``.

The rules, on top of ``MultiConnector`` (which calls every sub-connector in config
order):

* A sub-connector advertising ``supports_layerwise_buffer_reuse = True`` is a
  *provider*: it owns a reuse gate over physical KV buffers and offers a waiter
  ``wait_for_layer_reuse(layer_idx)``. Providers are called **first** in
  ``wait_for_layer_load``, ``save_kv_layer`` and ``on_kv_cache_written`` (an
  Ascend-only hook: forwarded to every sub-connector that has it), so a provider's
  gate closes before a sibling publishes or reuses the same buffer.
* On the worker, the providers' waiter is handed to every other sub-connector that
  has ``set_external_slot_release_waiter(waiter)`` (a *sink*; returning ``False``
  declines). A sink calls the waiter before it reuses a buffer, so a provider whose
  waiter a sink accepted is not called in ``wait_for_layer_load``: its entry wait
  would only wait a second time for the same gate.
* On the scheduler, a sub-connector with ``requires_full_blocks_on_update_after_alloc
  = True`` gets the request's complete block groups in ``update_state_after_alloc``
  (from the bound KV cache manager), whichever connector was chosen for the lookup
  and whatever subset of blocks the scheduler passed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
    MultiKVConnectorPromMetrics,
    MultiKVConnectorStats,
)
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)

PROVIDER_FLAG = "supports_layerwise_buffer_reuse"
FULL_BLOCKS_FLAG = "requires_full_blocks_on_update_after_alloc"
WAITER = "wait_for_layer_reuse"
WAITER_SETTER = "set_external_slot_release_waiter"
EARLY_DISPATCH = "on_kv_cache_written"

LayerWaiter = Callable[[int], None]


class MultiConnectorConfigError(ValueError):
    """``kv_connector_extra_config['connectors']`` cannot be used; says which entry."""


def is_provider(connector: object) -> bool:
    """Whether ``connector`` advertises a layer-wise buffer-reuse gate (spec 11)."""
    return getattr(connector, PROVIDER_FLAG, False) is True


def requires_full_blocks(connector: object) -> bool:
    return getattr(connector, FULL_BLOCKS_FLAG, False) is True


def _name(connector: object) -> str:
    return type(connector).__name__


def _check_connectors(vllm_config: VllmConfig) -> None:
    """Refuse a missing or malformed ``connectors`` list with a message naming the entry
    (vLLM's ``MultiConnector`` only asserts)."""
    ktc = vllm_config.kv_transfer_config
    extra = ktc.kv_connector_extra_config if ktc is not None else None
    entries = extra.get("connectors") if isinstance(extra, Mapping) else None
    if not isinstance(entries, Sequence) or isinstance(entries, (str, bytes)) or not entries:
        raise MultiConnectorConfigError(
            "Rd2hMultiConnector needs kv_connector_extra_config['connectors']: a non-empty "
            "list of sub-connector KV transfer configs"
        )
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or not entry.get("kv_connector"):
            raise MultiConnectorConfigError(
                f"kv_connector_extra_config['connectors'][{i}] must be an object with a "
                f"'kv_connector' name, got {entry!r}"
            )
    hma_on = not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    if hma_on and not MultiConnector.all_children_support_hma(ktc):
        # vLLM turns HMA off by itself only for a connector named "MultiConnector".
        raise MultiConnectorConfigError(
            "the hybrid KV cache manager is on but not every sub-connector of "
            "Rd2hMultiConnector supports it; pass --disable-hybrid-kv-cache-manager"
        )


def _all_of(providers: Sequence[KVConnectorBase_V1]) -> LayerWaiter:
    """One waiter over several providers, in order: the buffer is free when all are."""
    waiters = [getattr(p, WAITER) for p in providers]

    def wait_for_layer_reuse(layer_idx: int) -> None:
        for wait in waiters:
            wait(layer_idx)

    return wait_for_layer_reuse


class Rd2hMultiConnector(MultiConnector):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        _check_connectors(vllm_config)
        super().__init__(vllm_config, role, kv_cache_config)
        providers = []
        for c in self._connectors:
            if is_provider(c):
                if not callable(getattr(c, WAITER, None)):
                    raise MultiConnectorConfigError(
                        f"{_name(c)} advertises {PROVIDER_FLAG} but has no "
                        f"{WAITER}(layer_idx)"
                    )
                providers.append(c)
        self._providers: tuple[KVConnectorBase_V1, ...] = tuple(providers)
        others = tuple(c for c in self._connectors if not is_provider(c))
        # Providers first, then the others in config order.
        self._layer_order = self._providers + others
        self._sinks: tuple[KVConnectorBase_V1, ...] = ()
        waited_by_sink: set[int] = set()
        if role == KVConnectorRole.WORKER:  # buffers are reused in the forward pass only
            waited_by_sink = self._hand_off_waiters()
        self._entry_waits = tuple(
            p for i, p in enumerate(self._providers) if i not in waited_by_sink
        ) + others
        self._manager: KVCacheManager | None = None

    # ------------------------------------------------------------ introspection
    @property
    def providers(self) -> tuple[KVConnectorBase_V1, ...]:
        """Sub-connectors with a layer-wise buffer-reuse gate, in config order."""
        return self._providers

    @property
    def waiter_sinks(self) -> tuple[KVConnectorBase_V1, ...]:
        """Sub-connectors that accepted a provider's waiter."""
        return self._sinks

    # ------------------------------------------------------------ waiter hand-off
    def _hand_off_waiters(self) -> set[int]:
        """Give each sub-connector that takes one the waiter of every *other* provider.
        Returns the indices (into ``providers``) of providers some sink now waits on."""
        sinks = []
        waited: set[int] = set()
        for c in self._connectors:
            setter = getattr(c, WAITER_SETTER, None)
            if not callable(setter):
                continue
            mine = [(i, p) for i, p in enumerate(self._providers) if p is not c]
            if not mine:
                continue
            ps = [p for _, p in mine]
            waiter = getattr(ps[0], WAITER) if len(ps) == 1 else _all_of(ps)
            if setter(waiter) is False:
                logger.info("Rd2hMultiConnector: %s declined the buffer-reuse waiter of %s",
                            _name(c), ", ".join(_name(p) for p in ps))
                continue
            sinks.append(c)
            waited.update(i for i, _ in mine)
            logger.info(
                "Rd2hMultiConnector: %s waits on the buffer-reuse gate of %s before reusing "
                "a buffer; their wait_for_layer_load entry wait is skipped",
                _name(c), ", ".join(_name(p) for p in ps),
            )
        self._sinks = tuple(sinks)
        return waited

    # ------------------------------------------------------------ worker hooks
    def wait_for_layer_load(self, layer_name: str) -> None:
        for c in self._entry_waits:
            c.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        for c in self._layer_order:
            c.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def on_kv_cache_written(self, layer_name: str) -> None:
        """Ascend-only: a layer's KV was just scattered into the cache (providers first)."""
        for c in self._layer_order:
            hook = getattr(c, EARLY_DISPATCH, None)
            if callable(hook):
                hook(layer_name)

    # ------------------------------------------------------------ scheduler hooks
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        # MultiConnector forwards without keeping it; the full-block rule needs it.
        self._manager = kv_cache_manager
        super().bind_kv_cache_manager(kv_cache_manager)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        chosen = self._requests_to_connector.get(request.request_id, -1)
        full: KVCacheBlocks | None = None
        for i, c in enumerate(self._connectors):
            given = blocks
            if requires_full_blocks(c):
                if full is None:
                    full = self._full_blocks(request, blocks)
                given = full
            c.update_state_after_alloc(request, given, num_external_tokens if i == chosen else 0)

    def _full_blocks(self, request: Request, blocks: KVCacheBlocks) -> KVCacheBlocks:
        """Every block of the request, per group: the manager's view when it is bound and
        covers what the scheduler passed, else what was passed."""
        if self._manager is None:
            return blocks
        full = self._manager.get_blocks(request.request_id)
        mine, passed = full.get_block_ids(), blocks.get_block_ids()
        if len(mine) != len(passed) or any(len(a) < len(b) for a, b in zip(mine, passed)):
            return blocks
        return full

    # ------------------------------------------------------------ stats
    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        """Like MultiConnector's, but sub-connectors loaded by module path (rd2h's own,
        absent from vLLM's registry) are rebuilt too, and an unknown one is dropped with a
        warning instead of failing the frontend's stats logger."""
        if data is None:
            return MultiKVConnectorStats()
        out: dict[str, KVConnectorStats] = {}
        for name, value in data.items():
            if isinstance(value, KVConnectorStats):
                out[name] = value
                continue
            builder = _stats_builder(name)
            if builder is None:
                logger.warning_once(
                    "Rd2hMultiConnector: no stats class for sub-connector %s; its stats "
                    "are not logged", name,
                )
                continue
            stats = builder(value)
            if stats is not None:
                out[name] = stats
        return MultiKVConnectorStats(data=out)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        """Every sub-connector's series (rd2h's included), like MultiConnector's, but the
        stats of a sub-connector without Prometheus metrics are skipped instead of
        failing the frontend's stat logger on an assertion."""
        prom: dict[str, KVConnectorPromMetrics] = {}
        for connector_cls, sub_config in cls._get_connector_classes_and_configs(vllm_config):
            name = connector_cls.__name__  # the key its stats travel under
            if name in prom:
                continue
            built = connector_cls.build_prom_metrics(sub_config, metric_types, labelnames,
                                                     per_engine_labelvalues)
            if built is not None:
                prom[name] = built
        return _SubPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues,
                               prom)


class _SubPromMetrics(MultiKVConnectorPromMetrics):
    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, data in transfer_stats_data.items():
            metrics = self._prom_metrics.get(name)
            if metrics is None:
                logger.debug_once("Rd2hMultiConnector: %s has no Prometheus metrics", name)
                continue
            metrics.observe(data, engine_idx)


def _stats_builder(name: str) -> Callable[[Any], KVConnectorStats | None] | None:
    if name == "SfaRemoteD2HConnector":
        from rd2h.adapters.vllm.stats import Rd2hConnectorStats

        return lambda value: Rd2hConnectorStats(data=dict(value or {}))
    try:
        connector_cls = KVConnectorFactory.get_connector_class_by_name(name)
    except ValueError:
        return None
    return lambda value: connector_cls.build_kv_connector_stats(data=value)
