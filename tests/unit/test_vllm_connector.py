"""``SfaRemoteD2HConnector`` driven with vLLM's real objects: ``VllmConfig`` /
``KVTransferConfig``, a ``KVCacheConfig`` with one MLA group, ``Request``,
``KVCacheBlocks``, ``SchedulerOutput`` / ``NewRequestData`` / ``CachedRequestData``,
``KVConnectorOutput`` and vLLM's own TP group (gloo, world size 1, file rendezvous).

Worker-side tests run a Prefill and a Decode connector in this process over the
``inproc`` transport; the control channel is swapped for an in-memory one at the
composition root, so no socket is opened (the gloo group of one rank aside)."""

from __future__ import annotations

import gc
from typing import Any

import pytest
from fakes.control import MemoryNetwork
from fakes.metaserver import RecordingMetaserver

pytest.importorskip("vllm")

import torch
from vllm.config import (
    KVTransferConfig,
    ParallelConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed import parallel_state
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from rd2h.adapters.vllm.stats import Rd2hConnectorStats, delta
from rd2h.app.connector.plans import DecodeEndpoint, DecodeLoad, PrefillSend
from rd2h.app.settings import ConnectorConfigError
from rd2h.bootstrap.container import InPlaceOf
from rd2h.domain.errors import LayerSendError
from rd2h.entry.connector import (
    Rd2hConnectorMetadata,
    Rd2hWorkerMeta,
    SfaRemoteD2HConnector,
)

SUFFIX_D, SUFFIX_P = "-d0000001", "-p0000001"  # vLLM's 9-character engine suffixes
BS, NB, LAYERS = 4, 16, 3
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
KV_PORT = 41000
URL = "http://proxy.local:8000/v1/metaserver"
WAIT = 10.0


# ================================================================ vLLM objects


def vllm_config(kv_role: str, extra: dict[str, Any] | None = None, *, tp: int = 1,
                pp: int = 1) -> VllmConfig:
    ktc = KVTransferConfig(
        kv_connector="SfaRemoteD2HConnector",
        kv_connector_module_path="rd2h.entry.connector",
        kv_role=kv_role, kv_port=KV_PORT, engine_id=f"engine-{kv_role}",
        kv_connector_extra_config=extra or {},
    )
    return VllmConfig(kv_transfer_config=ktc, parallel_config=ParallelConfig(
        tensor_parallel_size=tp, pipeline_parallel_size=pp))


def kv_cache_config() -> KVCacheConfig:
    spec = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    page = spec.page_size_bytes
    return KVCacheConfig(
        num_blocks=NB,
        kv_cache_tensors=[KVCacheTensor(size=page * NB, layers=[n], layer_stride=page * NB,
                                        block_stride=page) for n in NAMES],
        kv_cache_groups=[KVCacheGroupSpec(list(NAMES), spec)],
    )


def request(request_id: str, prompt_len: int, params: dict[str, Any] | None) -> Request:
    extra = None if params is None else {"kv_transfer_params": params}
    return Request(request_id, list(range(100, 100 + prompt_len)),
                   SamplingParams(max_tokens=1, extra_args=extra), None)


def blocks(*ids: int) -> KVCacheBlocks:
    return KVCacheBlocks(([KVCacheBlock(i) for i in ids],))


def scheduler_output(new: list[NewRequestData] = (), cached: CachedRequestData | None = None,
                     counts: dict[str, int] | None = None) -> SchedulerOutput:
    counts = counts or {}
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached or CachedRequestData.make_empty(),
        num_scheduled_tokens=counts, total_num_scheduled_tokens=sum(counts.values()),
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
        finished_req_ids=set(), free_encoder_mm_hashes=[],
    )


def cached_reqs(entries: list[tuple[str, tuple[list[int], ...] | None, int]],
                resumed: set[str] = frozenset()) -> CachedRequestData:
    return CachedRequestData(
        req_ids=[rid for rid, _, _ in entries], resumed_req_ids=set(resumed),
        new_token_ids=[[] for _ in entries], all_token_ids={},
        new_block_ids=[b for _, b, _ in entries],
        num_computed_tokens=[n for _, _, n in entries], num_output_tokens=[0] * len(entries),
    )




def connector(*args: Any, **overrides: Any) -> SfaRemoteD2HConnector:
    """The connector as vLLM builds it, its containers posting through a
    ``RecordingMetaserver`` (no HTTP) built from the real client's arguments, with any
    further ``bootstrap`` overrides."""
    return SfaRemoteD2HConnector(*args, overrides={
        "metaserver": InPlaceOf(RecordingMetaserver), **overrides})


@pytest.fixture
def metaserver():
    """Every scheduler role's container posts through a ``RecordingMetaserver`` (no HTTP),
    made when the role asks for its poster and given the endpoint's settings; the list of
    those made."""
    RecordingMetaserver.made = []
    yield RecordingMetaserver.made


# ================================================================ configuration


@pytest.mark.parametrize(
    ("extra", "named"),
    [({"bogus": 1}, "unknown key 'bogus'"),
     ({"transport": "smoke-signals"}, "'transport'"),
     ({"deadlines": {"request_s": -1}}, "'deadlines.request_s'")],
)
@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_bad_extra_config_is_refused_naming_the_key(extra, named, role) -> None:
    with pytest.raises(ConnectorConfigError, match="kv_connector_extra_config") as info:
        connector(vllm_config("kv_consumer", extra), role, kv_cache_config())
    assert named in str(info.value)


def test_kv_both_is_refused_clearly() -> None:
    with pytest.raises(ConnectorConfigError,
                       match=r"kv_role 'kv_producer' .* or 'kv_consumer' .*got 'kv_both'"):
        connector(vllm_config("kv_both"), KVConnectorRole.SCHEDULER,
                              kv_cache_config())


def test_pipeline_parallel_is_refused() -> None:
    with pytest.raises(ConnectorConfigError, match="pipeline_parallel_size 1"):
        connector(vllm_config("kv_producer", pp=2), KVConnectorRole.SCHEDULER,
                              kv_cache_config())


def test_connector_class_facts() -> None:
    conn = connector(vllm_config("kv_producer"), KVConnectorRole.SCHEDULER,
                                 kv_cache_config())
    assert conn.side == "prefill" and conn.options.transport == "cma"
    assert SfaRemoteD2HConnector.requires_piecewise_for_cudagraph({}) is True
    assert conn.get_loaded_kv_cache_group_ids(request("r" + SUFFIX_P, 4, None)) == (0,)
    assert isinstance(SfaRemoteD2HConnector.build_kv_connector_stats({"bytes_pulled": 3}),
                      Rd2hConnectorStats)


# ================================================================ Decode scheduler


def test_decode_scheduler_posts_after_every_rank_admitted(metaserver) -> None:
    conn = connector(
        vllm_config("kv_consumer", {"host": "10.9.8.7", "metaserver_retries": 5}, tp=2),
        KVConnectorRole.SCHEDULER, kv_cache_config())
    (ms,) = metaserver
    # the connector's options reach the poster's settings (the client is built from them:
    # test_connector_options)
    assert (ms.kwargs["retries"], ms.kwargs["timeout_s"]) == (5, 5.0)
    rid = "cmpl-7-0" + SUFFIX_D
    req = request(rid, 70, {"do_remote_prefill": True, "metaserver": URL})
    # 32 tokens hit D's local prefix cache: the rest is loaded asynchronously
    assert conn.get_num_new_matched_tokens(req, 32) == (38, True)
    conn.update_state_after_alloc(req, blocks(3, 4, 5, 6, 7, 8, 9, 10, 11, 12), 38)
    assert req.kv_transfer_params["do_remote_prefill"] is False
    meta = conn.build_connector_meta(scheduler_output())
    assert isinstance(meta, Rd2hConnectorMetadata)
    ids = tuple(range(3, 13))
    assert meta.plan.loads == (DecodeLoad(rid, ids, ids, (ids,)),) and meta.plan.sends == ()
    assert conn.build_connector_meta(scheduler_output()).plan.loads == ()

    conn.update_connector_output(KVConnectorOutput())  # no worker metadata this step
    conn.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=Rd2hWorkerMeta(
        {rid: 1})))
    assert ms.posts == []  # one of two TP ranks admitted it
    two_ranks = Rd2hWorkerMeta({rid: 1}).aggregate(Rd2hWorkerMeta({rid: 1}))
    assert two_ranks.admitted == {rid: 2}
    conn.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=two_ranks))
    assert ms.posts == [("cmpl-7-0", URL, {
        "request_id": "cmpl-7-0", "do_remote_prefill": False, "do_remote_decode": True,
        "remote_engine_id": "engine-kv_consumer", "remote_host": "10.9.8.7",
        "remote_port": KV_PORT, "remote_tp_size": 2, "remote_pcp_size": 1,
        "remote_dcp_size": 1, "remote_cached_tokens": 32,
    })]

    assert conn.request_finished(req, list(ids)) == (False, None)
    assert ms.cancels == ["cmpl-7-0"]
    conn.shutdown()
    assert ms.shutdowns == [5.0]


def test_decode_scheduler_ignores_local_requests_and_honours_do_virtual(metaserver) -> None:
    conn = connector(vllm_config("kv_consumer"), KVConnectorRole.SCHEDULER,
                                 kv_cache_config())
    (ms,) = metaserver
    local = request("local" + SUFFIX_D, 20, None)
    assert conn.get_num_new_matched_tokens(local, 0) == (0, False)
    conn.update_state_after_alloc(local, blocks(1, 2, 3, 4, 5), 0)
    virtual = request("virt" + SUFFIX_D, 8, {"do_remote_prefill": True, "metaserver": URL,
                                             "do_virtual": True})
    assert conn.get_num_new_matched_tokens(virtual, 0) == (8, True)
    conn.update_state_after_alloc(virtual, blocks(6, 7), 8)
    loads = conn.build_connector_meta(scheduler_output()).plan.loads
    assert loads == (DecodeLoad("virt" + SUFFIX_D, (6, 7), (6, 7), ((6, 7),)),)
    conn.update_connector_output(KVConnectorOutput(
        kv_connector_worker_meta=Rd2hWorkerMeta({"virt" + SUFFIX_D: 1})))
    assert ms.posts == []
    assert conn.request_finished_all_groups(virtual, ([6, 7],)) == (False, None)


# ================================================================ Prefill scheduler


def _p_params(**extra: Any) -> dict[str, Any]:
    return {"request_id": "ignored", "do_remote_prefill": False, "do_remote_decode": True,
            "remote_engine_id": "d", "remote_host": "10.0.0.5", "remote_port": 42000,
            "remote_tp_size": 1, "remote_pcp_size": 1, "remote_dcp_size": 1,
            "remote_cached_tokens": 0, **extra}


def test_prefill_scheduler_over_chunked_steps() -> None:
    conn = connector(vllm_config("kv_producer"), KVConnectorRole.SCHEDULER,
                                 kv_cache_config())
    a, b, local = "req-a" + SUFFIX_P, "req-b" + SUFFIX_P, "local" + SUFFIX_P
    ra = request(a, 14, _p_params())
    rb = request(b, 8, _p_params(remote_port=43000, remote_cached_tokens=4))
    rl = request(local, 8, None)
    for r, blks in ((ra, (10, 11)), (rb, (20, 21)), (rl, (30, 31))):
        conn.update_state_after_alloc(r, blocks(*blks), 0)
    ep_a = DecodeEndpoint("10.0.0.5", 42000, 1, "d")
    ep_b = DecodeEndpoint("10.0.0.5", 43000, 1, "d")

    # step 1: a's first chunk (6 of 14 tokens), all of b, all of the local request
    step1 = scheduler_output(
        [NewRequestData.from_request(r, blks) for r, blks in
         ((ra, ([10, 11],)), (rb, ([20, 21],)), (rl, ([30, 31],)))],
        counts={a: 6, b: 8, local: 8})
    sends = conn.build_connector_meta(step1).plan.sends
    assert sends == (PrefillSend(a, "req-a", ep_a, (10,), (10,), 0, 0, False, groups=((0, (10,)),)),
                     PrefillSend(b, "req-b", ep_b, (21,), (21,), 1, 1, True,
                                 groups=((1, (21,)),)))

    # step 2: a's second chunk (6..12): block 1 and block 2 complete
    step2 = scheduler_output(cached=cached_reqs([(a, ([12],), 6)]), counts={a: 6})
    (s2,) = conn.build_connector_meta(step2).plan.sends
    assert (s2.main_block_ids, s2.main_start, s2.final) == ((11, 12), 1, False)

    # step 3: a's last 2 tokens: the partial block 3 goes with the final chunk
    step3 = scheduler_output(cached=cached_reqs([(a, ([13],), 12)]), counts={a: 2})
    (s3,) = conn.build_connector_meta(step3).plan.sends
    assert (s3.main_block_ids, s3.main_start, s3.final) == ((13,), 3, True)
    assert conn.build_connector_meta(scheduler_output(
        cached=cached_reqs([(a, None, 14)]), counts={a: 1})).plan.sends == ()

    assert conn.request_finished(ra, [10, 11, 12, 13]) == (True, None)  # wait for sends
    assert conn.request_finished_all_groups(rl, ([30, 31],)) == (False, None)


def test_prefill_scheduler_resumed_request_replaces_its_blocks() -> None:
    conn = connector(vllm_config("kv_producer"), KVConnectorRole.SCHEDULER,
                                 kv_cache_config())
    a = "req-a" + SUFFIX_P
    ra = request(a, 12, _p_params())
    conn.update_state_after_alloc(ra, blocks(1, 2), 0)
    conn.build_connector_meta(scheduler_output(
        [NewRequestData.from_request(ra, ([1, 2],))], counts={a: 8}))
    # preempted; resumed with a fresh block table for everything so far
    resumed = scheduler_output(cached=cached_reqs([(a, ([7, 8, 9],), 8)], resumed={a}),
                               counts={a: 4})
    (s,) = conn.build_connector_meta(resumed).plan.sends
    assert (s.main_block_ids, s.main_start, s.final) == ((9,), 2, True)


def test_prefill_scheduler_resolves_batch_params_by_external_id() -> None:
    conn = connector(vllm_config("kv_producer"), KVConnectorRole.SCHEDULER,
                                 kv_cache_config())
    batch = {"do_remote_decode": True, "batch_kv_transfer_params": {
        "list-0": _p_params(remote_port=42000), "list-1": _p_params(remote_port=42100)}}
    reqs = [request(f"list-{i}" + SUFFIX_P, 4, batch) for i in range(2)]
    missing = request("list-9" + SUFFIX_P, 4, batch)
    for i, r in enumerate([*reqs, missing]):
        conn.update_state_after_alloc(r, blocks(i), 0)
    out = conn.build_connector_meta(scheduler_output(
        [NewRequestData.from_request(r, ([i],)) for i, r in enumerate([*reqs, missing])],
        counts={r.request_id: 4 for r in [*reqs, missing]}))
    assert [(s.ext_id, s.decode.base_port) for s in out.plan.sends] == [
        ("list-0", 42000), ("list-1", 42100)]  # list-9 has no params: not transferred
    assert conn.request_finished(missing, [2]) == (False, None)


# ================================================================ worker side


@pytest.fixture(scope="module")
def tp_group(tmp_path_factory):
    """vLLM's own TP group (one rank, gloo), as a worker process has it."""
    if parallel_state.model_parallel_is_initialized():
        yield parallel_state.get_tp_group()
        return
    init = tmp_path_factory.mktemp("dist") / "rendezvous"
    with set_current_vllm_config(VllmConfig()):
        parallel_state.init_distributed_environment(
            world_size=1, rank=0, distributed_init_method=f"file://{init}", local_rank=0,
            backend="gloo")
        parallel_state.initialize_model_parallel(1, 1)
    try:
        yield parallel_state.get_tp_group()
    finally:
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()








@pytest.fixture
def memory_control():
    """The roles are built with everything real except the control sockets: a server on
    the endpoint the settings give (host and rank port), clients of the same network."""
    net = MemoryNetwork()
    return net, {
        "control_server": InPlaceOf(lambda host, port, **_: net.server(f"tcp://{host}:{port}")),
        "control_clients": net.clients,
    }


def _caches(fill: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {n: (torch.randn(NB, BS, 576, generator=gen) if fill else torch.zeros(NB, BS, 576))
            .to(torch.bfloat16) for n in NAMES}


@pytest.fixture
def engines(tp_group, memory_control, metaserver):
    """Decode and Prefill connectors, scheduler and worker roles, on one KV port."""
    net, sockets = memory_control
    extra = {"transport": "inproc", "deadlines": {"layer_ack_s": WAIT, "meta_ack_s": WAIT}}
    d_cfg, p_cfg = vllm_config("kv_consumer", extra), vllm_config("kv_producer", extra)
    d_sched = connector(d_cfg, KVConnectorRole.SCHEDULER, kv_cache_config(), **sockets)
    p_sched = connector(p_cfg, KVConnectorRole.SCHEDULER, kv_cache_config(), **sockets)
    d_work = connector(d_cfg, KVConnectorRole.WORKER, kv_cache_config(), **sockets)
    p_work = connector(p_cfg, KVConnectorRole.WORKER, kv_cache_config(), **sockets)
    d_caches, p_caches = _caches(False), _caches(True)
    d_work.register_kv_caches(d_caches)
    p_work.register_kv_caches(p_caches)
    # Nothing but the workers keeps the engines alive from here (the composition root's
    # container is gone): collect now, as Python may at any time.
    gc.collect()
    assert net.endpoints == {f"tcp://127.0.0.1:{KV_PORT}"}
    yield d_sched, p_sched, d_work, p_work, d_caches, p_caches, metaserver[0]
    for conn in (p_work, d_work, d_sched, p_sched):
        conn.shutdown()


def _rendezvous(d_sched, d_work, rid: str, prompt_len: int, d_blocks: tuple[int, ...]):
    """Decode admits a request and posts its contact info; returns the post."""
    ms = RecordingMetaserver.made[0]
    req = request(rid, prompt_len, {"do_remote_prefill": True, "metaserver": URL})
    assert d_sched.get_num_new_matched_tokens(req, 0) == (prompt_len, True)
    d_sched.update_state_after_alloc(req, blocks(*d_blocks), prompt_len)
    d_work.bind_connector_metadata(d_sched.build_connector_meta(scheduler_output()))
    d_work.start_load_kv(None)
    worker_meta = d_work.build_connector_worker_meta()
    assert worker_meta == Rd2hWorkerMeta({rid: 1})
    assert d_work.build_connector_worker_meta() is None  # reported once
    d_sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=worker_meta))
    return ms.posts[-1][2]


def _prefill(p_sched, p_work, rid: str, prompt_len: int, p_blocks: tuple[int, ...],
             params: dict[str, Any]) -> Request:
    """One Prefill step computing the whole prompt, with the layer hooks vLLM calls."""
    req = request(rid, prompt_len, params)
    p_sched.update_state_after_alloc(req, blocks(*p_blocks), 0)
    meta = p_sched.build_connector_meta(scheduler_output(
        [NewRequestData.from_request(req, (list(p_blocks),))], counts={rid: prompt_len}))
    p_work.bind_connector_metadata(meta)
    p_work.start_load_kv(None)
    for name in NAMES:
        p_work.wait_for_layer_load(name)
        p_work.save_kv_layer(name, None, None)
        p_work.save_kv_layer(name, None, None)  # a second hook of the same layer is a no-op
    p_work.wait_for_save()
    return req


def test_prefill_to_decode_through_the_connectors(engines) -> None:
    d_sched, p_sched, d_work, p_work, d_caches, p_caches, _ = engines
    d_rid, p_rid = "chat-1" + SUFFIX_D, "chat-1" + SUFFIX_P
    post = _rendezvous(d_sched, d_work, d_rid, 10, (5, 6, 7))
    assert (post["request_id"], post["remote_port"]) == ("chat-1", KV_PORT)
    assert d_work.get_transfer_results(set()).finished_recving == set()  # nothing read yet

    req = _prefill(p_sched, p_work, p_rid, 10, (1, 2, 3), post)
    for i in range(LAYERS):
        p_work.wait_for_layer_reuse(i)  # returns once Decode read layer i
    for name in NAMES:
        torch.testing.assert_close(d_caches[name][[5, 6, 7]], p_caches[name][[1, 2, 3]],
                                   rtol=0, atol=0)
        assert not d_caches[name][[4, 8]].any()  # nothing else written
    d_res = d_work.get_transfer_results(set())
    assert d_res.finished_recving == {d_rid} and d_res.failed_recving == set()
    assert d_work.get_block_ids_with_load_errors() == set()

    assert p_sched.request_finished(req, [1, 2, 3]) == (True, None)
    assert p_work.get_transfer_results({p_rid}).finished_sending == {p_rid}
    assert p_work.get_finished(set()) == (None, None)

    d_stats = d_work.get_kv_connector_stats()
    page = BS * 576 * 2
    assert d_stats.data["bytes_pulled"] == 3 * page * LAYERS
    assert d_stats.data["layers_done"] == LAYERS and d_stats.data["requests_done"] == 1
    assert len(d_stats.data["read_latency_ms"]) >= 1
    assert d_work.get_kv_connector_stats() is None  # nothing new since the last report
    # Released: nothing held for Decode any more (the held gauges' change is 0).
    assert p_work.get_kv_connector_stats().data == {
        "layers_announced": LAYERS, "requests_failed": 0, "requests_aborted": 0,
        "refused_incompatible": 0, "held_requests": 0, "held_blocks": 0}


def test_a_read_that_cannot_land_is_a_load_error(engines) -> None:
    d_sched, p_sched, d_work, p_work, *_ = engines
    d_rid, p_rid = "bad-1" + SUFFIX_D, "bad-1" + SUFFIX_P
    # D allocated 1 block, P sends 3 (a contract violation): the layer fails on D
    post = _rendezvous(d_sched, d_work, d_rid, 4, (9,))
    _prefill(p_sched, p_work, p_rid, 10, (1, 2, 3), post)
    with pytest.raises(LayerSendError, match="decode endpoint"):
        p_work.wait_for_layer_reuse(0)
    for i in range(1, LAYERS):  # answered too: the failed request is not read again
        p_work.wait_for_layer_reuse(i)
    res = d_work.get_transfer_results(set())
    assert res.failed_recving == {d_rid} and d_rid in res.finished_recving
    assert d_work.get_block_ids_with_load_errors() == {9}
    assert d_work.get_block_ids_with_load_errors() == set()  # reported once
    assert p_work.get_transfer_results({p_rid}).finished_sending == {p_rid}
    assert p_work.get_kv_connector_stats().data["requests_failed"] == 1


def test_sparse_pool_destinations_need_the_ascend_registration(tp_group) -> None:
    conn = connector(
        vllm_config("kv_consumer", {"destinations": "sparse_kv_pool", "transport": "inproc"}),
        KVConnectorRole.WORKER, kv_cache_config())
    with pytest.raises(ConnectorConfigError, match="register_sparse_kv_pool"):
        conn.register_kv_caches(_caches(False))


# ================================================================ stats


def test_stats_aggregate_sums_counters_and_concatenates_latencies() -> None:
    a = Rd2hConnectorStats(data={"bytes_pulled": 100, "layers_done": 2,
                                 "read_latency_ms": [1.0, 3.0]})
    b = Rd2hConnectorStats(data={"bytes_pulled": 50, "reads_failed": 1,
                                 "read_latency_ms": [2.0]})
    assert a.aggregate(b) is a
    assert a.data == {"bytes_pulled": 150, "layers_done": 2, "reads_failed": 1,
                      "read_latency_ms": [1.0, 3.0, 2.0]}
    assert b.data["read_latency_ms"] == [2.0]  # the other side is not changed


def test_stats_reduce() -> None:
    s = Rd2hConnectorStats(data={"bytes_pulled": 4_000_000_000, "read_seconds": 2.0,
                                 "layers_done": 3, "read_latency_ms": [5.0, 1.0, 9.1234]})
    assert s.reduce() == {"bytes_pulled": 4_000_000_000, "read_seconds": 2.0,
                          "layers_done": 3, "read_latency_p50_ms": 5.0,
                          "read_latency_max_ms": 9.123, "reads": 3, "pull_gbps": 2.0}
    assert Rd2hConnectorStats(data={"layers_announced": 7}).reduce() == {"layers_announced": 7}


def test_stats_emptiness_and_reset() -> None:
    assert Rd2hConnectorStats().is_empty()
    assert Rd2hConnectorStats(data={"bytes_pulled": 0, "read_latency_ms": []}).is_empty()
    s = Rd2hConnectorStats(data={"layers_failed": 1})
    assert not s.is_empty()
    s.reset()
    assert s.is_empty() and s.data == {}


def test_stats_delta_since_the_last_report() -> None:
    before = {"bytes_pulled": 100, "read_seconds": 0.5, "read_latency_ms": [1.0, 2.0]}
    now = {"bytes_pulled": 160, "read_seconds": 0.75, "read_latency_ms": [1.0, 2.0, 4.0],
           "requests_done": 2}
    assert delta(now, before) == {"bytes_pulled": 60, "read_seconds": 0.25,
                                  "read_latency_ms": [4.0], "requests_done": 2}
    assert delta(now, {}) == now
