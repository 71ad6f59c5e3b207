"""``DecodeSession`` alone, sans IO: decoded messages in with explicit times, replies,
reads to perform and events out. Each scenario ends with the request book empty."""

from __future__ import annotations

import dataclasses

from rd2h.domain.decode.decode_session import (
    DecodeSession,
    Expired,
    Forget,
    Incomplete,
    LayerDone,
    LayerFailed,
    MetaStored,
    PeerLost,
    Read,
    Rejected,
    Reply,
    SendAck,
)
from rd2h.domain.decode.request_book import StepOutcome
from rd2h.domain.errors import AuthenticationError, ProtocolError, UnknownMessageType
from rd2h.domain.planning.kv_groups import NO_BLOCK
from rd2h.domain.planning.layout import DestinationLayout, DestTensor, SourceLayout, TensorComponent
from rd2h.domain.wire.compat import MetaRefused
from rd2h.domain.wire.protocol import (
    MetaAck,
    MfMeta,
    ReadDone,
    ReadFailed,
    ReadReadyBatch,
    ReadRequest,
)

X9 = "-abcdefgh"  # vLLM's engine suffix
NAME = "model.layers.0.attn"
BPB, NB = 64, 8
SRC = SourceLayout(NAME, (TensorComponent(0x10000, BPB, num_blocks=NB),))
DST = DestinationLayout(NAME, (DestTensor(0x90000, BPB, NB),))
META = MfMeta("p-session", {NAME: SRC.to_metadata(),
                            "model.layers.9.attn": SRC.to_metadata()})
P = b"peer-1"


def session(request_timeout_s: float = 10.0) -> DecodeSession:
    return DecodeSession(destinations={NAME: DST}, d_rank=0, d_tp=1, main_shared=False,
                         request_timeout_s=request_timeout_s)


def batch(*reqs: ReadRequest, done: tuple[str, ...] = (), layer: int = 0) -> ReadReadyBatch:
    return ReadReadyBatch(layer, NAME, reqs, done)


def step(s: DecodeSession, now: float = 0.0, finished: tuple[str, ...] = ()) -> StepOutcome:
    return s.finish_step([s.local_report()], finished, now)


def assert_clean(s: DecodeSession) -> None:
    counters = s.counters()
    counters.pop("peers")
    assert counters == dict.fromkeys(counters, 0), counters
    assert s.reads_in_flight == 0


def test_metadata_is_acknowledged_and_only_known_layers_are_kept() -> None:
    s = session()
    assert s.receive(P, META, 0.0) == [SendAck(P), MetaStored(P, "p-session", 1)]
    assert s.counters()["peers"] == 1


def test_a_ready_message_is_read_once_and_answered_once() -> None:
    s = session()
    s.receive(P, META, 0.0)
    s.admit("a" + X9, [3, 4], [], 0.0)
    (read,) = s.receive(P, batch(ReadRequest("a", (1, 2), (), 0, 0), done=("a",)), 1.0)
    assert isinstance(read, Read) and read.p_session == "p-session"
    assert read.plan.remote_addrs.tolist() == [0x10000 + BPB]  # blocks 1, 2: one run
    assert read.plan.local_addrs.tolist() == [0x90000 + 3 * BPB]
    assert read.plan.lengths.tolist() == [2 * BPB]
    assert s.begin_read(read.token)
    assert s.read_done(read.token, 1.1) == [Reply(P, ReadDone(0)), LayerDone(0, ("a",))]
    assert s.read_done(read.token, 1.1) == []  # answered once
    out = step(s)
    assert out.finished == {"a" + X9} and not out.failed
    assert_clean(s)


def test_owning_nothing_is_answered_at_once() -> None:
    s = session()
    s.receive(P, META, 0.0)
    s.admit("a" + X9, [1], [], 0.0)
    assert s.receive(P, batch(done=("a",)), 0.0) == [Reply(P, ReadDone(0)),
                                                      LayerDone(0, ("a",))]
    step(s)
    assert_clean(s)


def test_failures_are_answered_and_fail_every_named_request() -> None:
    s = session()
    s.admit("a" + X9, [1], [], 0.0)
    outs = s.receive(P, batch(ReadRequest("a", (1,), (), 0, 0)), 0.0)  # no MF_META yet
    assert outs == [Reply(P, ReadFailed(0, "READ_READY_BATCH before MF_META on this "
                                           "connection")),
                    LayerFailed(0, "READ_READY_BATCH before MF_META on this connection")]
    s.receive(P, META, 0.0)
    s.admit("b" + X9, [2], [], 0.0)
    (read,) = s.receive(P, batch(ReadRequest("b", (1,), (), 0, 0)), 0.0)
    assert s.begin_read(read.token)
    outs = s.read_done(read.token, 0.1, error="transfer returned -5")
    assert outs[0] == Reply(P, ReadFailed(0, "read failed: transfer returned -5"))
    out = step(s)
    assert out.failed == {"a" + X9, "b" + X9} and out.invalid_block_ids == {1, 2}
    assert_clean(s)


def test_a_peer_lost_before_or_during_the_read_fails_the_layer() -> None:
    s = session()
    s.receive(P, META, 0.0)
    s.admit("a" + X9, [1], [], 0.0)
    s.admit("b" + X9, [2], [], 0.0)
    (before,) = s.receive(P, batch(ReadRequest("a", (1,), (), 0, 0)), 0.0)
    (during,) = s.receive(P, batch(ReadRequest("b", (2,), (), 0, 0), layer=0), 0.0)
    assert s.begin_read(during.token)
    (lost,) = s.peer_lost(P, 0.5)
    assert isinstance(lost, PeerLost) and lost.failed == ("a", "b")
    assert not s.begin_read(before.token)  # skip it: nothing read from a vanished peer
    assert s.read_done(before.token, 0.6)[0].message.error == (
        "prefill peer disconnected before the read")
    assert s.read_done(during.token, 0.6)[0].message.error == (
        "prefill peer disconnected during the read")
    out = step(s)
    assert out.failed == {"a" + X9, "b" + X9}
    assert "disconnected before announcing the final layer" in out.reasons["a" + X9]
    assert s.counters()["peers"] == 0
    assert_clean(s)


def test_frames_that_did_not_decode_are_refused_without_touching_state() -> None:
    s = session()
    s.admit("a" + X9, [1], [], 0.0)
    assert s.reject(P, UnknownMessageType(b"nope")) == [Rejected("unknown", "b'nope'")]
    assert s.reject(P, AuthenticationError("bad tag", layer_idx=3)) == [
        Rejected("unauthenticated", "bad tag", 3),
        Reply(P, ReadFailed(3, "authentication failed: bad tag"))]
    assert s.reject(P, ProtocolError("garbage")) == [Rejected("malformed", "garbage")]
    # Messages only Decode sends (the handshake's answers, replies) are refused as such.
    for wrong in (MetaAck(5), MetaRefused("no"), ReadDone(0)):
        assert s.receive(P, wrong, 0.0) == [Rejected("unexpected", type(wrong).__name__)]
    assert s.reject(P, ProtocolError("x" * 5000, layer_idx=1))[1].message.error.endswith("...")
    assert s.counters()["failed"] == 0  # nothing a frame that did not decode says is used
    assert s.tick(9.9) == []
    assert s.tick(10.0) == [Expired(("a",), 10.0)]
    step(s, now=10.0)
    assert_clean(s)


def test_next_deadline_is_when_tick_next_expires_something() -> None:
    s = session(request_timeout_s=10.0)
    assert s.next_deadline() is None  # nothing held: nothing to wait for
    s.admit("a" + X9, [1], [], 1.0)
    s.admit("b" + X9, [2], [], 2.0)
    assert s.next_deadline() == 11.0  # a's request deadline
    s.receive(P, META, 2.5)
    s.receive(P, batch(ReadRequest("a", (1,), (), 0, 0), done=("a",)), 3.0)
    s.read_done(0, 3.0)  # a is complete: b is due next
    assert s.next_deadline() == 12.0
    s.receive(P, batch(done=("ghost",)), 4.0)  # an id never admitted: an orphan
    assert s.tick(11.9) == [] and s.next_deadline() == 12.0
    assert s.tick(12.0) == [Expired(("b",), 10.0)]
    assert s.next_deadline() == 14.0  # the orphan goes stale then
    step(s, now=12.0)
    assert s.tick(14.0) == [] and s.next_deadline() is None
    assert_clean(s)


def test_a_prefill_that_restarted_under_its_session_replaces_the_old_one() -> None:
    """MF_META states the sender's generation. A new one under a known session from
    another connection: the old process is gone (its address reused), so its metadata,
    reads and requests end now, never matched with the new one's announcements."""
    s = DecodeSession(destinations={NAME: DST}, d_rank=0, d_tp=1, main_shared=False,
                      generation=77)
    old, new = dataclasses.replace(META, generation=1), dataclasses.replace(META, generation=2)
    assert s.receive(P, old, 0.0)[0] == SendAck(P, 77)  # ours, to a peer that states its own
    s.admit("a" + X9, [1], [], 0.0)
    (read,) = s.receive(P, batch(ReadRequest("a", (1,), (), 0, 0)), 0.0)
    assert s.begin_read(read.token)
    out = s.receive(b"peer-2", new, 1.0)
    (lost,) = [o for o in out if isinstance(o, PeerLost)]
    assert lost.failed == ("a",) and Forget(P) in out and SendAck(b"peer-2", 77) in out
    assert s.read_done(read.token, 1.1)[0].message.error == (
        "prefill peer disconnected during the read")
    outcome = step(s)
    assert outcome.failed == {"a" + X9}
    assert "restarted (a new generation)" in outcome.reasons["a" + X9]
    # The same generation on another connection is the same process reconnecting.
    assert not any(isinstance(o, PeerLost) for o in s.receive(b"peer-3", new, 2.0))
    assert s.receive(b"peer-4", META, 2.0)[0] == SendAck(b"peer-4")  # states none
    assert s.counters()["peers"] == 3
    assert_clean(s)


# -- a final report is trusted only once every layer the request needs was read (#58)
NAME1 = "model.layers.1.attn"
SRC1 = SourceLayout(NAME1, (TensorComponent(0x20000, BPB, num_blocks=NB),))
DST1 = DestinationLayout(NAME1, (DestTensor(0xA0000, BPB, NB),))
META2 = MfMeta("p-session", {NAME: SRC.to_metadata(), NAME1: SRC1.to_metadata()})


def two_layer_session(dst1: DestinationLayout = DST1) -> DecodeSession:
    return DecodeSession(destinations={NAME: DST, NAME1: dst1}, d_rank=0, d_tp=1,
                         main_shared=False, request_timeout_s=10.0)


def read_layer(s: DecodeSession, layer: int, name: str, done: tuple[str, ...] = (),
               reqs: tuple[ReadRequest, ...] = (ReadRequest("a", (1,), (), 0, 0),)) -> list:
    outs = s.receive(P, ReadReadyBatch(layer, name, reqs, done), float(layer))
    (read,) = [o for o in outs if isinstance(o, Read)]
    assert s.begin_read(read.token)
    return s.read_done(read.token, float(layer) + 0.5)


def test_a_final_report_before_a_layer_was_read_fails_the_request_naming_it() -> None:
    """The report rides on layer 0 while layer 1 (which the request needs: it has a block
    in its group) was never read: the request fails, naming layer 1, not completed."""
    s = two_layer_session()
    s.receive(P, META2, 0.0)
    s.admit("a" + X9, [3], [], 0.0)
    outs = read_layer(s, 0, NAME, done=("a",))
    assert outs[0] == Reply(P, ReadDone(0))  # the layer itself was read fine
    assert LayerDone(0, ()) in outs  # ... and completed nothing
    (short,) = [o for o in outs if isinstance(o, Incomplete)]
    assert short == Incomplete(0, (("a", (NAME1,)),))
    out = step(s)
    assert out.failed == {"a" + X9} and out.invalid_block_ids == {3}
    assert NAME1 in out.reasons["a" + X9], out.reasons
    assert_clean(s)


def test_a_final_report_after_every_layer_was_read_completes_the_request() -> None:
    s = two_layer_session()
    s.receive(P, META2, 0.0)
    s.admit("a" + X9, [3], [], 0.0)
    assert LayerDone(0, ()) in read_layer(s, 0, NAME)
    outs = read_layer(s, 1, NAME1, done=("a",))
    assert LayerDone(1, ("a",)) in outs and not [o for o in outs if isinstance(o, Incomplete)]
    out = step(s)
    assert out.finished == {"a" + X9} and not out.failed
    assert_clean(s)


def test_a_layer_whose_group_holds_no_block_of_the_request_is_not_awaited() -> None:
    """Layer 1 reads into group 1, where the request has no block (outside a sliding
    window): Prefill never names it there, and its final report on layer 0 completes."""
    s = two_layer_session(dataclasses.replace(DST1, group=1))
    s.receive(P, META2, 0.0)
    s.admit("a" + X9, [3], [], 0.0, group_block_ids=[[3], [NO_BLOCK]])
    outs = read_layer(s, 0, NAME, done=("a",))
    assert LayerDone(0, ("a",)) in outs
    out = step(s)
    assert out.finished == {"a" + X9} and not out.failed
    assert_clean(s)


def test_the_layers_read_are_counted_across_chunks() -> None:
    """Chunked prefill: layer 1 was read with the first chunk, the final chunk's report
    rides on layer 0: every layer was read for the request, it completes."""
    s = two_layer_session()
    s.receive(P, META2, 0.0)
    s.admit("a" + X9, [3, 4], [], 0.0)
    read_layer(s, 0, NAME)
    read_layer(s, 1, NAME1)
    outs = read_layer(s, 2, NAME, done=("a",),
                      reqs=(ReadRequest("a", (2,), (), 1, 1),))
    assert LayerDone(2, ("a",)) in outs
    out = step(s)
    assert out.finished == {"a" + X9} and not out.failed
    assert_clean(s)
