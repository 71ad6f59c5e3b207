"""``SfaRemoteD2HConnector``: a thin vLLM KV connector facade.

It holds exactly one role object (``rd2h.app.connector.roles.ConnectorRole``): the
Decode or Prefill scheduler on the scheduler, a worker once the caches are
registered, a role with nothing to do before that. Every hook translates vLLM's
objects into plain values (``rd2h.entry.translate``) and forwards them.
vLLM instantiates this class itself, so it is the one adapter that reaches the
composition root (``rd2h.bootstrap.container``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from rd2h.adapters.vllm.caches import VllmCacheDestinations, source_layouts
from rd2h.adapters.vllm.stats import Rd2hConnectorStats, delta
from rd2h.app.connector.plans import StepPlan
from rd2h.app.connector.roles import ConnectorRole
from rd2h.app.settings import ConnectorConfigError
from rd2h.bootstrap.roles import build_decode_worker, build_prefill_worker, build_scheduler_role
from rd2h.entry import translate

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        PromMetric,
        PromMetricT,
    )
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


def _on_host(kv_caches: dict[str, Any]) -> bool:
    """Whether every KV cache tensor lies in host memory (a CPU engine)."""
    tensors = [t for v in kv_caches.values() for t in (v if isinstance(v, (list, tuple))
                                                       else [v])]
    return all(getattr(getattr(t, "device", None), "type", None) == "cpu" for t in tensors)


class Rd2hConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


@dataclass
class Rd2hWorkerMeta(KVConnectorWorkerMetadata):
    """Workers -> scheduler: requests admitted this step, counted over the TP ranks."""

    admitted: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> Rd2hWorkerMeta:
        if isinstance(other, Rd2hWorkerMeta):
            for rid, n in other.admitted.items():
                self.admitted[rid] = self.admitted.get(rid, 0) + n
        return self


class SfaRemoteD2HConnector(KVConnectorBase_V1, SupportsHMA):
    # AscendMultiConnector cooperation (spec 11).
    supports_layerwise_buffer_reuse = True
    requires_full_blocks_on_update_after_alloc = True

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
        *,
        overrides: Mapping[str, Any] | None = None,
    ) -> None:
        """vLLM calls this with its three arguments. ``overrides`` (tests only): keywords
        for the composition root's ``bootstrap`` that every container this connector
        builds gets (in-memory control sockets, a recording metaserver)."""
        super().__init__(vllm_config, role, kv_cache_config)
        self._overrides = dict(overrides or {})
        self.options, self._facts = translate.engine(vllm_config, kv_cache_config)
        self.side = self._facts.side
        self._stats_before: dict[str, Any] = {}
        self._role: ConnectorRole = (
            build_scheduler_role(self.options, self._facts, self._overrides)
            if role == KVConnectorRole.SCHEDULER else ConnectorRole()
        )

    # ================================================================ scheduler
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._role.get_num_new_matched_tokens(translate.request(request),
                                                     num_computed_tokens)

    def on_new_request(self, request: Request) -> None:
        """Prefill of a model with recurrent state: computes the prompt but its last
        token(s), which Decode computes itself (the N-1 scheme,
        ``rd2h.domain.planning.kv_groups``)."""
        count = self._role.prompt_backoff(translate.request(request))
        if count:
            translate.drop_prompt_tail(request, count)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self._facts.moved_groups  # every other group refused the engine at start

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._role.update_state_after_alloc(translate.request(request),
                                            translate.block_ids(blocks), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._role.requests_preempted(getattr(scheduler_output, "preempted_req_ids", None) or ())
        return Rd2hConnectorMetadata(
            self._role.build_connector_meta(translate.scheduled(scheduler_output)))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        admitted = meta.admitted if isinstance(meta, Rd2hWorkerMeta) else {}
        recved = connector_output.finished_recving or ()
        if admitted or recved:
            self._role.update_connector_output(admitted, recved)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._role.request_finished(request.request_id), None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._role.request_finished(request.request_id), None

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No (vLLM 0.33+ asks; 0.32 has no sleep-mode hook for connectors). Sleep
        mode moves the KV cache, and rd2h's transports registered its memory at
        ``register_kv_caches`` and told every peer where it is: after a wake they would
        point at memory that moved. With False, vLLM refuses ``--enable-sleep-mode``
        beside this connector at start, naming it, instead of serving from stale
        registrations."""
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # layer-wise hooks cannot run inside captured graphs

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> Rd2hConnectorStats | None:
        return Rd2hConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        """rd2h's series on vLLM's /metrics (``rd2h.adapters.vllm.prom``)."""
        from rd2h.adapters.vllm.prom import Rd2hPromMetrics

        return Rd2hPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ================================================================ worker
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        tp_group = self._on_worker()
        if self.side == "prefill":
            layouts, regions = source_layouts(kv_caches, self._facts.num_blocks,
                                              self._facts.kv_heads(), self._facts.layer_groups(),
                                              self._state_shard())
            self._role = build_prefill_worker(self.options, self._facts, layouts, regions,
                                              host_memory=_on_host(kv_caches),
                                              overrides=self._overrides)
            return
        if self.options.destinations != "vllm":
            raise ConnectorConfigError(
                "destinations 'sparse_kv_pool' needs the Ascend offload manager: "
                "use register_sparse_kv_pool() from the Ascend integration"
            )
        self._role = build_decode_worker(
            self.options, self._facts,
            VllmCacheDestinations(kv_caches, self._facts.num_blocks, self._facts.kv_heads(),
                                  self._facts.layer_groups(), self._state_shard()),
            tp_group=tp_group, host_memory=_on_host(kv_caches), overrides=self._overrides,
        )

    def _state_shard(self) -> Any:
        """The state geometry and this rank's ``(rank, tp)`` (None: equal TP only)."""
        geometry = self._facts.state_geometry
        if geometry is None:
            return None
        return (geometry, self._facts.tp_rank, self._facts.tp_size,
                frozenset(self._facts.state_groups))

    def register_sparse_kv_pool(self, manager: Any, indexer_caches: Any = None,
                                scale_caches: Any = None) -> None:
        """Decode on Ascend: pull main KV into the SparseKVOffloadManager's shared pool."""
        from rd2h.adapters.ascend.sparse_pool import SparseKvPoolDestinations

        tp_group = self._on_worker()
        destinations = SparseKvPoolDestinations(manager, indexer_caches=indexer_caches,
                                                scale_caches=scale_caches)
        self._role = build_decode_worker(self.options, self._facts, destinations,
                                         tp_group=tp_group, host_memory=False,
                                         overrides=self._overrides)

    def _on_worker(self) -> Any:
        """This worker's place in vLLM's groups; returns the TP group's CPU group."""
        from vllm.distributed.parallel_state import get_tp_group, get_world_group

        tp = get_tp_group()
        self._facts = translate.on_worker(self._facts, tp, get_world_group())
        return tp.cpu_group

    @property
    def requires_kv_delivery(self) -> bool:
        """Prefill hands KV off to Decode: vLLM must recompute a request preempted while
        that hand-off is pending rather than let it finish from freed blocks. Decode
        hands nothing off."""
        return self.side == "prefill"

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the step's forward: vLLM freed the preempted requests' blocks and the
        forward may overwrite them; Prefill returns once Decode is no longer reading
        them (every announcement of them answered or failed)."""
        plan = getattr(kv_connector_metadata, "plan", None)
        if isinstance(plan, StepPlan):
            self._role.handle_preemptions(plan)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        plan = getattr(connector_metadata, "plan", None)
        if isinstance(plan, StepPlan):
            # Before the forward: Prefill announces layers from inside it, and Decode
            # must know its destinations before any announcement can arrive.
            self._role.bind_connector_metadata(plan)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return  # Decode reads are driven by Prefill's announcements (async)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._role.wait_for_layer_load(layer_name)

    def wait_for_layer_reuse(self, layer_idx: int) -> None:
        """Block until Decode read layer ``layer_idx`` (buffer-reuse provider, spec 11)."""
        self._role.wait_for_layer_reuse(layer_idx)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self._role.save_kv_layer(layer_name)

    def on_kv_cache_written(self, layer_name: str) -> None:
        """Ascend: right after the scatter; announce early, once per layer per step."""
        self._role.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        """After the step's forward: Prefill announces the layers vLLM gives no per-layer
        hook (recurrent state). Sends are asynchronous; blocks stay alive until
        finished_sending."""
        self._role.wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        res = self._role.get_transfer_results(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=set(res.finished_sending), finished_recving=set(res.finished_recving),
            failed_recving=set(res.failed_recving),
        )

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._role.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        admitted = self._role.take_admitted()
        return Rd2hWorkerMeta(dict.fromkeys(admitted, 1)) if admitted else None

    def get_kv_connector_stats(self) -> Rd2hConnectorStats | None:
        now = self._role.kv_connector_stats()
        if not now:
            return None
        latencies = now.pop("read_latency_ms", None)
        d = delta(now, self._stats_before)
        self._stats_before = now
        if latencies is not None:
            d["read_latency_ms"] = latencies
        stats = Rd2hConnectorStats(data=d)
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        self._role.shutdown()
