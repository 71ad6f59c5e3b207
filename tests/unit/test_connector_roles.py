"""The connector's four roles as plain services (no vLLM), driven through their hooks
with the plain values ``rd2h.entry.translate`` makes of vLLM's: Decode scheduler (spec 3.1),
Prefill scheduler (3.2), Prefill worker over a real ``PrefillSender`` and Decode worker
over a real ``DecodeReceiver``, each built by its container (the shared rig) over the
in-memory control network (no sockets); plus the per-announcement
tickets that tell Prefill when a finished request's blocks may be freed (the ticket rules
themselves: ``test_prefill_session``).

Waits are on conditions with deadlines; the clock is controllable (real time plus an
offset a test can jump forward), so deadlines are reached without sleeping."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import numpy as np
import pytest
from fakes.clock import ManualClock
from fakes.control import ScriptedDecode
from fakes.logs import RecordingLogger as RecordingLog
from fakes.metaserver import RecordingMetaserver
from fakes.rig import Rig

from rd2h.adapters.logging.timeline import JsonlTimeline
from rd2h.adapters.msgpack import MsgpackCodec
from rd2h.app.connector.decode_scheduler import DecodeScheduler
from rd2h.app.connector.plans import DecodeEndpoint, DecodeLoad, PrefillSend, StepPlan
from rd2h.app.connector.prefill_scheduler import (
    PrefillScheduler,
    TransferParamsError,
    decode_endpoint,
    resolve_params,
)
from rd2h.app.connector.prefill_worker import PrefillWorker
from rd2h.app.connector.roles import RequestFacts, ScheduledRequest
from rd2h.app.prefill import PrefillSender
from rd2h.app.settings import Rd2hSettings
from rd2h.app.timeline import load
from rd2h.bootstrap.container import bootstrap
from rd2h.domain.errors import LayerSendError, TopologyError
from rd2h.domain.planning.chunks import external_request_id
from rd2h.domain.planning.layout import DestinationLayout, DestTensor, SourceLayout, TensorComponent
from rd2h.domain.wire.protocol import ReadRequest

SUFFIX = "-0a1b2c3d"  # vLLM's 9-character engine suffix
assert len(SUFFIX) == 9
WAIT = 5.0  # deadline of every wait in these tests (they normally take milliseconds)


# ================================================================ the rig

CODEC = MsgpackCodec()  # what the scripted Decode endpoints speak
# Every Decode endpoint the Prefill worker tests announce to.
DECODE_EPS = ["tcp://10.0.0.9:31000", "tcp://10.0.0.9:31001", "tcp://10.0.0.9:32000"]


@pytest.fixture
def rig():
    """The shared rig over the in-memory control network, with a manual clock."""
    r = Rig(control="memory", clock=ManualClock())
    yield r
    r.close()


@pytest.fixture
def scripted(rig):
    """Scripted Decode endpoints (``DECODE_EPS``) on the rig's network."""
    def make(default: str = "done") -> ScriptedDecode:
        decode = ScriptedDecode(rig.net, DECODE_EPS, CODEC, default)
        rig.on_close(decode.close)
        return decode

    return make


def _dsched_of(ms: RecordingMetaserver, log: RecordingLog, *, host: str = "10.1.2.3",
               tp_size: int = 2, **kw: Any) -> DecodeScheduler:
    """Decode's scheduler role from its container (``kw``: the provider's keywords)."""
    container = bootstrap(Rd2hSettings(role="decode", host=host, tp_size=tp_size),
                          metaserver=ms, logger=log)
    return container.decode_scheduler(**{"base_port": 31004, "engine_id": "decode-engine",
                                         **kw})


# ================================================================ Decode scheduler

RID = "cmpl-42-0" + SUFFIX
EXT = "cmpl-42-0"
URL = "http://proxy:8000/v1/metaserver"


def _params(**extra: Any) -> dict[str, Any]:
    return {"do_remote_prefill": True, "metaserver": URL, **extra}


def _req(rid: str, params: dict[str, Any] | None, prompt_len: int = 0,
         computed: int = 0) -> RequestFacts:
    """A vLLM request as the hooks take it: ``computed`` is ``request.num_computed_tokens``
    (still 0 when vLLM calls ``update_state_after_alloc`` for a new request)."""
    return RequestFacts(rid, prompt_len, prompt_len, computed, params)


def _admit(sched: DecodeScheduler, counts: dict[str, int]) -> int:
    """``update_connector_output`` with the workers' admissions: how many it posted."""
    before = sched.posts
    sched.update_connector_output(counts)
    return sched.posts - before


@pytest.fixture
def dsched():
    ms = RecordingMetaserver()
    log = RecordingLog()
    return _dsched_of(ms, log), ms, log


def test_match_reports_the_rest_of_the_prompt_as_async(dsched) -> None:
    sched, _, _ = dsched
    assert sched.get_num_new_matched_tokens(_req(RID, _params(), 100), 0) == (100, True)
    assert sched.get_num_new_matched_tokens(_req("other" + SUFFIX, _params(), 100),
                                            32) == (68, True)
    assert sched.counters()["remote"] == 2


@pytest.mark.parametrize("params", [None, {}, {"do_remote_prefill": False}, {"metaserver": URL}])
def test_match_ignores_requests_without_remote_prefill(dsched, params) -> None:
    sched, _, _ = dsched
    assert sched.get_num_new_matched_tokens(_req(RID, params, 100), 0) == (0, False)
    assert sched.counters()["remote"] == 0


def test_match_with_everything_computed_loads_nothing(dsched) -> None:
    sched, ms, _ = dsched
    params = _params()
    assert sched.get_num_new_matched_tokens(_req(RID, params, 64), 64) == (0, False)
    sched.update_state_after_alloc(_req(RID, params, 64, computed=64), ([1, 2],), 0)
    assert params["do_remote_prefill"] is False
    assert sched.build_connector_meta([]).loads == () and sched.counters() == {
        "remote": 0, "waiting_post": 0, "queued_loads": 0}
    assert _admit(sched, {RID: 2}) == 0 and ms.posts == []


def test_after_alloc_records_destinations_and_clears_the_flag() -> None:
    ms = RecordingMetaserver()
    sched = _dsched_of(ms, RecordingLog(), main_group=0, indexer_group=1)
    params = _params()
    sched.get_num_new_matched_tokens(_req(RID, params, 70), 0)
    sched.update_state_after_alloc(_req(RID, params, 70), ([7, 8, 9], [3, 4, 5]), 70)
    assert params["do_remote_prefill"] is False
    assert sched.build_connector_meta([]).loads == (
        DecodeLoad(RID, (7, 8, 9), (3, 4, 5), ((7, 8, 9), (3, 4, 5))),)
    assert sched.build_connector_meta([]).loads == ()  # handed to the workers once
    assert ms.posts == []  # nothing posted before the workers admitted it


def test_after_alloc_with_one_group_uses_it_for_the_indexer_too(dsched) -> None:
    sched, _, _ = dsched
    params = _params()
    sched.get_num_new_matched_tokens(_req(RID, params, 70), 0)
    sched.update_state_after_alloc(_req(RID, params, 70), ([7, 8, 9],), 70)
    assert sched.build_connector_meta([]).loads == (
        DecodeLoad(RID, (7, 8, 9), (7, 8, 9), ((7, 8, 9),)),)


def test_after_alloc_ignores_requests_it_did_not_match(dsched) -> None:
    sched, ms, _ = dsched
    sched.update_state_after_alloc(_req(RID, None, 32), ([1],), 32)  # not a remote prefill
    params = _params()
    sched.update_state_after_alloc(_req(RID, params, 32), ([1],), 32)  # never matched
    assert params["do_remote_prefill"] is False
    assert sched.build_connector_meta([]).loads == ()
    assert _admit(sched, {RID: 2}) == 0 and ms.posts == []


def test_post_waits_for_every_tp_rank_and_carries_the_spec_payload(dsched) -> None:
    sched, ms, _ = dsched
    params = _params()
    sched.get_num_new_matched_tokens(_req(RID, params, 100), 32)  # 32 hit D's prefix cache
    # vLLM calls update_state_after_alloc before it sets request.num_computed_tokens:
    # the local hit known from the match is what D already has.
    sched.update_state_after_alloc(_req(RID, params, 100), ([5, 6, 7, 8],), 68)
    sched.build_connector_meta([])
    assert _admit(sched, {RID: 1}) == 0 and ms.posts == []  # rank 0 only
    assert _admit(sched, {"unknown" + SUFFIX: 2}) == 0
    assert _admit(sched, {RID: 1}) == 1  # rank 1: everyone admitted
    assert ms.posts == [(EXT, URL, {
        "request_id": EXT,
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_engine_id": "decode-engine",
        "remote_host": "10.1.2.3",
        "remote_port": 31004,
        "remote_tp_size": 2,
        "remote_pcp_size": 1,
        "remote_dcp_size": 1,
        "remote_cached_tokens": 32,
    })]
    assert _admit(sched, {RID: 2}) == 0 and len(ms.posts) == 1  # posted once
    assert sched.posts == 1


def test_admission_counts_summed_over_ranks_in_one_report(dsched) -> None:
    sched, ms, _ = dsched
    params = _params()
    sched.get_num_new_matched_tokens(_req(RID, params, 64), 0)
    sched.update_state_after_alloc(_req(RID, params, 64), ([1, 2],), 64)
    assert _admit(sched, {RID: 2}) == 1 and ms.posts[0][0] == EXT


def test_do_virtual_suppresses_the_post(dsched) -> None:
    sched, ms, _ = dsched
    params = _params(do_virtual=True)
    sched.get_num_new_matched_tokens(_req(RID, params, 64), 0)
    sched.update_state_after_alloc(_req(RID, params, 64), ([1, 2],), 64)
    assert sched.build_connector_meta([]).loads == (
        DecodeLoad(RID, (1, 2), (1, 2), ((1, 2),)),)  # loaded
    assert _admit(sched, {RID: 2}) == 0 and ms.posts == [] and sched.posts == 0


def test_a_metaserver_that_is_not_a_url_is_logged_not_posted(dsched) -> None:
    sched, ms, log = dsched
    params = _params(metaserver=1234)
    sched.get_num_new_matched_tokens(_req(RID, params, 64), 0)
    sched.update_state_after_alloc(_req(RID, params, 64), ([1, 2],), 64)
    assert _admit(sched, {RID: 2}) == 0 and ms.posts == []
    assert any(kw.get("request") == RID for _, kw in log.at("warning"))


def test_an_unpostable_request_is_logged_and_others_still_post() -> None:
    ms = RecordingMetaserver(fail_with=ValueError("bad URL scheme"))
    log = RecordingLog()
    sched = _dsched_of(ms, log, host="h", tp_size=1, base_port=1, engine_id="e")
    params = _params()
    sched.get_num_new_matched_tokens(_req(RID, params, 64), 0)
    sched.update_state_after_alloc(_req(RID, params, 64), ([1, 2],), 64)
    assert _admit(sched, {RID: 1}) == 0
    (_, kw), = log.at("error")
    assert kw["request"] == RID and "bad URL scheme" in kw["error"]


def test_the_scheduler_stamps_match_alloc_admission_and_received_kv(tmp_path) -> None:
    stamps = JsonlTimeline(tmp_path)
    sched = _dsched_of(RecordingMetaserver(), RecordingLog(), host="h", base_port=1,
                       engine_id="e", timeline=stamps)
    rid = "cmpl-" + "cd" * 16 + "-0" + SUFFIX
    params = _params()
    sched.get_num_new_matched_tokens(_req(rid, params, 70), 0)
    sched.update_state_after_alloc(_req(rid, params, 70), ([7, 8, 9],), 70)
    sched.update_connector_output({rid: 1})
    assert "decode.admitted_all" not in load(tmp_path).get("cd" * 16, {})  # one rank of 2
    sched.update_connector_output({rid: 1})
    sched.update_connector_output({}, [rid])
    sched.build_connector_meta([ScheduledRequest(rid, None, 69, 1, False)])
    sched.build_connector_meta([ScheduledRequest(rid, None, 70, 1, False)])  # stamped once
    hops = load(tmp_path)["cd" * 16]
    order = ["decode.matched", "decode.allocated", "decode.admitted_all", "decode.kv_ready",
             "decode.scheduled"]
    assert sorted(hops, key=hops.__getitem__) == order


def test_finished_cancels_the_post_and_forgets_the_request(dsched) -> None:
    sched, ms, _ = dsched
    params = _params()
    sched.get_num_new_matched_tokens(_req(RID, params, 64), 0)
    sched.update_state_after_alloc(_req(RID, params, 64), ([1, 2],), 64)
    assert sched.request_finished(RID) is False  # before the workers saw it; nothing held
    assert ms.cancels == [EXT]
    assert sched.build_connector_meta([]).loads == ()
    assert sched.counters() == {"remote": 0, "waiting_post": 0, "queued_loads": 0}
    assert _admit(sched, {RID: 2}) == 0 and ms.posts == []
    assert sched.request_finished("never-seen" + SUFFIX) is False
    assert ms.cancels == [EXT]  # nothing to cancel for a request never waiting


def test_shutdown_drops_everything_and_stops_the_metaserver(dsched) -> None:
    sched, ms, _ = dsched
    params = _params()
    sched.get_num_new_matched_tokens(_req(RID, params, 64), 0)
    sched.update_state_after_alloc(_req(RID, params, 64), ([1, 2],), 64)
    sched.shutdown(2.5)
    assert ms.shutdowns == [2.5]
    assert sched.build_connector_meta([]).loads == ()
    assert _admit(sched, {RID: 2}) == 0 and ms.posts == []


# ================================================================ Prefill scheduler

D_PARAMS = {
    "do_remote_decode": True, "remote_host": "10.0.0.9", "remote_port": 31000,
    "remote_tp_size": 1, "remote_engine_id": "d0", "remote_cached_tokens": 0,
}


def _psched(block_size: int = 4, *, indexer_group: int = 0, p_tp: int = 1):
    log = RecordingLog()
    container = bootstrap(Rd2hSettings(role="prefill", tp_size=p_tp), logger=log)
    return container.prefill_scheduler(block_size=block_size, main_group=0,
                                       indexer_group=indexer_group), log


def _track(sched: PrefillScheduler, rid: str, prompt_tokens: int,
           params: dict[str, Any] | None) -> int:
    """``update_state_after_alloc`` of a new request: how many requests are tracked."""
    sched.update_state_after_alloc(RequestFacts(rid, prompt_tokens, prompt_tokens, 0, params),
                                   ([],), 0)
    return sched.counters()["tracked"]


def _step(sched: PrefillScheduler, rid: str, new_blocks: tuple[list[int], ...] | None,
          computed: int, scheduled: int, *, replace: bool = False) -> PrefillSend | None:
    """``build_connector_meta`` of a step scheduling this one request: its send, if any."""
    plan = sched.build_connector_meta(
        [ScheduledRequest(rid, new_blocks, computed, scheduled, replace)])
    assert len(plan.sends) <= 1 and plan.preempted == ()
    return plan.sends[0] if plan.sends else None


def test_track_only_remote_decode_requests() -> None:
    sched, _ = _psched()
    assert _track(sched, "a" + SUFFIX, 10, None) == 0
    assert _track(sched, "a" + SUFFIX, 10, {"do_remote_decode": False}) == 0
    assert _track(sched, "a" + SUFFIX, 10, D_PARAMS) == 1
    assert _track(sched, "a" + SUFFIX, 10, None) == 1  # idempotent: already tracked
    assert sched.counters() == {"tracked": 1, "rejected": 0}


def test_chunked_prefill_announces_completed_blocks_then_the_partial_last_one() -> None:
    sched, _ = _psched(block_size=4)
    rid = "chunky" + SUFFIX
    _track(sched, rid, 14, D_PARAMS)
    ep = DecodeEndpoint("10.0.0.9", 31000, 1, "d0")
    # step 1: 6 tokens -> block 0 complete, block 1 half written
    s1 = _step(sched, rid, ([10, 11],), 0, 6, replace=True)
    assert s1 == PrefillSend(rid, "chunky", ep, (10,), (10,), 0, 0, False, groups=((0, (10,)),))
    # step 2: 1 token -> still inside block 1: nothing new completed
    assert _step(sched, rid, None, 6, 1) is None
    # step 3: 5 tokens (12) -> blocks 1, 2 complete
    s3 = _step(sched, rid, ([12],), 7, 5)
    assert (s3.main_block_ids, s3.main_start, s3.final) == ((11, 12), 1, False)
    # step 4: the final 2 tokens (14) -> the partial block 3 goes with the final chunk
    s4 = _step(sched, rid, ([13],), 12, 2)
    assert (s4.main_block_ids, s4.main_start, s4.indexer_start, s4.final) == (
        (13,), 3, 3, True)
    assert _step(sched, rid, None, 14, 1) is None  # decode steps after the final chunk
    assert sched.request_finished(rid) is True
    assert sched.counters()["tracked"] == 0


def test_indexer_blocks_come_from_the_indexer_group() -> None:
    sched, _ = _psched(block_size=4, indexer_group=1)
    _track(sched, "r" + SUFFIX, 8, D_PARAMS)
    s = _step(sched, "r" + SUFFIX, ([1, 2], [101, 102]), 0, 8, replace=True)
    assert (s.main_block_ids, s.indexer_block_ids, s.final) == ((1, 2), (101, 102), True)


def test_remote_cached_tokens_are_not_sent_again() -> None:
    sched, _ = _psched(block_size=4)
    _track(sched, "r" + SUFFIX, 10, {**D_PARAMS, "remote_cached_tokens": 8})
    s = _step(sched, "r" + SUFFIX, ([1, 2, 3],), 0, 10, replace=True)
    assert (s.main_block_ids, s.main_start, s.final) == ((3,), 2, True)


def test_everything_cached_remotely_still_sends_the_final_marker() -> None:
    sched, _ = _psched(block_size=4)
    _track(sched, "r" + SUFFIX, 8, {**D_PARAMS, "remote_cached_tokens": 8})
    s = _step(sched, "r" + SUFFIX, ([1, 2],), 0, 8, replace=True)
    assert s is not None and s.final and s.main_block_ids == () and s.main_start == 2


def test_resumed_request_replaces_its_blocks() -> None:
    sched, _ = _psched(block_size=4)
    rid = "pre" + SUFFIX
    _track(sched, rid, 12, D_PARAMS)
    assert _step(sched, rid, ([1, 2],), 0, 8, replace=True).main_block_ids == (1, 2)
    # preempted, then resumed with new blocks for the whole request so far
    s = _step(sched, rid, ([7, 8, 9],), 8, 4, replace=True)
    assert (s.main_block_ids, s.main_start, s.final) == ((9,), 2, True)


def test_appended_blocks_extend_every_group() -> None:
    sched, _ = _psched(block_size=2, indexer_group=1)
    rid = "g" + SUFFIX
    _track(sched, rid, 6, D_PARAMS)
    _step(sched, rid, ([1], [11]), 0, 2, replace=True)
    s = _step(sched, rid, ([2, 3], [12, 13]), 2, 4)
    assert (s.main_block_ids, s.indexer_block_ids) == ((2, 3), (12, 13))


def test_a_chunk_beyond_the_allocated_blocks_drops_the_request_with_an_error() -> None:
    sched, log = _psched(block_size=4)
    rid = "short" + SUFFIX
    _track(sched, rid, 16, D_PARAMS)
    assert _step(sched, rid, ([1],), 0, 8, replace=True) is None
    (_, kw), = log.at("error")
    assert kw["request"] == rid and "only 1 blocks are allocated" in kw["error"]
    assert sched.counters()["tracked"] == 0 and sched.request_finished(rid) is False


def test_a_chunk_error_after_earlier_sends_keeps_the_blocks_until_sent() -> None:
    sched, log = _psched(block_size=4)
    rid = "cut" + SUFFIX
    _track(sched, rid, 16, D_PARAMS)
    assert _step(sched, rid, ([1, 2],), 0, 8, replace=True) is not None
    assert _step(sched, rid, None, 8, 8) is None  # ends at block 4, only 2 allocated
    assert "only 2 blocks are allocated" in log.at("error")[0][1]["error"]
    assert _step(sched, rid, ([3, 4],), 16, 1) is None  # no more announcements
    # Block 0..1 were announced: vLLM must wait for finished_sending before freeing them
    # (and the worker will report it: vLLM asserts the request still exists then).
    assert sched.request_finished(rid) is True
    assert sched.counters()["tracked"] == 0


def test_untracked_requests_are_not_scheduled() -> None:
    sched, _ = _psched()
    assert _step(sched, "local" + SUFFIX, ([1],), 0, 4, replace=True) is None
    assert sched.request_finished("local" + SUFFIX) is False


def test_finished_before_any_send_frees_at_once() -> None:
    sched, _ = _psched(block_size=4)
    _track(sched, "r" + SUFFIX, 16, D_PARAMS)
    assert _step(sched, "r" + SUFFIX, ([1],), 0, 2, replace=True) is None
    assert sched.request_finished("r" + SUFFIX) is False  # nothing announced: nothing to wait
    assert sched.counters()["tracked"] == 0


def test_batch_params_resolved_by_external_id() -> None:
    sched, _ = _psched(block_size=4)
    batch = {
        "do_remote_decode": True,
        "batch_kv_transfer_params": {
            "list-0": {**D_PARAMS, "remote_port": 31000},
            "list-1": {**D_PARAMS, "remote_port": 32000, "remote_cached_tokens": 4},
        },
    }
    assert _track(sched, "list-0" + SUFFIX, 8, batch) == 1
    assert _track(sched, "list-1" + SUFFIX, 8, batch) == 2
    plan = sched.build_connector_meta(  # one step scheduling both
        [ScheduledRequest("list-0" + SUFFIX, ([1, 2],), 0, 8, True),
         ScheduledRequest("list-1" + SUFFIX, ([3, 4],), 0, 8, True)])
    s0, s1 = plan.sends
    assert (s0.ext_id, s0.decode.base_port, s0.main_block_ids) == ("list-0", 31000, (1, 2))
    assert (s1.ext_id, s1.decode.base_port, s1.main_block_ids) == ("list-1", 32000, (4,))


def test_missing_batch_entry_is_a_clear_error() -> None:
    batch = {"do_remote_decode": True, "batch_kv_transfer_params": {"list-0": D_PARAMS}}
    with pytest.raises(TransferParamsError, match=r"no entry for request 'list-7'.*list-0"):
        resolve_params("list-7", batch)
    with pytest.raises(TransferParamsError, match="must be an object"):
        resolve_params("x", {"do_remote_decode": True, "batch_kv_transfer_params": [1]})
    sched, log = _psched()
    assert _track(sched, "list-7" + SUFFIX, 8, batch) == 0
    (_, kw), = log.at("error")
    assert kw["request"] == "list-7" + SUFFIX and "'list-7'" in kw["error"]
    assert sched.counters() == {"tracked": 0, "rejected": 1}


@pytest.mark.parametrize("key", ["remote_pcp_size", "remote_dcp_size"])
def test_context_parallel_decode_is_rejected(key) -> None:
    with pytest.raises(TransferParamsError, match=f"{key} must be 1"):
        decode_endpoint({**D_PARAMS, key: 2}, 1)
    sched, log = _psched()
    assert _track(sched, "r" + SUFFIX, 8, {**D_PARAMS, key: 2}) == 0
    assert key in log.at("error")[0][1]["error"]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"remote_host": ""}, "remote_host"),
        ({"remote_port": "31000"}, "remote_port"),
        ({"remote_port": 70000}, "outside"),
        ({"remote_tp_size": True}, "remote_tp_size"),
        ({"remote_cached_tokens": -1}, "remote_cached_tokens"),
    ],
)
def test_bad_contact_info_is_rejected_naming_the_key(change, match) -> None:
    with pytest.raises(TransferParamsError, match=match):
        decode_endpoint({**D_PARAMS, **change}, 1)


def test_tp_sizes_that_do_not_divide_are_rejected() -> None:
    with pytest.raises(TopologyError, match="prefill TP 2 and decode TP 3"):
        decode_endpoint({**D_PARAMS, "remote_tp_size": 3}, 2)
    sched, _ = _psched(p_tp=2)
    assert _track(sched, "r" + SUFFIX, 8, {**D_PARAMS, "remote_tp_size": 3}) == 0


def test_decode_tp_above_prefill_tp_is_accepted() -> None:
    """Decode TP 2 behind a Prefill TP 1 (fan-out 2: docs/guide/vllm.md "Topologies")."""
    assert decode_endpoint({**D_PARAMS, "remote_tp_size": 2}, 1)[0].tp_size == 2


# ================================================================ Prefill worker

LAYERS = 3
NAMES = {i: f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)}


def _send(rid: str, blocks: tuple[int, ...], start: int, final: bool, *,
          port: int = 31000, d_tp: int = 1) -> PrefillSend:
    ext = rid[: -len(SUFFIX)]
    return PrefillSend(rid, ext, DecodeEndpoint("10.0.0.9", port, d_tp), blocks, blocks,
                       start, start, final)


@pytest.fixture
def pworker(rig):
    """A started Prefill worker role (and its sender) from the rig's container; it
    announces to the scripted Decode endpoints on the rig's network."""
    def make(*, p_rank: int = 0, p_tp: int = 1, buffer_reuse: bool = False,
             log: RecordingLog | None = None, min_announce_bytes: int = 0) -> PrefillWorker:
        """``min_announce_bytes`` 0 (these tests': every layer goes as it is written)."""
        layouts = {i: SourceLayout(NAMES[i], (TensorComponent(0x100000 * (i + 1), 64),))
                   for i in NAMES}
        return rig.prefill_worker(
            layouts, "p-session", log=log, reuse_timeout_s=0.05,
            settings={"tp_size": p_tp, "tp_rank": p_rank, "buffer_reuse": buffer_reuse,
                      "limits": {"min_announce_bytes": min_announce_bytes}})

    return make


def _sender(worker: PrefillWorker) -> PrefillSender:
    return worker.sender  # the test drains it to know every reply was handled


def _announced(worker: PrefillWorker, layer_name: str) -> bool:
    """``save_kv_layer``: whether it announced the layer (``layers_announced`` counts)."""
    before = worker.layers_announced
    worker.save_kv_layer(layer_name)
    return worker.layers_announced > before


def _released(worker: PrefillWorker, finished_by_vllm: set[str]) -> frozenset[str]:
    """``get_transfer_results``: the requests whose blocks vLLM may free now."""
    return worker.get_transfer_results(finished_by_vllm).finished_sending


def _write_all_layers(worker: PrefillWorker) -> list[bool]:
    return [_announced(worker, NAMES[i]) for i in range(LAYERS)]


def test_each_layer_is_announced_once_per_step(pworker, scripted) -> None:
    decode = scripted()
    worker = pworker()
    rid = "a" + SUFFIX
    worker.bind_connector_metadata(StepPlan(sends=(_send(rid, (4, 5), 0, False),)))
    assert _announced(worker, NAMES[0]) is True
    assert _announced(worker, NAMES[0]) is False  # second hook of the same layer
    assert _announced(worker, NAMES[1]) and _announced(worker, NAMES[2])
    batches = decode.wait_batches(3)
    assert [b.layer_idx for _, b in batches] == [0, 1, 2]
    assert all(b.read_reqs == (ReadRequest("a", (4, 5), (4, 5), 0, 0),) for _, b in batches)
    assert all(b.done_ext_ids == () for _, b in batches)  # not the final chunk
    assert decode.metas == ["tcp://10.0.0.9:31000"]  # MF_META once per connection
    # the next step announces again
    worker.bind_connector_metadata(StepPlan(sends=(_send(rid, (6,), 2, False),)))
    assert _announced(worker, NAMES[0])
    assert decode.wait_batches(4)[-1][1].read_reqs[0].main_start_block == 2
    assert worker.layers_announced == 4


def test_small_layers_are_held_until_the_forward_ends(pworker, scripted) -> None:
    """Layers whose reads name less than ``min_announce_bytes`` (here 2 blocks x 64 B)
    are held back; ``wait_for_save`` (vLLM's, after every forward) sends them, in order,
    the request's final report on the last."""
    decode = scripted()
    worker = pworker(min_announce_bytes=4096)
    sender = _sender(worker)
    rid = "h" + SUFFIX
    worker.bind_connector_metadata(StepPlan(sends=(_send(rid, (4, 5), 0, True),)))
    assert _write_all_layers(worker) == [True, True, True]
    assert sender.held == 3 and decode.batches == []  # never reached the sender's thread
    worker.wait_for_save()
    assert sender.held == 0
    batches = [b for _, b in decode.wait_batches(3)]
    assert [b.layer_idx for b in batches] == [0, 1, 2]
    assert [b.done_ext_ids for b in batches] == [(), (), ("h",)]
    assert sender.drain(WAIT)


def test_held_layers_go_once_they_name_min_announce_bytes(pworker, scripted) -> None:
    """A layer that brings what is held to ``min_announce_bytes`` goes at once with
    them; a layer that reaches it alone is never held."""
    decode = scripted()
    worker = pworker(min_announce_bytes=256)  # two layers of 2 blocks x 64 B
    sender = _sender(worker)
    worker.bind_connector_metadata(StepPlan(sends=(_send("t" + SUFFIX, (4, 5), 0, False),)))
    _announced(worker, NAMES[0])
    assert sender.held == 1
    _announced(worker, NAMES[1])
    assert sender.held == 0
    assert [b.layer_idx for _, b in decode.wait_batches(2)] == [0, 1]
    _announced(worker, NAMES[2])
    assert sender.held == 1
    worker.wait_for_save()
    assert [b.layer_idx for _, b in decode.wait_batches(3)] == [0, 1, 2]
    # Four blocks a layer (256 B): each goes as it is written.
    worker.bind_connector_metadata(StepPlan(sends=(_send("t" + SUFFIX, (6, 7, 8, 9), 2,
                                                         True),)))
    for i in range(LAYERS):
        _announced(worker, NAMES[i])
        assert sender.held == 0
    assert len(decode.wait_batches(6)) == 6
    assert sender.drain(WAIT)


def test_the_next_step_sends_what_a_step_held(pworker, scripted) -> None:
    """A step whose ``wait_for_save`` did not come (deferred finalize) still sends what it
    held when the next step binds, before that step announces anything."""
    decode = scripted()
    worker = pworker(min_announce_bytes=4096)
    rid = "n" + SUFFIX
    worker.bind_connector_metadata(StepPlan(sends=(_send(rid, (1,), 0, False),)))
    _write_all_layers(worker)
    assert _sender(worker).held == 3
    worker.bind_connector_metadata(StepPlan(sends=(_send(rid, (2,), 1, True),)))
    assert _sender(worker).held == 0
    assert [b.layer_idx for _, b in decode.wait_batches(3)] == [0, 1, 2]


def test_a_step_without_sends_and_unknown_layers_announce_nothing(pworker, scripted) -> None:
    decode = scripted()
    worker = pworker()
    worker.bind_connector_metadata(StepPlan())
    assert _write_all_layers(worker) == [False, False, False]
    worker.bind_connector_metadata(StepPlan(sends=(_send("a" + SUFFIX, (1,), 0, True),)))
    assert _announced(worker, "model.layers.9.self_attn.attn") is False
    assert worker.layers_announced == 0 and decode.batches == []


def test_done_only_on_the_last_layer_of_the_final_chunk(pworker, scripted) -> None:
    decode = scripted()
    worker = pworker()
    rid = "fin" + SUFFIX
    worker.bind_connector_metadata(StepPlan(sends=(_send(rid, (1,), 0, False),)))
    _write_all_layers(worker)
    worker.bind_connector_metadata(StepPlan(sends=(_send(rid, (2, 3), 1, True),)))
    _write_all_layers(worker)
    batches = [b for _, b in decode.wait_batches(6)]
    assert [b.done_ext_ids for b in batches] == [(), (), (), (), (), ("fin",)]
    assert batches[5].read_reqs == (ReadRequest("fin", (2, 3), (2, 3), 1, 1),)


def test_a_final_chunk_without_blocks_sends_only_the_done_marker(pworker, scripted) -> None:
    decode = scripted()
    worker = pworker()
    worker.bind_connector_metadata(StepPlan(sends=(_send("cached" + SUFFIX, (), 2, True),)))
    assert _write_all_layers(worker) == [False, False, True]
    (_, batch), = decode.wait_batches(1)
    assert (batch.layer_idx, batch.read_reqs, batch.done_ext_ids) == (2, (), ("cached",))


@pytest.mark.parametrize(
    ("p_tp", "p_rank", "d_tp", "port", "member", "ratio"),
    [(2, 1, 2, 31001, 0, 1),  # ratio 1: P rank 1 -> D rank 1
     (2, 1, 1, 31000, 1, 2),  # ratio 2: P rank 1 -> D rank 0, second contributor
     (4, 2, 2, 31001, 0, 2)],
)
def test_endpoint_is_the_mapped_decode_rank_port(pworker, scripted, p_tp, p_rank, d_tp, port,
                                                 member, ratio) -> None:
    decode = scripted()
    worker = pworker(p_rank=p_rank, p_tp=p_tp)
    worker.bind_connector_metadata(StepPlan(sends=(_send("a" + SUFFIX, (1,), 0, True,
                                                         d_tp=d_tp),)))
    _write_all_layers(worker)
    batches = decode.wait_batches(3)
    assert {ep for ep, _ in batches} == {f"tcp://10.0.0.9:{port}"}
    assert {(b.group_member_idx, b.tp_ratio) for _, b in batches} == {(member, ratio)}


def test_requests_for_two_decode_instances_go_to_two_endpoints(pworker, scripted) -> None:
    decode = scripted()
    worker = pworker()
    worker.bind_connector_metadata(StepPlan(sends=(
        _send("a" + SUFFIX, (1,), 0, True, port=31000),
        _send("b" + SUFFIX, (2,), 0, True, port=32000),
        _send("c" + SUFFIX, (3,), 0, True, port=32000))))
    _write_all_layers(worker)
    by_ep = dict(decode.wait_batches(2 * len(NAMES)))  # each endpoint's last: the final
    assert [r.ext_req_id for r in by_ep["tcp://10.0.0.9:31000"].read_reqs] == ["a"]
    assert [r.ext_req_id for r in by_ep["tcp://10.0.0.9:32000"].read_reqs] == ["b", "c"]
    assert by_ep["tcp://10.0.0.9:32000"].done_ext_ids == ("b", "c")


def test_finished_only_once_every_announcement_was_answered(pworker, scripted) -> None:
    decode = scripted(default="hold")
    worker = pworker()
    rid = "slow" + SUFFIX
    worker.bind_connector_metadata(StepPlan(sends=(_send(rid, (1, 2), 0, True),)))
    _write_all_layers(worker)
    decode.wait_batches(3)
    assert _released(worker, {rid}) == set()  # vLLM finished it, Decode is still reading
    assert worker.counters()["tickets"] == 3
    decode.answer_held()
    assert _sender(worker).drain(WAIT)
    assert _released(worker, set()) == {rid}  # vLLM's earlier finish is remembered
    assert _released(worker, {rid}) == set()  # reported once
    assert worker.counters() == {"requests": 0, "tickets": 0, "pending_layers": 0,
                                 "closed_slots": 0, "queued_tasks": 0, "unacked_sends": 0,
                                 "open_tickets": 0}


def test_answered_but_not_finished_by_vllm_is_not_reported(pworker, scripted) -> None:
    decode = scripted()
    worker = pworker()
    rid = "a" + SUFFIX
    worker.bind_connector_metadata(StepPlan(sends=(_send(rid, (1,), 0, False),)))
    _write_all_layers(worker)
    decode.wait_batches(3)
    assert _sender(worker).drain(WAIT)
    assert _released(worker, set()) == set()
    assert _released(worker, {rid}) == {rid}


def test_failed_announcements_also_release_the_request(pworker, scripted) -> None:
    decode = scripted(default="fail")
    log = RecordingLog()
    worker = pworker(log=log)
    rid = "bad" + SUFFIX
    worker.bind_connector_metadata(StepPlan(sends=(_send(rid, (1,), 0, True),)))
    _write_all_layers(worker)
    decode.wait_batches(3)
    assert _sender(worker).drain(WAIT)
    assert _released(worker, {rid}) == {rid}
    assert worker.requests_failed == 1  # counted once per request, not per layer
    warned = [kw for e, kw in log.at("warning") if e == "decode did not read a request's layer"]
    assert len(warned) == 1 and "do not fit" in warned[0]["error"]


def test_expired_announcements_release_the_request(rig, pworker, scripted) -> None:
    decode = scripted(default="hold")
    worker = pworker()
    rid = "lost" + SUFFIX
    worker.bind_connector_metadata(StepPlan(sends=(_send(rid, (1,), 0, True),)))
    _write_all_layers(worker)
    decode.wait_batches(3)
    assert _released(worker, {rid}) == set()
    rig.clock.advance(60)  # past the acknowledgement deadline
    assert _sender(worker).drain(WAIT)
    assert _released(worker, set()) == {rid}
    assert worker.requests_failed == 1
    decode.wait_for(lambda d: d.disconnects)  # the silent endpoint is dropped
    assert decode.disconnects == ["tcp://10.0.0.9:31000"]


def test_a_slow_decode_instance_holds_back_only_its_own_requests(pworker, scripted) -> None:
    decode = scripted()
    decode.mode["tcp://10.0.0.9:32000"] = "hold"
    worker = pworker()
    worker.bind_connector_metadata(StepPlan(sends=(
        _send("a" + SUFFIX, (1,), 0, True, port=31000),
        _send("b" + SUFFIX, (2,), 0, True, port=32000))))
    worker.save_kv_layer(NAMES[2])
    decode.wait_batches(2)
    decode.wait_for(lambda d: d.held)
    assert _sender(worker).drain(0.05) is False  # b's layer is still pending
    # Tickets are per (layer, endpoint): b's blocks wait for its slow Decode instance,
    # a's do not wait for it.
    assert _released(worker, {"a" + SUFFIX, "b" + SUFFIX}) == {"a" + SUFFIX}
    decode.answer_held()
    assert _sender(worker).drain(WAIT)
    assert _released(worker, set()) >= {"b" + SUFFIX}
    assert worker.counters()["requests"] == 0


def test_a_dead_sender_fails_the_layer_without_stranding_the_request(pworker) -> None:
    worker = pworker()
    assert _sender(worker).stop(2)
    rid = "orphan" + SUFFIX
    worker.bind_connector_metadata(StepPlan(sends=(_send(rid, (1,), 0, True),)))
    with pytest.raises(LayerSendError, match="stopped"):
        worker.save_kv_layer(NAMES[0])
    assert _released(worker, {rid}) == {rid}
    assert worker.requests_failed == 1


def test_buffer_reuse_gate_waits_for_decode(pworker, scripted) -> None:
    decode = scripted(default="hold")
    worker = pworker(buffer_reuse=True)
    worker.bind_connector_metadata(StepPlan(sends=(_send("a" + SUFFIX, (1,), 0, True),)))
    worker.save_kv_layer(NAMES[0])
    decode.wait_batches(1)
    with pytest.raises(LayerSendError, match="no acknowledgement"):
        worker.wait_for_layer_load(NAMES[0])  # still being read: writing it again is unsafe
    worker.wait_for_layer_load(NAMES[1])  # never announced: open
    decode.answer_held()
    assert _sender(worker).drain(WAIT)
    worker.wait_for_layer_load(NAMES[0])  # answered: may be written


def test_without_buffer_reuse_the_layer_hook_does_not_wait(pworker, scripted) -> None:
    decode = scripted(default="hold")
    worker = pworker(buffer_reuse=False)
    worker.bind_connector_metadata(StepPlan(sends=(_send("a" + SUFFIX, (1,), 0, True),)))
    worker.save_kv_layer(NAMES[0])
    decode.wait_batches(1)
    worker.wait_for_layer_load(NAMES[0])  # returns at once although Decode has not answered
    with pytest.raises(LayerSendError, match="no acknowledgement"):
        worker.wait_for_layer_reuse(0)  # the explicit gate still guards the buffer


def test_a_failed_layer_raises_at_the_reuse_gate(pworker, scripted) -> None:
    decode = scripted(default="fail")
    worker = pworker(buffer_reuse=True)
    worker.bind_connector_metadata(StepPlan(sends=(_send("a" + SUFFIX, (1,), 0, True),)))
    worker.save_kv_layer(NAMES[0])
    decode.wait_batches(1)
    assert _sender(worker).drain(WAIT)
    with pytest.raises(LayerSendError, match="do not fit"):
        worker.wait_for_layer_load(NAMES[0])


# ================================================================ Decode worker








IDLE_WAIT = 3.0  # the Decode worker's idle-step wait in these tests
BPB = 64  # bytes per block of the one main tensor
NB = 8
D_EP = "tcp://10.0.0.9:31000"
LAYER = "model.layers.0.self_attn.attn"


@pytest.fixture
def pd(rig, tmp_path):
    """A Prefill worker and a Decode worker (one layer, one main tensor), each from its
    container, sharing the rig's in-memory control network and the inproc transport; both
    stamp a timeline under ``tmp_path / "timeline"``."""
    stamps = JsonlTimeline(tmp_path / "timeline")
    p_engine, d_engine = rig.engine(), rig.engine()
    p_buf = np.random.default_rng(1).integers(1, 255, (NB, BPB), dtype=np.uint8)
    d_buf = np.zeros((NB, BPB), dtype=np.uint8)
    p_engine.register_memory(p_buf.ctypes.data, p_buf.nbytes)
    d_engine.register_memory(d_buf.ctypes.data, d_buf.nbytes)
    d_log = RecordingLog()
    dworker = rig.decode_worker(
        {LAYER: DestinationLayout(LAYER, (DestTensor(d_buf.ctypes.data, BPB, NB),))}, d_engine,
        settings={"host": "10.0.0.9", "kv_port": 31000,
                  "deadlines": {"request_s": 30, "tp_exchange_s": WAIT}},
        log=d_log, overrides={"timeline": stamps}, idle_wait_s=IDLE_WAIT)
    assert rig.net.endpoints == {D_EP}
    pworker = rig.prefill_worker(
        {0: SourceLayout(LAYER, (TensorComponent(p_buf.ctypes.data, BPB, 1, 0, NB),))},
        p_engine.session_id, overrides={"timeline": stamps})
    yield pworker, dworker, rig.clock, p_buf, d_buf, d_log


def test_decode_worker_admits_each_load_and_reports_it_once(pd) -> None:
    _, dworker, *_ = pd
    dworker.bind_connector_metadata(StepPlan(loads=(DecodeLoad("a" + SUFFIX, (1, 2), (1, 2)),
                                                    DecodeLoad("b" + SUFFIX, (3,), (3,)))))
    dworker.bind_connector_metadata(StepPlan())
    assert dworker.take_admitted() == ["a" + SUFFIX, "b" + SUFFIX]
    assert dworker.take_admitted() == []
    res = dworker.get_transfer_results(set())
    assert res.finished_recving == res.failed_recving == frozenset()
    assert not dworker.get_block_ids_with_load_errors()


def test_prefill_to_decode_pull_finishes_the_request(pd) -> None:
    pworker, dworker, _, p_buf, d_buf, _ = pd
    rid = "pull" + SUFFIX
    dworker.bind_connector_metadata(StepPlan(loads=(DecodeLoad(rid, (5, 6, 7), (5, 6, 7)),)))
    pworker.bind_connector_metadata(StepPlan(sends=(PrefillSend(
        rid, "pull", DecodeEndpoint("10.0.0.9", 31000, 1), (0, 1, 2), (0, 1, 2), 0, 0,
        True),)))
    assert _announced(pworker, LAYER)
    assert _sender(pworker).drain(WAIT)
    np.testing.assert_array_equal(d_buf[[5, 6, 7]], p_buf[[0, 1, 2]])
    res = dworker.get_transfer_results(set())
    assert res.finished_recving == {rid} and not res.failed_recving
    assert not dworker.get_block_ids_with_load_errors()
    assert (dworker.requests_done, dworker.requests_failed) == (1, 0)
    assert dworker.stats.bytes_read == 3 * BPB and dworker.stats.layers_done == 1
    assert _released(pworker, {rid}) == {rid}


def test_the_pull_stamps_its_hops_in_order_on_the_timeline(pd, tmp_path) -> None:
    pworker, dworker, *_ = pd
    rid = "cmpl-" + "ab" * 16 + "-0" + SUFFIX  # a proxy request id inside vLLM's
    dworker.bind_connector_metadata(StepPlan(loads=(DecodeLoad(rid, (5, 6), (5, 6)),)))
    pworker.bind_connector_metadata(StepPlan(sends=(PrefillSend(
        rid, external_request_id(rid), DecodeEndpoint("10.0.0.9", 31000, 1), (0, 1), (0, 1),
        0, 0, True),)))
    assert _announced(pworker, LAYER)
    assert _sender(pworker).drain(WAIT)
    assert dworker.get_transfer_results(set()).finished_recving == {rid}
    assert _released(pworker, {rid}) == {rid}
    hops = load(tmp_path / "timeline")["ab" * 16]
    order = ["decode.worker_admitted", "prefill.first_layer", "prefill.announced_all",
             "decode.kv_complete", "decode.reported"]
    assert {*order, "prefill.released"} <= set(hops)
    assert [hops[h] for h in order] == sorted(hops[h] for h in order)


def test_an_idle_step_waits_for_the_completion_instead_of_returning_at_once(pd) -> None:
    pworker, dworker, _, p_buf, d_buf, _ = pd
    rid = "idle" + SUFFIX
    dworker.bind_connector_metadata(StepPlan(loads=(DecodeLoad(rid, (5,), (5,)),)))
    assert dworker.get_transfer_results(set()).finished_recving == frozenset()  # admitting
    pworker.bind_connector_metadata(StepPlan(sends=(PrefillSend(
        rid, "idle", DecodeEndpoint("10.0.0.9", 31000, 1), (0,), (0,), 0, 0, True),)))
    def forward() -> None:
        pworker.save_kv_layer(LAYER)
        pworker.wait_for_save()

    timer = threading.Timer(0.2, forward)
    timer.start()
    dworker.bind_connector_metadata(StepPlan(idle=True))
    t0 = time.monotonic()
    res = dworker.get_transfer_results(set())
    waited = time.monotonic() - t0
    timer.join()
    # It returned with the request because the completion woke it, not at the bound.
    assert res.finished_recving == {rid} and waited < IDLE_WAIT
    np.testing.assert_array_equal(d_buf[5], p_buf[0])


def test_an_idle_step_with_nothing_in_flight_or_a_busy_step_does_not_wait(pd) -> None:
    _, dworker, *_ = pd
    for plan in (StepPlan(idle=True), StepPlan()):
        dworker.bind_connector_metadata(plan)
        t0 = time.monotonic()
        dworker.get_transfer_results(set())
        assert time.monotonic() - t0 < IDLE_WAIT / 2
    dworker.bind_connector_metadata(StepPlan(loads=(DecodeLoad("w" + SUFFIX, (1,), (1,)),)))
    t0 = time.monotonic()
    dworker.get_transfer_results(set())  # a step that admits is not idle
    assert time.monotonic() - t0 < IDLE_WAIT / 2


def test_the_scheduler_marks_a_step_idle_only_when_it_computes_and_admits_nothing(
        dsched) -> None:
    sched, _, _ = dsched
    assert sched.build_connector_meta([]).idle
    assert not sched.build_connector_meta([ScheduledRequest("r", None, 3, 1, False)]).idle
    params = _params()
    sched.get_num_new_matched_tokens(_req(RID, params, 70), 0)
    sched.update_state_after_alloc(_req(RID, params, 70), ([7, 8, 9],), 70)
    plan = sched.build_connector_meta([])
    assert plan.loads and not plan.idle


def test_a_request_without_kv_in_time_fails_with_its_blocks_invalid(pd) -> None:
    _, dworker, clock, _, _, d_log = pd
    rid = "late" + SUFFIX
    dworker.bind_connector_metadata(StepPlan(loads=(DecodeLoad(rid, (2, 3), (4,)),)))
    assert dworker.get_transfer_results(set()).finished_recving == frozenset()
    clock.advance(31)  # past the request deadline
    res = dworker.get_transfer_results(set())
    assert res.finished_recving == {rid} and res.failed_recving == {rid}
    assert dworker.get_block_ids_with_load_errors() == {2, 3, 4}
    assert (dworker.requests_done, dworker.requests_failed) == (0, 1)
    assert any(kw.get("request") == rid for _, kw in d_log.at("warning"))


def test_a_read_that_cannot_land_fails_the_request_on_both_sides(pd) -> None:
    pworker, dworker, *_ = pd
    rid = "misfit" + SUFFIX
    dworker.bind_connector_metadata(StepPlan(loads=(DecodeLoad(rid, (1,), (1,)),)))
    pworker.bind_connector_metadata(StepPlan(sends=(PrefillSend(
        rid, "misfit", DecodeEndpoint("10.0.0.9", 31000, 1), (0, 1), (0, 1), 0, 0,
        True),)))  # 2 blocks into 1
    pworker.save_kv_layer(LAYER)
    assert _sender(pworker).drain(WAIT)
    res = dworker.get_transfer_results(set())
    assert res.failed_recving == {rid} and rid in res.finished_recving
    assert dworker.get_block_ids_with_load_errors() == {1}
    assert _released(pworker, {rid}) == {rid} and pworker.requests_failed == 1


def test_decode_computes_locally_when_the_proxy_allows_what_is_missing(dsched) -> None:
    sched, ms, _ = dsched
    params = _params(local_prefill_tokens=16)
    # 100-token prompt, 90 in Decode's prefix cache: 10 missing, within 16.
    assert sched.get_num_new_matched_tokens(_req(RID, params, 100), 90) == (0, False)
    sched.update_state_after_alloc(_req(RID, params, 100), ([1, 2, 3, 4],), 0)
    assert params["do_remote_prefill"] is False
    assert sched.build_connector_meta([]).loads == ()  # nothing to pull
    assert ms.posts == [(EXT, URL, {
        "request_id": EXT, "do_remote_prefill": False, "do_remote_decode": False,
        "prefill": "local", "remote_engine_id": "decode-engine",
        "remote_cached_tokens": 90, "prompt_tokens": 100})]  # at once, no admission wait
    assert sched.local_prefills == 1
    # More missing than allowed: pulled as always.
    other = "cmpl-43-0" + SUFFIX
    assert sched.get_num_new_matched_tokens(_req(other, _params(local_prefill_tokens=16),
                                                 100), 32) == (68, True)


@pytest.mark.parametrize("limit", [0, None, True, "16"])
def test_local_prefill_needs_an_integer_limit(dsched, limit) -> None:
    sched, _, _ = dsched
    assert sched.get_num_new_matched_tokens(
        _req(RID, _params(local_prefill_tokens=limit), 100), 95) == (5, True)


def test_a_local_prompt_in_a_batch_is_computed_by_prefill_without_sending() -> None:
    batch = {"do_remote_decode": True, "batch_kv_transfer_params": {
        "list-0": D_PARAMS,
        "list-1": {"request_id": "list-1", "prefill": "local", "do_remote_decode": False}}}
    assert resolve_params("list-1", batch) is None
    assert resolve_params("list-0", batch) == D_PARAMS


def test_traceparent_is_logged_and_stamped_on_both_schedulers(tmp_path) -> None:
    from rd2h.adapters.logging.timeline import JsonlTimeline

    trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    sched, log = _psched()
    sched._timeline = timeline = JsonlTimeline(tmp_path)
    assert _track(sched, "t-0" + SUFFIX, 8, {**D_PARAMS, "traceparent": trace}) == 1
    (_, kw), = [e for e in log.at("info") if e[0] == "sending KV to decode"]
    assert kw["traceparent"] == trace and kw["decode"].endswith(f":{D_PARAMS['remote_port']}")
    ms = RecordingMetaserver()
    dlog = RecordingLog()
    dsched = _dsched_of(ms, dlog, timeline=timeline)
    dsched.get_num_new_matched_tokens(_req(RID, _params(traceparent=trace), 64), 0)
    (_, kw), = [e for e in dlog.at("info") if e[0] == "pulling KV from prefill"]
    assert kw["traceparent"] == trace
    timeline.close()
    stamps = [json.loads(line) for p in tmp_path.glob("stamps-*.jsonl")
              for line in p.read_text().splitlines()]
    assert {(s["hop"], s.get("trace")) for s in stamps} == {
        ("prefill.tracked", trace), ("decode.matched", trace)}


def test_an_unsampled_trace_is_logged_at_debug_only(dsched) -> None:
    sched, _, log = dsched
    trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
    sched.get_num_new_matched_tokens(_req(RID, _params(traceparent=trace), 64), 0)
    assert not [e for e in log.at("info") if e[0] == "pulling KV from prefill"]
    (_, kw), = [e for e in log.at("debug") if e[0] == "pulling KV from prefill"]
    assert kw["traceparent"] == trace


def test_the_final_report_rides_on_the_layer_announced_last_in_time(pworker, scripted) -> None:
    """vLLM calls the save hook for some layers only (DeepSeek-V3.2's indexer cache gets
    none): the others are announced after the forward, and the request's completion rides
    on the layer announced last in time, whatever its id, never on one announced before
    another (Decode would complete the request without the later layer)."""
    decode = scripted()
    worker = pworker()
    worker.bind_connector_metadata(StepPlan(sends=(_send("a" + SUFFIX, (1,), 0, True),)))
    worker.save_kv_layer(NAMES[2])  # the highest id, hooked first
    worker.save_kv_layer(NAMES[0])
    worker.wait_for_save()  # NAMES[1] had no hook: announced now, and last
    batches = [b for _, b in decode.wait_batches(len(NAMES))]
    assert [b.layer_name for b in batches] == [NAMES[2], NAMES[0], NAMES[1]]
    assert [b.done_ext_ids for b in batches] == [(), (), ("a",)]
