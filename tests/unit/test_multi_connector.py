"""``Rd2hMultiConnector`` (spec 11) on vLLM's real ``MultiConnector`` machinery.

vLLM itself builds everything here: a real ``VllmConfig`` / ``KVTransferConfig``, the
connector through ``KVConnectorFactory.create_connector``, each sub-connector from the
``connectors`` list by module path, a real ``KVCacheManager`` and ``Request``. The
sub-connectors are recording ``KVConnectorBase_V1`` subclasses (``fakes.vllm_connectors``)
and, in the last tests, rd2h's own ``SfaRemoteD2HConnector``. Where it shows what the
rules change, the same configuration also runs through vanilla ``MultiConnector``.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from fakes import vllm_connectors as rec
from fakes.clock import ManualClock
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
    MultiKVConnectorStats,
)
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.request import Request

from rd2h.adapters.vllm.multi import MultiConnectorConfigError, Rd2hMultiConnector
from rd2h.adapters.vllm.stats import Rd2hConnectorStats
from rd2h.app.prefill_requests import SessionRequestsView
from rd2h.domain.prefill.prefill_session import PrefillSession
from rd2h.domain.prefill.prefill_state import PrefillTimeouts

WORKER, SCHEDULER = KVConnectorRole.WORKER, KVConnectorRole.SCHEDULER
LAYER = "model.layers.3.self_attn"
BLOCK = 16


@pytest.fixture(autouse=True)
def _journal() -> Any:
    rec.reset()
    yield
    rec.reset()


def sub(cls: str, **extra: Any) -> dict[str, Any]:
    return {"kv_connector": cls, "kv_connector_module_path": "fakes.vllm_connectors",
            "kv_role": "kv_both", "kv_connector_extra_config": extra}


def config(*subs: dict[str, Any], multi: str = "Rd2hMultiConnector",
           kv_role: str = "kv_both") -> VllmConfig:
    path = "rd2h.adapters.vllm.multi" if multi == "Rd2hMultiConnector" else None
    ktc = KVTransferConfig(kv_connector=multi, kv_connector_module_path=path, kv_role=kv_role,
                           kv_connector_extra_config={"connectors": list(subs)})
    return VllmConfig(kv_transfer_config=ktc)


def build(role: KVConnectorRole, *subs: dict[str, Any], multi: str = "Rd2hMultiConnector",
          kv_cache_config: Any = None) -> Any:
    return KVConnectorFactory.create_connector(config(*subs, multi=multi), role,
                                               kv_cache_config)


def by_name(name: str) -> Any:
    return next(c for c in rec.INSTANCES if c.name == name)


def forward_one_layer(connector: Any, layer: str = LAYER) -> None:
    """What an Ascend attention layer does around its KV write (spec 11 order)."""
    connector.wait_for_layer_load(layer)
    connector.on_kv_cache_written(layer)
    connector.save_kv_layer(layer, None, None)


SINK_PLAIN_PROVIDER = (sub("RecordingSink", name="sink"), sub("RecordingPlain", name="plain"),
                       sub("RecordingProvider", name="prov"))


# ====================================================================== worker side


def test_factory_builds_it_from_module_path_and_finds_the_provider() -> None:
    multi = build(WORKER, *SINK_PLAIN_PROVIDER)
    assert type(multi) is Rd2hMultiConnector and isinstance(multi, MultiConnector)
    assert [c.name for c in multi.sub_connectors] == ["sink", "plain", "prov"]
    assert multi.providers == (by_name("prov"),)


def test_provider_is_called_first_in_every_layer_hook() -> None:
    multi = build(WORKER, *SINK_PLAIN_PROVIDER)
    rec.JOURNAL.clear()
    multi.save_kv_layer(LAYER, None, None)
    multi.on_kv_cache_written(LAYER)
    assert rec.calls("save_kv_layer") == ["prov", "sink", "plain"]
    # Forwarded to every sub-connector that has the Ascend hook, provider first.
    assert rec.calls("on_kv_cache_written") == ["prov", "sink"]


def test_vanilla_multi_connector_keeps_config_order_and_has_no_ascend_hook() -> None:
    """The contrast: what the rules change."""
    multi = build(WORKER, *SINK_PLAIN_PROVIDER, multi="MultiConnector")
    rec.JOURNAL.clear()
    multi.save_kv_layer(LAYER, None, None)
    multi.wait_for_layer_load(LAYER)
    assert rec.calls("save_kv_layer") == ["sink", "plain", "prov"]
    assert rec.calls("wait_for_layer_load") == ["sink", "plain", "prov"]
    assert rec.calls("set_external_slot_release_waiter") == []
    assert not hasattr(multi, "on_kv_cache_written")


def test_waiter_is_handed_to_the_sink_only() -> None:
    multi = build(WORKER, *SINK_PLAIN_PROVIDER)
    sink, prov = by_name("sink"), by_name("prov")
    assert rec.calls("set_external_slot_release_waiter") == ["sink"]
    assert sink.waiter == prov.wait_for_layer_reuse  # the provider's own bound waiter
    assert multi.waiter_sinks == (sink,)
    sink.waiter(7)
    assert rec.JOURNAL[-1] == ("prov", "wait_for_layer_reuse", (7,))


def test_accepted_waiter_replaces_the_providers_entry_wait() -> None:
    multi = build(WORKER, *SINK_PLAIN_PROVIDER)
    rec.JOURNAL.clear()
    forward_one_layer(multi)
    hooks = [(who, hook) for who, hook, _ in rec.JOURNAL]
    assert ("prov", "wait_for_layer_load") not in hooks
    # The sink waits on the provider's gate (layer 3) before it reuses the buffer.
    assert hooks[:4] == [("sink", "wait_for_layer_load"), ("sink", "calls_waiter"),
                         ("prov", "wait_for_layer_reuse"), ("plain", "wait_for_layer_load")]
    assert rec.JOURNAL[2][2] == (3,)
    assert hooks.count(("prov", "wait_for_layer_reuse")) == 1  # one gate wait per layer


def test_declined_waiter_keeps_the_providers_entry_wait_first() -> None:
    multi = build(WORKER, sub("RecordingSink", name="sink", accept_waiter=False),
                  sub("RecordingPlain", name="plain"), sub("RecordingProvider", name="prov"))
    assert rec.calls("set_external_slot_release_waiter") == ["sink"]
    assert multi.waiter_sinks == () and by_name("sink").waiter is None
    rec.JOURNAL.clear()
    multi.wait_for_layer_load(LAYER)
    assert rec.calls("wait_for_layer_load") == ["prov", "sink", "plain"]
    assert rec.calls("wait_for_layer_reuse") == []


def test_without_a_sink_the_provider_waits_first() -> None:
    multi = build(WORKER, sub("RecordingPlain", name="plain"),
                  sub("RecordingProvider", name="prov"))
    rec.JOURNAL.clear()
    multi.wait_for_layer_load(LAYER)
    assert rec.calls("wait_for_layer_load") == ["prov", "plain"]


def test_two_providers_give_the_sink_one_waiter_over_both() -> None:
    build(WORKER, sub("RecordingProvider", name="p1"), sub("RecordingSink", name="sink"),
          sub("RecordingProvider", name="p2"))
    rec.JOURNAL.clear()
    by_name("sink").waiter(5)
    assert rec.JOURNAL == [("p1", "wait_for_layer_reuse", (5,)),
                           ("p2", "wait_for_layer_reuse", (5,))]


def test_scheduler_side_hands_no_waiter() -> None:
    multi = build(SCHEDULER, *SINK_PLAIN_PROVIDER)
    assert rec.calls("set_external_slot_release_waiter") == []
    assert multi.waiter_sinks == ()


def test_provider_without_a_waiter_is_refused() -> None:
    with pytest.raises(MultiConnectorConfigError, match=r"ProviderWithoutWaiter.*wait_for_layer"):
        build(WORKER, sub("ProviderWithoutWaiter"), sub("RecordingSink"))


@pytest.mark.parametrize("extra", [{}, {"connectors": []}, {"connectors": [{"kv_role": "x"}]}])
def test_missing_or_malformed_connector_list_is_refused(extra: dict[str, Any]) -> None:
    ktc = KVTransferConfig(kv_connector="Rd2hMultiConnector",
                           kv_connector_module_path="rd2h.adapters.vllm.multi",
                           kv_role="kv_both", kv_connector_extra_config=extra)
    cfg = VllmConfig(kv_transfer_config=ktc)
    with pytest.raises(MultiConnectorConfigError, match=r"connectors"):
        Rd2hMultiConnector(cfg, WORKER, None)


# ====================================================================== scheduler side


def _manager_and_request() -> tuple[KVCacheConfig, KVCacheManager, Request, Any, Any]:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64,
                             dtype=torch.float16)
    kcc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec([LAYER], spec)])
    manager = KVCacheManager(kcc, max_model_len=1024, scheduler_block_size=BLOCK,
                             hash_block_size=BLOCK, enable_caching=False)
    request = Request("req-1", list(range(100)), SamplingParams(max_tokens=4), None)
    first = manager.allocate_slots(request, 48)  # chunk 1: 3 blocks
    request.num_computed_tokens = 48
    second = manager.allocate_slots(request, 52)  # chunk 2: 4 more
    return kcc, manager, request, first, second


def _alloc_calls() -> dict[str, tuple[Any, ...]]:
    return {who: args for who, hook, args in rec.JOURNAL if hook == "update_state_after_alloc"}


@pytest.mark.parametrize("multi", ["Rd2hMultiConnector", "MultiConnector"])
def test_full_blocks_reach_the_connector_that_requires_them(multi: str) -> None:
    kcc, manager, request, _, second = _manager_and_request()
    full = manager.get_blocks("req-1").get_block_ids()
    assert len(full[0]) == 7 and len(second.get_block_ids()[0]) == 4
    connector = build(SCHEDULER, sub("RecordingSink", name="sink", matched_tokens=BLOCK * 2),
                      sub("RecordingProvider", name="prov"), sub("RecordingPlain", name="plain"),
                      multi=multi, kv_cache_config=kcc)
    connector.bind_kv_cache_manager(manager)
    assert connector.get_num_new_matched_tokens(request, 0) == (BLOCK * 2, False)  # sink chosen
    rec.JOURNAL.clear()
    # A scheduler that passes only this step's new blocks.
    connector.update_state_after_alloc(request, second, BLOCK * 2)
    got = _alloc_calls()
    assert got["sink"] == ("req-1", second.get_block_ids(), BLOCK * 2)
    assert got["plain"] == ("req-1", second.get_block_ids(), 0)
    if multi == "Rd2hMultiConnector":
        assert got["prov"] == ("req-1", full, 0)
    else:  # vanilla forwards what it was given
        assert got["prov"] == ("req-1", second.get_block_ids(), 0)


def test_chosen_provider_gets_full_blocks_and_its_token_count() -> None:
    kcc, manager, request, _, second = _manager_and_request()
    connector = build(SCHEDULER, sub("RecordingProvider", name="prov", matched_tokens=BLOCK),
                      sub("RecordingPlain", name="plain"), kv_cache_config=kcc)
    connector.bind_kv_cache_manager(manager)
    connector.get_num_new_matched_tokens(request, 0)
    rec.JOURNAL.clear()
    connector.update_state_after_alloc(request, second, BLOCK)
    got = _alloc_calls()
    assert got["prov"] == ("req-1", manager.get_block_ids("req-1"), BLOCK)
    assert got["plain"] == ("req-1", second.get_block_ids(), 0)


def test_without_a_bound_manager_the_passed_blocks_are_forwarded() -> None:
    kcc, _, request, first, _ = _manager_and_request()
    connector = build(SCHEDULER, sub("RecordingProvider", name="prov"), kv_cache_config=kcc)
    connector.update_state_after_alloc(request, first, 0)
    assert _alloc_calls()["prov"] == ("req-1", first.get_block_ids(), 0)


# ====================================================================== stats


def test_stats_of_module_path_sub_connectors_are_rebuilt_not_fatal() -> None:
    data = {"SfaRemoteD2HConnector": {"bytes_pulled": 10, "layers_done": 2},
            "SomeUnregisteredConnector": {"x": 1}}
    stats = Rd2hMultiConnector.build_kv_connector_stats(data)
    assert isinstance(stats, MultiKVConnectorStats)
    assert set(stats.data) == {"SfaRemoteD2HConnector"}
    assert isinstance(stats["SfaRemoteD2HConnector"], Rd2hConnectorStats)
    assert stats.reduce()["SfaRemoteD2HConnector"]["bytes_pulled"] == 10
    with pytest.raises(ValueError, match="not registered"):  # vanilla's frontend logger
        MultiConnector.build_kv_connector_stats(data)


# ====================================================================== rd2h as provider


class RecordingSender:
    """The slice of ``PrefillSender`` that ``PrefillWorker`` drives, recorded."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        # The request book of a session this fake never announces to.
        self.requests = SessionRequestsView(threading.Condition(),
                                            PrefillSession({}, PrefillTimeouts()), ManualClock())

    def wait_for_layer_send(self, layer_idx: int, timeout: float) -> None:
        self.log.append(("wait", layer_idx))

    def submit(self, layer_idx: int, event: Any, targets: Any, named: Any = None,
               final: Any = (), *, hold: bool = False) -> int:
        self.log.append(("submit", layer_idx))
        return len(targets)

    def release(self) -> bool:
        return False

    @property
    def timeouts(self) -> PrefillTimeouts:
        return PrefillTimeouts()

    def counters(self) -> dict[str, int]:
        return {}

    def stop(self, timeout: float) -> bool:
        return True


def _rd2h_with_sink(accept: bool) -> tuple[Any, Any, RecordingSender]:
    from fakes.logs import RecordingLogger

    from rd2h.app.connector.plans import DecodeEndpoint, PrefillSend, StepPlan
    from rd2h.app.settings import Rd2hSettings
    from rd2h.bootstrap.container import bootstrap

    rd2h = {"kv_connector": "SfaRemoteD2HConnector",
            "kv_connector_module_path": "rd2h.entry.connector",
            "kv_role": "kv_producer", "kv_connector_extra_config": {"buffer_reuse": True}}
    multi = build(WORKER, sub("RecordingSink", name="sink", accept_waiter=accept), rd2h)
    provider = multi.providers[0]
    assert type(provider).__name__ == "SfaRemoteD2HConnector"
    sender = RecordingSender()
    names = {i: f"model.layers.{i}.self_attn" for i in range(4)}
    container = bootstrap(Rd2hSettings(role="prefill", buffer_reuse=True, device_events="cpu"),
                          logger=RecordingLogger())
    worker = container.prefill_worker(sender=sender, layer_names=names)
    provider._role = worker  # the role register_kv_caches builds on a real engine
    worker.bind_connector_metadata(StepPlan(sends=(PrefillSend(
        "r-1", "r", DecodeEndpoint("127.0.0.1", 30000, 1), (1, 2), (1, 2), 0, 0,
        final=False),)))
    return multi, provider, sender


def test_rd2h_connector_is_a_provider_and_its_waiter_reaches_the_sink() -> None:
    multi, provider, sender = _rd2h_with_sink(accept=True)
    assert by_name("sink").waiter == provider.wait_for_layer_reuse
    for layer in range(4):
        forward_one_layer(multi, f"model.layers.{layer}.self_attn")
    # One reuse wait per layer (through the sink; the entry wait is skipped), then one
    # announcement per layer (on_kv_cache_written; save_kv_layer skips it).
    assert sender.log == [x for i in range(4) for x in (("wait", i), ("submit", i))]


def test_rd2h_entry_wait_stays_when_the_sink_declines() -> None:
    multi, _, sender = _rd2h_with_sink(accept=False)
    forward_one_layer(multi)
    assert sender.log == [("wait", 3), ("submit", 3)]
    assert rec.calls("calls_waiter") == []
