"""Recurrent state (Mamba, gated delta net) through ``SfaRemoteD2HConnector`` (issue #39),
with vLLM's real config objects and requests, and real bytes over the ``inproc``
transport.

A Nemotron-H / Qwen3-Next style engine: layers 0 and 2 hold recurrent state (one
``MambaSpec`` group: a conv and an SSM state per request, packed into one padded page
per block, as vLLM lays them out), layers 1 and 3 attention (a full-attention group),
all four layers views of one buffer, as in vLLM. The N-1 scheme: Decode loads the
prompt but its last token; Prefill's request is shortened by that token on arrival
(once), computes the rest in two chunks, and announces the state layers after the
final chunk's forward only (before it the state is still changing). Each state page
lands in Decode's state block, each attention block in its own group's block; nothing
else of Decode's memory changes.
"""

from __future__ import annotations

import contextlib
import gc

import pytest

pytest.importorskip("vllm")
import test_vllm_connector as base
import torch
from test_kv_groups_connector import _blocks
from test_vllm_connector import (  # noqa: F401 (fixtures)
    SUFFIX_D,
    SUFFIX_P,
    URL,
    cached_reqs,
    memory_control,
    metaserver,
    request,
    scheduler_output,
    tp_group,
    vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.output import NewRequestData
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
)
from vllm.v1.outputs import KVConnectorOutput

from rd2h.domain.errors import LayerSendError
from rd2h.domain.planning.kv_groups import UnsupportedKvGroup
from rd2h.domain.wire.compat import compare
from rd2h.entry.connector import SfaRemoteD2HConnector

BS, NB, HEADS, HEAD = 4, 24, 2, 8
STATE = ["model.layers.0.mixer", "model.layers.2.mixer"]
ATTN = ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"]
CONV, SSM = (3, 8), (2, 4, 4)  # floats per block: 24 + 32 = 56 of a 64-float page
PAGE = 2 * BS * HEADS * HEAD * 4  # the attention page (bytes); the state page is padded to it


def hybrid(mode: str = "none", spec_blocks: int = 0) -> KVCacheConfig:
    full = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD,
                             dtype=torch.float32)
    state = MambaSpec(block_size=512 if mode == "none" else BS, shapes=(CONV, SSM),
                      dtypes=(torch.float32, torch.float32), page_size_padded=PAGE,
                      mamba_cache_mode=mode, num_speculative_blocks=spec_blocks)
    return KVCacheConfig(
        num_blocks=NB,
        kv_cache_tensors=[KVCacheTensor(size=PAGE * NB, layers=[s, a], layer_stride=PAGE * NB,
                                        block_stride=PAGE) for s, a in zip(STATE, ATTN)],
        kv_cache_groups=[KVCacheGroupSpec(STATE, state), KVCacheGroupSpec(ATTN, full)],
    )


def _caches(seed: int | None) -> tuple[dict[str, object], list[torch.Tensor]]:
    """vLLM's layout: per layer pair one raw buffer of ``NB`` pages; the attention layer
    sees ``[NB, heads, block, 2 x head]``, the state layer a conv and an SSM view packed
    at the start of each page (the rest is padding)."""
    gen = torch.Generator().manual_seed(seed or 0)
    raws, caches = [], {}
    floats = PAGE // 4
    for s, a in zip(STATE, ATTN):
        raw = (torch.randn(NB * floats, generator=gen) if seed is not None
               else torch.zeros(NB * floats))
        raws.append(raw)
        caches[a] = raw.view(NB, HEADS, BS, 2 * HEAD)
        conv = torch.as_strided(raw, (NB, *CONV), (floats, CONV[1], 1), 0)
        ssm = torch.as_strided(raw, (NB, *SSM), (floats, SSM[1] * SSM[2], SSM[2], 1),
                               CONV[0] * CONV[1])
        caches[s] = [conv, ssm]
    return caches, raws


def _pages(raw: torch.Tensor, ids) -> torch.Tensor:
    return raw.view(NB, PAGE // 4)[list(ids)]


STATE_FLOATS = CONV[0] * CONV[1] + SSM[0] * SSM[1] * SSM[2]  # 56: the state, no padding


def _landed(d: torch.Tensor, p: torch.Tensor, state: tuple[int, int],
            attn: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    """Decode's state block holds Prefill's state (its conv and SSM floats) and none of
    the padding after it; each attention block Prefill's whole page."""
    (d_s, p_s), (d_a, p_a) = state, attn
    torch.testing.assert_close(_pages(d, [d_s])[:, :STATE_FLOATS],
                               _pages(p, [p_s])[:, :STATE_FLOATS], rtol=0, atol=0)
    assert not _pages(d, [d_s])[:, STATE_FLOATS:].any(), "the state page's padding moved"
    torch.testing.assert_close(_pages(d, d_a), _pages(p, p_a), rtol=0, atol=0)


@pytest.fixture
def engines(tp_group, memory_control, metaserver):  # noqa: F811
    made = []

    def start(mode: str = "none"):
        extra = {"transport": "inproc", "deadlines": {"layer_ack_s": 10.0, "meta_ack_s": 10.0}}
        d_cfg, p_cfg = vllm_config("kv_consumer", extra), vllm_config("kv_producer", extra)
        conns = [base.connector(cfg, role, hybrid(mode), **memory_control[1])
                 for cfg in (d_cfg, p_cfg)
                 for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER)]
        made.extend(conns)
        d_sched, d_work, p_sched, p_work = conns
        (d_caches, d_raw), (p_caches, p_raw) = _caches(None), _caches(11)
        d_work.register_kv_caches(d_caches)
        p_work.register_kv_caches(p_caches)
        gc.collect()
        return d_sched, p_sched, d_work, p_work, d_raw, p_raw

    yield start
    for conn in made:
        conn.shutdown()


def _rendezvous(d_sched, d_work, rid: str, prompt: int, d_groups) -> dict:
    """Decode matches and admits the request; returns the contact info it posted."""
    req = request(rid, prompt, {"do_remote_prefill": True, "metaserver": URL})
    assert d_sched.get_num_new_matched_tokens(req, 0) == (prompt - 1, True)
    d_sched.update_state_after_alloc(req, _blocks(*d_groups), prompt - 1)
    d_work.bind_connector_metadata(d_sched.build_connector_meta(scheduler_output()))
    d_sched.update_connector_output(KVConnectorOutput(
        kv_connector_worker_meta=d_work.build_connector_worker_meta()))
    return base.RecordingMetaserver.made[0].posts[-1][2]


def _forward(p_work, plan) -> None:
    """One Prefill step as vLLM runs it: bind, the attention layers' hooks, then the
    end of the forward."""
    p_work.bind_connector_metadata(plan)
    for layer in ATTN:
        p_work.save_kv_layer(layer, None, None)
    p_work.wait_for_save()


def test_state_and_attention_land_in_their_own_blocks_after_n_minus_1(engines) -> None:
    d_sched, p_sched, d_work, p_work, d_raw, p_raw = engines("none")
    prompt = 3 * BS + 1  # Prefill computes 3 full blocks (N-1), Decode the last token
    d_state, d_attn = (5,), (6, 7, 8)
    p_state, p_attn = (14,), (15, 16, 17)
    post = _rendezvous(d_sched, d_work, "h-1" + SUFFIX_D, prompt, (d_state, d_attn))

    preq = request("h-1" + SUFFIX_P, prompt, post)
    p_sched.on_new_request(preq)
    assert preq.num_prompt_tokens == prompt - 1 and len(preq.prompt_token_ids) == prompt - 1
    assert preq.max_tokens == 1
    p_sched.on_new_request(preq)  # vLLM asks once; a second look never shortens again
    assert preq.num_prompt_tokens == prompt - 1
    p_sched.update_state_after_alloc(preq, _blocks(p_state, p_attn), 0)

    # Chunk 1 (8 tokens): two attention blocks; the state is still changing.
    plan = p_sched.build_connector_meta(scheduler_output(
        [NewRequestData.from_request(preq, ([p_state[0]], list(p_attn)))],
        counts={preq.request_id: 2 * BS}))
    (send,) = plan.plan.sends
    assert send.groups == ((0, ()), (0, p_attn[:2])) and not send.final
    _forward(p_work, plan)
    assert d_work.get_transfer_results(set()).finished_recving == frozenset()
    # Chunk 2 (the last 4 of N-1 tokens): the last attention block and the state.
    plan = p_sched.build_connector_meta(scheduler_output(
        cached=cached_reqs([(preq.request_id, None, 2 * BS)]),
        counts={preq.request_id: BS}))
    (send,) = plan.plan.sends
    assert send.groups == ((0, p_state), (2, p_attn[2:])) and send.final
    _forward(p_work, plan)
    for i in range(4):
        p_work.wait_for_layer_reuse(i)
    assert d_work.get_transfer_results(set()).finished_recving == {"h-1" + SUFFIX_D}

    for d, p in zip(d_raw, p_raw):
        _landed(d, p, (d_state[-1], p_state[-1]), (d_attn, p_attn))
        rest = [b for b in range(NB) if b not in d_state + d_attn]
        assert not _pages(d, rest).any()
    stats = d_work.get_kv_connector_stats().data
    # Per layer pair: the state's own bytes (not its padded page) and 3 attention pages.
    assert stats["bytes_pulled"] == 2 * (STATE_FLOATS * 4 + 3 * PAGE)


def test_a_one_token_prompt_is_computed_by_decode(engines) -> None:
    """Nothing to pull (N-1 = 0): Decode computes the prompt and tells the proxy."""
    d_sched, *_ = engines("none")
    req = request("h-2" + SUFFIX_D, 1, {"do_remote_prefill": True, "metaserver": URL})
    assert d_sched.get_num_new_matched_tokens(req, 0) == (0, False)
    d_sched.update_state_after_alloc(req, _blocks((5,), (6,)), 0)
    post = base.RecordingMetaserver.made[0].posts[-1][2]
    assert post["prefill"] == "local" and post["do_remote_decode"] is False


def test_a_prefix_hit_of_all_but_the_last_token_pulls_nothing(engines) -> None:
    d_sched, *_ = engines("align")
    req = request("h-3" + SUFFIX_D, 2 * BS + 1, {"do_remote_prefill": True, "metaserver": URL})
    assert d_sched.get_num_new_matched_tokens(req, 2 * BS) == (0, False)


def test_align_mode_moves_the_last_state_block_of_the_list(engines) -> None:
    """Prefix caching on (vLLM's ``align`` mode): the state group's list is indexed by
    position, earlier positions null; the running state is its last block, on both
    sides, whatever the lengths of the lists."""
    d_sched, p_sched, d_work, p_work, d_raw, p_raw = engines("align")
    prompt = 2 * BS + 2
    d_state, d_attn = (0, 0, 9), (10, 11, 12)
    p_state, p_attn = (0, 0, 19), (20, 21, 22)
    post = _rendezvous(d_sched, d_work, "h-4" + SUFFIX_D, prompt, (d_state, d_attn))
    preq = request("h-4" + SUFFIX_P, prompt, post)
    p_sched.on_new_request(preq)
    p_sched.update_state_after_alloc(preq, _blocks(p_state, p_attn), 0)
    plan = p_sched.build_connector_meta(scheduler_output(
        [NewRequestData.from_request(preq, (list(p_state), list(p_attn)))],
        counts={preq.request_id: prompt - 1}))
    _forward(p_work, plan)
    for i in range(4):
        p_work.wait_for_layer_reuse(i)
    assert d_work.get_transfer_results(set()).finished_recving == {"h-4" + SUFFIX_D}
    for d, p in zip(d_raw, p_raw):
        _landed(d, p, (9, 19), ((10, 11, 12), (20, 21, 22)))
        assert not _pages(d, [0]).any()  # vLLM's null block


def test_a_request_for_no_remote_decode_is_not_shortened(engines) -> None:
    _, p_sched, *_ = engines("none")
    for params in (None, {"do_remote_decode": False}):
        req = request("h-5" + SUFFIX_P, 9, params)
        p_sched.on_new_request(req)
        assert req.num_prompt_tokens == 9


def test_a_prompt_list_shortens_each_child_that_goes_to_a_remote_decode(engines) -> None:
    """The children of one prompt list share their dispatch's params: each is shortened
    once, by its own id; a child Decode computes itself is not."""
    _, p_sched, *_ = engines("none")
    params = {"do_remote_decode": True, "batch_kv_transfer_params": {
        "a": {"do_remote_decode": True}, "b": {"do_remote_decode": True},
        "c": {"do_remote_decode": False, "prefill": "local"}}}
    reqs = [request(x + SUFFIX_P, 7, params) for x in "abc"]
    for r in reqs:
        p_sched.on_new_request(r)
    assert [r.num_prompt_tokens for r in reqs] == [6, 6, 7]


def test_state_whose_geometry_is_unknown_states_its_tp_size_for_the_handshake() -> None:
    """State is split over TP ranks by its model's layout. Here the model (a Llama config
    with a state group added by hand) does not size that state by vLLM's calculator, so
    rd2h has no geometry to split it by: it states ``state_tp`` and between different TP
    sizes the MF_META handshake refuses, naming it; the start line says why."""
    conns = [SfaRemoteD2HConnector(vllm_config(role, tp=tp), KVConnectorRole.SCHEDULER,
                                   hybrid())
             for role, tp in (("kv_producer", 2), ("kv_consumer", 1))]
    p, d = (c._facts.compat for c in conns)
    assert p.values["state_tp"] == 2 and p.values["kv_groups"] == "state/512x2,full/4x2"
    assert "state_layout" not in p.values
    assert conns[0]._facts.state_geometry is None
    assert "state across TP sizes: equal TP only" in conns[0]._facts.groups_text
    refusal = compare(p, d)
    assert refusal is not None and "state_tp: prefill 2, decode 1" in refusal.describe()
    for c in conns:
        c.shutdown()


@pytest.mark.parametrize("role", ["kv_consumer", "kv_producer"])
def test_state_with_speculative_scratch_blocks_is_refused(role) -> None:
    with pytest.raises(UnsupportedKvGroup, match="speculative scratch") as info:
        SfaRemoteD2HConnector(vllm_config(role), KVConnectorRole.SCHEDULER,
                              hybrid(spec_blocks=2))
    assert "group 0 (MambaSpec, 2 layers: model.layers.0.mixer" in str(info.value)


def test_a_state_read_that_fails_fails_the_request(engines) -> None:
    """Prefill names a state block beyond the region it advertised (a broken peer): the
    state layer fails on Decode, so the request is reported failed (vLLM's
    ``kv_load_failure_policy`` then applies), never completed from a state that did not
    arrive."""
    d_sched, p_sched, d_work, p_work, d_raw, _ = engines("none")
    prompt = BS + 1
    post = _rendezvous(d_sched, d_work, "h-6" + SUFFIX_D, prompt, ((5,), (6,)))
    preq = request("h-6" + SUFFIX_P, prompt, post)
    p_sched.on_new_request(preq)
    p_sched.update_state_after_alloc(preq, _blocks((NB + 3,), (15,)), 0)
    plan = p_sched.build_connector_meta(scheduler_output(
        [NewRequestData.from_request(preq, ([NB + 3], [15]))], counts={preq.request_id: BS}))
    _forward(p_work, plan)
    for i in range(4):  # every announcement answered (the state layers: failed)
        with contextlib.suppress(LayerSendError):
            p_work.wait_for_layer_reuse(i)
    res = d_work.get_transfer_results(set())
    assert res.failed_recving == {"h-6" + SUFFIX_D}
    assert not _pages(d_raw[0], [5]).any()  # nothing landed in the state block
    p_work.get_transfer_results({preq.request_id})
    assert p_work.get_kv_connector_stats().data["requests_failed"] == 1


def test_a_preempted_request_announces_the_state_of_its_new_blocks(engines) -> None:
    """vLLM preempts Prefill's request mid-prefill (its blocks freed, the prompt kept
    shortened) and resumes it from scratch in new blocks: the attention blocks Decode
    already read are not announced again, and the state comes from the new state block
    with the final chunk."""
    d_sched, p_sched, d_work, p_work, d_raw, p_raw = engines("none")
    prompt = 3 * BS + 1
    d_state, d_attn = (5,), (6, 7, 8)
    post = _rendezvous(d_sched, d_work, "h-7" + SUFFIX_D, prompt, (d_state, d_attn))
    preq = request("h-7" + SUFFIX_P, prompt, post)
    p_sched.on_new_request(preq)
    p_sched.update_state_after_alloc(preq, _blocks((14,), (15, 16, 17)), 0)
    plan = p_sched.build_connector_meta(scheduler_output(
        [NewRequestData.from_request(preq, ([14], [15, 16, 17]))],
        counts={preq.request_id: 2 * BS}))
    _forward(p_work, plan)
    for i in range(4):
        p_work.wait_for_layer_reuse(i)
    p_sched.on_new_request(preq)  # never shortened twice
    assert preq.num_prompt_tokens == prompt - 1
    out = scheduler_output(cached=cached_reqs([(preq.request_id, ([19], [20, 21, 22]), 0)],
                                              resumed={preq.request_id}),
                           counts={preq.request_id: prompt - 1})
    out.preempted_req_ids = {preq.request_id}
    plan = p_sched.build_connector_meta(out)
    (send,) = plan.plan.sends
    assert send.groups == ((0, (19,)), (2, (22,))) and send.final
    assert plan.plan.preempted == (preq.request_id,)
    p_work.handle_preemptions(plan)
    _forward(p_work, plan)
    for i in range(4):
        p_work.wait_for_layer_reuse(i)
    assert d_work.get_transfer_results(set()).finished_recving == {"h-7" + SUFFIX_D}
    for d, p in zip(d_raw, p_raw):
        _landed(d, p, (5, 19), ((6, 7, 8), (15, 16, 22)))
