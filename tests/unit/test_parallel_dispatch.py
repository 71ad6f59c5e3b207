"""Parallel dispatch on Decode (issue #43): an announcement naming requests that Prefill
was given before this Decode rank admitted them (``awaits``) is kept until they are
admitted, within its hold and a byte budget, then read as usual; order per request is
kept; what never gets admitted is answered skipped when the wait ends; a prefix-cache
hit on Decode is never written (Prefill announces every block: it does not know it)."""

from __future__ import annotations

from typing import Any

from rd2h.app.connector.decode_scheduler import DecodeScheduler
from rd2h.app.connector.prefill_scheduler import PrefillScheduler
from rd2h.app.connector.roles import RequestFacts, ScheduledRequest
from rd2h.domain.decode.decode_session import (
    Capped,
    DecodeSession,
    LayerDone,
    Parked,
    Read,
    Reply,
    SendAck,
    Skipped,
    Unparked,
)
from rd2h.domain.planning.kv_groups import NO_BLOCK
from rd2h.domain.planning.layout import DestinationLayout, DestTensor, SourceLayout, TensorComponent
from rd2h.domain.prefill.announce import LayerTarget, group_batches
from rd2h.domain.wire.protocol import (
    MfMeta,
    ReadDone,
    ReadReadyBatch,
    ReadRequest,
    fields_of,
    message_from_fields,
)
from rd2h.domain.wire.rendezvous import AWAITS_ADMISSION, SENT_CONTACT
from rd2h.ports.runtime import SILENT_LOGGER

X9 = "-abcdefgh"
NAME = "model.layers.0.attn"
BPB, NB = 64, 16
SRC = SourceLayout(NAME, (TensorComponent(0x10000, BPB, num_blocks=NB),))
DST = DestinationLayout(NAME, (DestTensor(0x90000, BPB, NB),))
P, Q = b"peer-1", b"peer-2"
WALL = 1_000_000  # ms: the hold is stated against it


def session(**kw: Any) -> DecodeSession:
    s = DecodeSession(destinations={NAME: DST}, d_rank=0, d_tp=1, main_shared=False, **kw)
    for peer in (P, Q):
        assert s.receive(peer, MfMeta("p", {NAME: SRC.to_metadata()}), 0.0)[0] == SendAck(peer)
    return s


def ready(seq: int, *reqs: ReadRequest, done: tuple[str, ...] = (),
          awaits: tuple[str, ...] | None = None, hold_ms: int = WALL + 30_000
          ) -> ReadReadyBatch:
    named = tuple(dict.fromkeys([r.ext_req_id for r in reqs] + list(done)))
    return ReadReadyBatch(0, NAME, reqs, done, seq=seq, hold_until_ms=hold_ms,
                          awaits=named if awaits is None else awaits)


def recv(s: DecodeSession, peer: bytes, msg: ReadReadyBatch, now: float,
         size: int = 100) -> list[Any]:
    return s.receive(peer, msg, now, wall_ms=WALL + int(now * 1000), size=size)


def read_all(s: DecodeSession, outs: list[Any], now: float) -> list[Any]:
    """Perform every ``Read`` in ``outs`` (as the loop does); the rest, then the reads'."""
    done: list[Any] = []
    for out in outs:
        if isinstance(out, Read):
            assert s.begin_read(out.token)
            done += s.read_done(out.token, now)
        else:
            done.append(out)
    return done


def test_the_awaited_ids_travel_after_the_hold_and_older_peers_ignore_them() -> None:
    msg = ready(5, ReadRequest("a", (1,), (), 0, 0))
    fields = fields_of(msg)
    assert fields[9] == ["a"] and message_from_fields(fields) == msg
    # None without a hold (or seq); a signing envelope (bin) in its place is not ids.
    assert len(fields_of(ReadReadyBatch(0, NAME, msg.read_reqs, awaits=("a",)))) == 7
    assert message_from_fields([*fields[:9], b"\x00" * 56]).awaits == ()
    # Prefill's batches name exactly the requests dispatched before admission.
    req_a, req_b = ReadRequest("a", (1,), (), 0, 0), ReadRequest("b", (2,), (), 0, 0)
    (batch,) = group_batches(0, NAME, [LayerTarget("ep", req_a, awaits=True),
                                       LayerTarget("ep", req_b),
                                       LayerTarget("ep", None, True, ext_req_id="c",
                                                   awaits=True)]).values()
    assert batch.awaits == ("a", "c") and batch.done_ext_ids == ("c",)


def test_an_announcement_before_admission_is_kept_then_read_once_admitted() -> None:
    s = session()
    (parked,) = recv(s, P, ready(1, ReadRequest("a", (1, 2), (), 0, 0)), 0.0)
    assert isinstance(parked, Parked) and parked.awaiting == ("a",)
    assert s.parked_count == 1 and s.counters()["parked_bytes"] == 100
    assert s.next_deadline() == 5.0  # its wait (admission_wait_s) is the next deadline
    assert s.release(0.01) == []  # not admitted: still kept
    s.admit("a" + X9, [7, 8], [], 0.02)
    assert s.next_deadline() == float("-inf")  # due now: the loop releases it
    outs = s.release(0.03)
    assert isinstance(outs[0], Unparked) and not outs[0].expired
    (read,) = [o for o in outs if isinstance(o, Read)]
    assert read.plan.local_addrs.tolist() == [0x90000 + 7 * BPB]  # coalesced 7, 8
    assert read.plan.lengths.tolist() == [2 * BPB]
    assert read_all(s, [read], 0.04)[0] == Reply(P, ReadDone(0, 1))
    assert s.parked_count == 0 and s.counters()["parked_bytes"] == 0


def test_later_layers_keep_their_order_behind_a_kept_one() -> None:
    s = session()
    recv(s, P, ready(1, ReadRequest("a", (1,), (), 0, 0)), 0.0)
    recv(s, P, ready(2, ReadRequest("a", (2,), (), 1, 0)), 0.001)
    s.admit("a" + X9, [7, 8, 9], [], 0.002)
    # A third arrives after the admission but before the loop released the first two:
    # it waits behind them instead of being read (and completing) first.
    (third,) = recv(s, P, ready(3, ReadRequest("a", (3,), (), 2, 0), done=("a",)), 0.003)
    assert isinstance(third, Parked) and third.awaiting == ()
    replies = [o for o in read_all(s, s.release(0.004), 0.005) if isinstance(o, Reply)]
    assert [r.message.seq for r in replies] == [1, 2, 3]
    res = s.finish_step([s.local_report()], (), 0.006)
    assert res.finished == {"a" + X9} and not res.failed


def test_a_kept_request_does_not_finish_while_its_layers_wait() -> None:
    s = session()
    recv(s, P, ready(1, ReadRequest("a", (1,), (), 0, 0)), 0.0)
    s.admit("a" + X9, [7], [], 0.001)
    # A done report from another contributor (no awaits: read at once) must not let the
    # request finish while this rank still has a layer of it to read.
    out = recv(s, Q, ReadReadyBatch(0, NAME, (), ("a",), seq=9, hold_until_ms=WALL + 30_000),
               0.002)
    assert isinstance(out[0], Parked)  # it names a kept request: kept behind it
    res = s.finish_step([s.local_report()], (), 0.003)
    assert not res.finished


def test_a_request_never_admitted_is_answered_skipped_when_the_wait_ends() -> None:
    s = session(park_s=2.0)
    recv(s, P, ready(1, ReadRequest("gone", (1,), (), 0, 0)), 0.0)
    assert s.release(1.9) == []
    outs = s.release(2.0)
    assert outs[0] == Unparked(0, 2.0, True)
    assert Reply(P, ReadDone(0, 1, ("gone",))) in outs and Skipped(0, ("gone",)) in outs
    assert s.parked_count == 0


def test_the_wait_never_passes_the_hold_less_its_margin() -> None:
    s = session(park_s=10.0, hold_margin_s=0.25)
    (parked,) = recv(s, P, ready(1, ReadRequest("a", (1,), (), 0, 0), hold_ms=WALL + 1_000),
                     0.0)
    assert parked.until == 1.0 - 0.25 - 0.05
    # A hold already (nearly) over: answered at once, as before.
    outs = recv(s, P, ready(2, ReadRequest("b", (1,), (), 0, 0), hold_ms=WALL + 200), 0.0)
    assert Skipped(0, ("b",)) in outs


def test_known_or_unawaited_requests_are_never_kept() -> None:
    s = session()
    s.admit("a" + X9, [7], [], 0.0)
    (read,) = recv(s, P, ready(1, ReadRequest("a", (1,), (), 0, 0)), 0.0)
    assert isinstance(read, Read)
    # Without ``awaits`` (an older Prefill, a sequential dispatch): skipped at once.
    outs = recv(s, P, ready(2, ReadRequest("x", (1,), (), 0, 0), awaits=()), 0.0)
    assert Skipped(0, ("x",)) in outs
    # Ids in ``awaits`` the message does not name are not waited for.
    outs = recv(s, P, ready(3, ReadRequest("y", (1,), (), 0, 0), awaits=("z",)), 0.0)
    assert Skipped(0, ("y",)) in outs and s.parked_count == 0


def test_what_is_kept_is_bounded_per_peer_and_in_all() -> None:
    s = session(max_parked_bytes_per_peer=250, max_parked_bytes=350)
    kept = [recv(s, P, ready(i, ReadRequest(f"p{i}", (1,), (), 0, 0)), 0.0) for i in range(3)]
    assert [type(k[0]) for k in kept[:2]] == [Parked, Parked]
    # The third would pass the peer's budget: handled now (skipped), the cap reported once.
    assert any(isinstance(o, Capped) for o in kept[2]) and Skipped(0, ("p2",)) in kept[2]
    again = recv(s, P, ready(9, ReadRequest("p9", (1,), (), 0, 0)), 0.0)
    assert not any(isinstance(o, Capped) for o in again)
    assert isinstance(recv(s, Q, ready(1, ReadRequest("q1", (1,), (), 0, 0)), 0.0)[0], Parked)
    total = recv(s, Q, ready(2, ReadRequest("q2", (1,), (), 0, 0)), 0.0)
    assert [o.limit for o in total if isinstance(o, Capped)] == [350]
    assert s.counters()["parked_bytes"] == 300


def test_a_lost_peer_takes_its_kept_announcements_with_it() -> None:
    s = session()
    recv(s, P, ready(1, ReadRequest("a", (1,), (), 0, 0)), 0.0)
    s.peer_lost(P, 0.1)
    s.admit("a" + X9, [7], [], 0.2)
    assert s.release(0.3) == [] and s.parked_count == 0
    assert s.counters()["parked_bytes"] == 0
    # Admitted, then lost before the loop released it: nothing is left due (the loop
    # would otherwise never sleep).
    recv(s, Q, ready(2, ReadRequest("b", (1,), (), 0, 0)), 0.4)
    s.admit("b" + X9, [8], [], 0.5)
    assert s.next_deadline() == float("-inf")
    s.peer_lost(Q, 0.6)
    assert s.next_deadline() != float("-inf")


def _facts(rid: str, params: dict[str, Any], prompt: int = 64, cached: int = 0
           ) -> RequestFacts:
    return RequestFacts(rid, prompt, prompt, cached, params)


def test_decode_never_writes_the_blocks_its_own_prefix_cache_held() -> None:
    sched = DecodeScheduler(metaserver=Poster(), host="h", base_port=1, tp_size=1,
                            engine_id="e", log=SILENT_LOGGER, block_size=16)
    params = {"do_remote_prefill": True, "metaserver": "http://m", AWAITS_ADMISSION: True}
    req = _facts("r" + X9, params, cached=32)  # 32 tokens (2 blocks) cached here
    assert sched.get_num_new_matched_tokens(req, 32) == (32, True)
    sched.update_state_after_alloc(req, ([3, 4, 5, 6],), 32)
    (load,) = sched.build_connector_meta(()).loads
    assert load.main_block_ids == (NO_BLOCK, NO_BLOCK, 5, 6)
    # Sequential dispatch: Prefill starts after the cached blocks; the list is unchanged.
    plain = _facts("s" + X9, {"do_remote_prefill": True, "metaserver": "http://m"}, cached=32)
    sched.get_num_new_matched_tokens(plain, 32)
    sched.update_state_after_alloc(plain, ([3, 4, 5, 6],), 32)
    assert sched.build_connector_meta(()).loads[0].main_block_ids == (3, 4, 5, 6)


class Poster:
    def __init__(self) -> None:
        self.posted: list[str] = []

    def post(self, request_id: str, url: str, payload: dict[str, Any]) -> None:
        self.posted.append(request_id)

    def cancel(self, *a: Any) -> None: ...

    def take_failed(self) -> dict[str, str]:
        return {}


def test_decode_posts_under_parallel_dispatch_only_when_prefill_got_another_contact() -> None:
    poster = Poster()
    sched = DecodeScheduler(metaserver=poster, host="h", base_port=7000, tp_size=1,
                            engine_id="e", log=SILENT_LOGGER, block_size=16)
    mine = {"remote_engine_id": "e", "remote_host": "h", "remote_port": 7000,
            "remote_tp_size": 1, "remote_pcp_size": 1, "remote_dcp_size": 1}
    for name, sent in (("same", mine), ("stale", {**mine, "remote_port": 7100})):
        params = {"do_remote_prefill": True, "metaserver": "http://m", AWAITS_ADMISSION: True,
                  SENT_CONTACT: sent}
        req = _facts(f"{name}" + X9, params)
        sched.get_num_new_matched_tokens(req, 0)
        sched.update_state_after_alloc(req, ([3, 4, 5, 6],), 64)
        sched.build_connector_meta(())
        sched.update_connector_output({f"{name}" + X9: 1})
    assert poster.posted == ["stale"] and sched.posts_skipped == 1 and sched.posts == 1


def test_prefill_announces_every_block_and_names_the_request_in_awaits() -> None:
    sched = PrefillScheduler(block_size=16, main_group=0, indexer_group=0, p_tp=1,
                             log=SILENT_LOGGER)
    params = {"do_remote_decode": True, "remote_host": "d", "remote_port": 7000,
              "remote_tp_size": 1, AWAITS_ADMISSION: True}
    sched.update_state_after_alloc(_facts("r" + X9, params), ([1, 2, 3, 4],), 0)
    (send,) = sched.build_connector_meta(
        [ScheduledRequest("r" + X9, ([1, 2, 3, 4],), 0, 64, True)]).sends
    assert send.awaits and send.main_start == 0 and send.main_block_ids == (1, 2, 3, 4)


def test_a_prefix_hit_decode_reads_only_what_it_lacks_from_a_full_announcement() -> None:
    s = session()
    recv(s, P, ready(1, ReadRequest("a", (1, 2, 3, 4), (), 0, 0)), 0.0)
    s.admit("a" + X9, [NO_BLOCK, NO_BLOCK, 9, 10], [], 0.001)
    outs = s.release(0.002)
    (read,) = [o for o in outs if isinstance(o, Read)]
    assert read.plan.remote_addrs.tolist() == [0x10000 + 3 * BPB]  # blocks 3, 4 only
    assert read.plan.local_addrs.tolist() == [0x90000 + 9 * BPB]
    assert read.plan.lengths.tolist() == [2 * BPB]
    outs = read_all(s, outs, 0.003)
    assert Reply(P, ReadDone(0, 1)) in outs and LayerDone(0, ()) in outs
