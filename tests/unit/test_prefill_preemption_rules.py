"""Prefill preemption rules on the scheduler side (spec 3.2, 12): which preempted
requests a step's plan names, and what a resumed request announces; and the vLLM
adapter's part (``requires_kv_delivery`` per role, ``preempted_req_ids`` from vLLM's
real ``SchedulerOutput`` into the plan). The worker's side, against a real Decode:
``test_prefill_preemption_pull``."""

from __future__ import annotations

from typing import Any

import pytest
from fakes.logs import RecordingLogger
from fakes.metaserver import RecordingMetaserver

from rd2h.app.connector.plans import DecodeEndpoint, PrefillSend
from rd2h.app.connector.prefill_scheduler import PrefillScheduler
from rd2h.app.connector.roles import RequestFacts, ScheduledRequest
from rd2h.app.settings import Rd2hSettings
from rd2h.bootstrap.container import bootstrap

SUFFIX = "-0a1b2c3d"
A, C = "a" + SUFFIX, "c" + SUFFIX
EP = DecodeEndpoint("10.0.0.9", 31000, 1, "")
PARAMS = {"do_remote_decode": True, "remote_host": "10.0.0.9", "remote_port": 31000}


def _sched(log: RecordingLogger | None = None) -> PrefillScheduler:
    container = bootstrap(Rd2hSettings(role="prefill"), logger=log or RecordingLogger())
    return container.prefill_scheduler(block_size=4, main_group=0, indexer_group=0)


def _track(s: PrefillScheduler, rid: str, prompt_tokens: int) -> None:
    """vLLM allocated a new request's blocks (``update_state_after_alloc``)."""
    s.update_state_after_alloc(RequestFacts(rid, prompt_tokens, prompt_tokens, 0, PARAMS),
                               ([],), 0)


def _run(s: PrefillScheduler, rid: str, blocks: list[int] | None, computed: int, n: int,
         *, replace: bool = False, preempted: tuple[str, ...] = ()):
    s.requests_preempted(preempted)
    ids = None if blocks is None else (tuple(blocks),)
    return s.build_connector_meta([ScheduledRequest(rid, ids, computed, n, replace)])


def test_a_preempted_request_with_announced_blocks_is_named_once() -> None:
    log = RecordingLogger()
    s = _sched(log)
    _track(s, A, 20)
    assert _run(s, A, [1, 2, 3, 4, 5], 0, 8, replace=True).sends == (
        PrefillSend(A, "a", EP, (1, 2), (1, 2), 0, 0, False, groups=((0, (1, 2)),)),)
    s.requests_preempted([A, A])  # vLLM's set, and the same id again
    plan = s.build_connector_meta([])
    assert plan.preempted == (A,) and plan.sends == ()
    assert s.build_connector_meta([]).preempted == ()  # named in one plan only
    assert s.preempted == 1
    (kw,) = [kw for e, kw in log.at("info") if e.startswith("request preempted")]
    assert kw == {"request": A, "announced_tokens": 8, "final_sent": False}


def test_requests_with_nothing_announced_are_not_named() -> None:
    s = _sched()
    _track(s, A, 20)
    _track(s, C, 20)
    _run(s, A, [1, 2, 3, 4, 5], 0, 3, replace=True)  # less than a block: nothing sent
    plan = _run(s, C, [6, 7, 8, 9, 10], 0, 4, replace=True, preempted=(A, "local" + SUFFIX))
    assert plan.preempted == () and len(plan.sends) == 1


def test_resumed_from_scratch_announces_only_what_decode_has_not_read() -> None:
    s = _sched()
    _track(s, A, 18)
    _run(s, A, [1, 2, 3, 4, 5], 0, 8, replace=True)  # blocks 0, 1 announced
    assert _run(s, "other", [1, 2], 0, 8, replace=True, preempted=(A,)).preempted == (A,)
    # vLLM recomputes A from token 0 into a new block table.
    assert _run(s, A, [6, 7, 8, 9, 10], 0, 4, replace=True).sends == ()
    assert _run(s, A, None, 4, 4).sends == ()  # back at 8 tokens: nothing new
    (last,) = _run(s, A, None, 8, 10).sends
    assert last == PrefillSend(A, "a", EP, (8, 9, 10), (8, 9, 10), 2, 2, True,
                               groups=((2, (8, 9, 10)),))
    assert s.request_finished(A) is True  # blocks wait for the sends


def test_resumed_with_a_prefix_hit_announces_from_where_it_stopped() -> None:
    s = _sched()
    _track(s, A, 18)
    _run(s, A, [1, 2, 3, 4, 5], 0, 8, replace=True)
    s.requests_preempted([A])
    # Resumed with 12 tokens found in Prefill's prefix cache (its old blocks 1, 2 and a
    # block another request computed), the first chunk computes tokens 12..16.
    (send,) = _run(s, A, [1, 2, 11, 12, 13], 12, 4, replace=True).sends
    assert (send.main_block_ids, send.main_start, send.final) == ((11, 12), 2, False)


def test_preempted_after_its_final_chunk_is_not_announced_again() -> None:
    s = _sched()
    _track(s, A, 8)
    (send,) = _run(s, A, [1, 2], 0, 8, replace=True).sends
    assert send.final
    assert _run(s, "other", [1, 2], 0, 4, replace=True, preempted=(A,)).preempted == (A,)
    assert _run(s, A, [3, 4], 0, 8, replace=True).sends == ()  # recomputed: nothing new
    assert s.request_finished(A) is True


# ================================================================ the vLLM adapter

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.config import KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.request import Request  # noqa: E402

from rd2h.bootstrap.container import InPlaceOf  # noqa: E402
from rd2h.entry.connector import SfaRemoteD2HConnector  # noqa: E402


def _config(kv_role: str) -> VllmConfig:
    return VllmConfig(kv_transfer_config=KVTransferConfig(
        kv_connector="SfaRemoteD2HConnector",
        kv_connector_module_path="rd2h.entry.connector",
        kv_role=kv_role, kv_port=41000, engine_id=f"engine-{kv_role}"))


def _caches() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=64, dtype=torch.float32)
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])


def _output(new: list[Any], counts: dict[str, int], preempted: set[str]) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=new, scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens=counts, total_num_scheduled_tokens=sum(counts.values()),
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
        finished_req_ids=set(), free_encoder_mm_hashes=[], preempted_req_ids=preempted)


# The scheduler roles' containers post through a recording metaserver (no HTTP).
NO_METASERVER = {"metaserver": InPlaceOf(RecordingMetaserver)}


@pytest.mark.parametrize(("kv_role", "delivers"), [("kv_producer", True),
                                                   ("kv_consumer", False)])
@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_only_prefill_requires_kv_delivery(kv_role, delivers, role) -> None:
    conn = SfaRemoteD2HConnector(_config(kv_role), role, _caches(), overrides=NO_METASERVER)
    assert conn.requires_kv_delivery is delivers
    conn.shutdown()


def test_vllm_preempted_ids_reach_the_plan_of_that_step() -> None:
    conn = SfaRemoteD2HConnector(_config("kv_producer"), KVConnectorRole.SCHEDULER,
                                 _caches())
    params = {**PARAMS, "remote_port": 42000}
    req = Request(A, list(range(100, 112)), SamplingParams(
        max_tokens=1, extra_args={"kv_transfer_params": params}), None)
    conn.update_state_after_alloc(req, KVCacheBlocks(([KVCacheBlock(1), KVCacheBlock(2),
                                                       KVCacheBlock(3)],)), 0)
    first = conn.build_connector_meta(_output(
        [NewRequestData.from_request(req, ([1, 2, 3],))], {A: 8}, set()))
    assert len(first.plan.sends) == 1 and first.plan.preempted == ()
    meta = conn.build_connector_meta(_output([], {}, {A, "never-seen" + SUFFIX}))
    assert meta.plan.preempted == (A,)
    # The scheduler-side connector has no worker role: nothing to wait for there.
    conn.handle_preemptions(meta)
    conn.shutdown()
