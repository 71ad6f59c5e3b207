"""``SfaRemoteD2HConnector``: a thin vLLM KV connector facade.

It turns vLLM's objects (requests, scheduler output, caches, process groups) into
plain values and dispatches by role (scheduler / worker) and side (producer =
Prefill, consumer = Decode) to rd2h's application services in
``rd2h.app.connector``. vLLM instantiates this class itself, so it is the one
adapter that reaches the composition root (``rd2h.app.connector.wiring``).
"""

from __future__ import annotations

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
from rd2h.app.connector.options import ConnectorConfigError, ConnectorOptions
from rd2h.app.connector.plans import StepPlan
from rd2h.app.connector.wiring import (
    EngineFacts,
    build_decode_scheduler,
    build_decode_worker,
    build_prefill_scheduler,
    build_prefill_worker,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


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


def _side(kv_role: str | None) -> str:
    if kv_role == "kv_producer":
        return "prefill"
    if kv_role == "kv_consumer":
        return "decode"
    raise ConnectorConfigError(
        f"SfaRemoteD2HConnector needs kv_role 'kv_producer' (Prefill) or 'kv_consumer' "
        f"(Decode), got {kv_role!r}"
    )


class SfaRemoteD2HConnector(KVConnectorBase_V1, SupportsHMA):
    # AscendMultiConnector cooperation (spec 11).
    supports_layerwise_buffer_reuse = True
    requires_full_blocks_on_update_after_alloc = True

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.options = ConnectorOptions.parse(ktc.kv_connector_extra_config)
        self.side = _side(ktc.kv_role)
        pc = vllm_config.parallel_config
        if pc.pipeline_parallel_size != 1:
            raise ConnectorConfigError("rd2h supports pipeline_parallel_size 1 only")
        for attr in ("decode_context_parallel_size", "prefill_context_parallel_size"):
            if getattr(pc, attr, 1) not in (1, None):
                raise ConnectorConfigError(f"rd2h does not support {attr} > 1")
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        names = tuple(tuple(g.layer_names) for g in groups)
        block_size = (groups[0].kv_cache_spec.block_size if groups
                      else vllm_config.cache_config.block_size)
        self._num_groups = len(groups)
        self._num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else 0
        self._facts = EngineFacts(
            side=self.side,  # type: ignore[arg-type]
            kv_port=int(ktc.kv_port),
            global_dp_rank=int(pc.data_parallel_rank or 0),
            tp_size=int(pc.tensor_parallel_size),
            tp_rank=0,
            engine_id=str(ktc.engine_id or ""),
            block_size=int(block_size),
            group_layer_names=names,
        )
        self._d_sched = self._p_sched = None
        self._d_worker = self._p_worker = None
        self._stats_before: dict[str, Any] = {}
        self._invalid: set[int] = set()
        if role == KVConnectorRole.SCHEDULER:
            if self.side == "decode":
                self._d_sched = build_decode_scheduler(self.options, self._facts)
            else:
                self._p_sched = build_prefill_scheduler(self.options, self._facts)

    # ================================================================ scheduler
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._d_sched is None:
            return 0, False
        return self._d_sched.match(
            request.request_id, len(request.prompt_token_ids or ()), num_computed_tokens,
            request.kv_transfer_params,
        )

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return tuple(range(self._num_groups))

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self._d_sched is not None:
            groups = self._groups()
            self._d_sched.after_alloc(
                request.request_id, blocks.get_block_ids(), groups.main, groups.indexer,
                num_external_tokens, request.num_computed_tokens, request.kv_transfer_params,
            )
        elif self._p_sched is not None:
            self._p_sched.track(
                request.request_id, request.num_prompt_tokens, request.kv_transfer_params
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._d_sched is not None:
            return Rd2hConnectorMetadata(StepPlan(loads=self._d_sched.build()))
        sends = []
        if self._p_sched is not None:
            counts = scheduler_output.num_scheduled_tokens
            for new in scheduler_output.scheduled_new_reqs:
                s = self._p_sched.schedule(
                    new.req_id, new.block_ids, new.num_computed_tokens,
                    counts.get(new.req_id, 0), replace_blocks=True,
                )
                if s is not None:
                    sends.append(s)
            cached = scheduler_output.scheduled_cached_reqs
            resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
            for i, rid in enumerate(cached.req_ids):
                s = self._p_sched.schedule(
                    rid, cached.new_block_ids[i], cached.num_computed_tokens[i],
                    counts.get(rid, 0), replace_blocks=rid in resumed,
                )
                if s is not None:
                    sends.append(s)
        return Rd2hConnectorMetadata(StepPlan(sends=tuple(sends)))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if self._d_sched is not None and isinstance(meta, Rd2hWorkerMeta):
            self._d_sched.on_admitted(meta.admitted)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request)

    def _finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        if self._d_sched is not None:
            self._d_sched.finished(request.request_id)
            return False, None
        if self._p_sched is not None:
            return self._p_sched.finished(request.request_id), None
        return False, None

    def _groups(self) -> Any:
        from rd2h.domain.chunks import discover_cache_groups

        return discover_cache_groups(self._facts.group_layer_names)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # layer-wise hooks cannot run inside captured graphs

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> Rd2hConnectorStats | None:
        return Rd2hConnectorStats(data=dict(data or {}))

    # ================================================================ worker
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from vllm.distributed.parallel_state import get_tp_group

        tp = get_tp_group()
        facts = self._rank_facts(tp)
        if self.side == "prefill":
            layouts, regions = source_layouts(kv_caches, self._num_blocks)
            self._p_worker = build_prefill_worker(self.options, facts, layouts, regions)
            return
        if self.options.destinations != "vllm":
            raise ConnectorConfigError(
                "destinations 'sparse_kv_pool' needs the Ascend offload manager: "
                "use register_sparse_kv_pool() from the Ascend integration"
            )
        self._start_decode(VllmCacheDestinations(kv_caches, self._num_blocks), tp)

    def register_sparse_kv_pool(self, manager: Any, indexer_caches: Any = None,
                                scale_caches: Any = None) -> None:
        """Decode on Ascend: pull main KV into the SparseKVOffloadManager's shared pool."""
        from vllm.distributed.parallel_state import get_tp_group

        from rd2h.adapters.ascend.sparse_pool import SparseKvPoolDestinations

        tp = get_tp_group()
        self._rank_facts(tp)
        self._start_decode(
            SparseKvPoolDestinations(manager, indexer_caches=indexer_caches,
                                     scale_caches=scale_caches),
            tp,
        )

    def _rank_facts(self, tp: Any) -> EngineFacts:
        """This worker's TP rank and size, and its accelerator (vLLM's local rank)."""
        from vllm.distributed.parallel_state import get_world_group

        self._facts = EngineFacts(**{
            **self._facts.__dict__, "tp_rank": int(tp.rank_in_group),
            "tp_size": int(tp.world_size), "local_rank": int(get_world_group().local_rank),
        })
        return self._facts

    def _start_decode(self, destinations: Any, tp: Any) -> None:
        from rd2h.adapters.torch.exchange import InMemoryExchangeGroup, TorchDistExchange

        if tp.world_size > 1:
            exchange: Any = TorchDistExchange(
                rank=tp.rank_in_group, world_size=tp.world_size, group=tp.cpu_group,
                timeout_s=self.options.deadlines.tp_exchange_s,
            )
        else:
            exchange = InMemoryExchangeGroup(1).member(0)
        self._d_worker = build_decode_worker(self.options, self._facts, destinations, exchange)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        plan = getattr(connector_metadata, "plan", None)
        if not isinstance(plan, StepPlan):
            return
        # Before the forward: Prefill announces layers from inside it, and Decode
        # must know its destinations before any announcement can arrive.
        if self._d_worker is not None:
            self._d_worker.start_step(plan.loads)
        if self._p_worker is not None:
            self._p_worker.start_step(plan.sends)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return  # Decode reads are driven by Prefill's announcements (async)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._p_worker is not None:
            self._p_worker.before_layer(layer_name)

    def wait_for_layer_reuse(self, layer_idx: int) -> None:
        """Block until Decode read layer ``layer_idx`` (buffer-reuse provider, spec 11)."""
        if self._p_worker is not None:
            self._p_worker.wait_for_layer_reuse(layer_idx)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        if self._p_worker is not None:
            self._p_worker.layer_written(layer_name)

    def on_kv_cache_written(self, layer_name: str) -> None:
        """Ascend: right after the scatter; announce early, once per layer per step."""
        if self._p_worker is not None:
            self._p_worker.layer_written(layer_name)

    def wait_for_save(self) -> None:
        return  # sends are asynchronous; blocks stay alive until finished_sending

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._p_worker is not None:
            return KVConnectorTransferResults(
                finished_sending=self._p_worker.get_finished(finished_req_ids)
            )
        if self._d_worker is not None:
            res = self._d_worker.get_finished(finished_req_ids)
            if self._num_groups == 1:
                # Block ids are unique only within one cache group.
                self._invalid |= set(res.invalid_block_ids)
            return KVConnectorTransferResults(
                finished_recving=set(res.finished), failed_recving=set(res.failed)
            )
        return KVConnectorTransferResults()

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._d_worker is None:
            return None
        admitted = self._d_worker.take_admitted()
        return Rd2hWorkerMeta(dict.fromkeys(admitted, 1)) if admitted else None

    def get_kv_connector_stats(self) -> Rd2hConnectorStats | None:
        now = self._stats_now()
        if not now:
            return None
        d = delta(now, self._stats_before)
        self._stats_before = now
        if self._d_worker is not None:
            # Hand over this interval's latencies and empty the receiver's list, which
            # would otherwise grow for as long as Decode runs.
            lat = self._d_worker.stats.read_latencies_ms
            d["read_latency_ms"] = list(lat)
            lat.clear()
        stats = Rd2hConnectorStats(data=d)
        return None if stats.is_empty() else stats

    def _stats_now(self) -> dict[str, Any]:
        if self._d_worker is not None:
            s = self._d_worker.stats
            return {"bytes_pulled": s.bytes_read, "layers_done": s.layers_done,
                    "layers_failed": s.layers_failed, "read_seconds": s.read_seconds,
                    "reads_failed": s.reads_failed,
                    "requests_done": self._d_worker.requests_done,
                    "requests_failed": self._d_worker.requests_failed}
        if self._p_worker is not None:
            return {"layers_announced": self._p_worker.layers_announced,
                    "requests_failed": self._p_worker.requests_failed}
        return {}

    def shutdown(self) -> None:
        if self._d_sched is not None:
            self._d_sched.shutdown(self.options.deadlines.stop_s)
        if self._p_worker is not None:
            self._p_worker.shutdown()
        if self._d_worker is not None:
            self._d_worker.shutdown()


