"""Layer runs (issue #43, item 3): several layers that announce the same read entries in
one READ_READY_BATCH (field 10), read by Decode in one batched read and answered by one
reply (field 4). Negotiated: Prefill states the feature in MF_META (field 5), Decode's
ACK says it reads them (a flag byte); a peer that does not state it sees one layer per
frame. A layer of a run that cannot be read fails alone; everything else is answered
together, and no layer is ever left unanswered."""

from __future__ import annotations

from typing import Any

import pytest

from rd2h.adapters.msgpack import MsgpackCodec
from rd2h.domain.decode.decode_session import (
    DecodeSession,
    LayerDone,
    LayerFailed,
    Read,
    Reply,
    SendAck,
)
from rd2h.domain.errors import ProtocolError
from rd2h.domain.planning.layout import DestinationLayout, DestTensor, SourceLayout, TensorComponent
from rd2h.domain.planning.planning import merge_plans
from rd2h.domain.wire.compat import compat_of
from rd2h.domain.wire.protocol import (
    ACK,
    FEATURE_LAYER_RUNS,
    MAX_RUN_LAYERS,
    MetaAck,
    MfMeta,
    ReadDone,
    ReadFailed,
    ReadReadyBatch,
    ReadRequest,
    RunLayer,
    answered,
    fields_of,
    message_from_fields,
)

CODEC = MsgpackCodec()
X9 = "-abcdefgh"
BPB, NB = 64, 16
NAMES = [f"model.layers.{i}.attn" for i in range(3)]
SRC = {n: SourceLayout(n, (TensorComponent(0x10000 * (i + 1), BPB, num_blocks=NB),))
       for i, n in enumerate(NAMES)}
DST = {n: DestinationLayout(n, (DestTensor(0x900000 + 0x10000 * i, BPB, NB),))
       for i, n in enumerate(NAMES)}
P = b"peer-1"
HOLD = 2_000_000_000_000


def meta(features: tuple[str, ...] = (FEATURE_LAYER_RUNS,), generation: int | None = 7
         ) -> MfMeta:
    return MfMeta("p", {n: SRC[n].to_metadata() for n in NAMES}, compat_of(), generation,
                  features)


def session(destinations: dict[str, DestinationLayout] | None = None) -> DecodeSession:
    s = DecodeSession(destinations=destinations or DST, d_rank=0, d_tp=1, main_shared=False,
                      generation=11)
    (ack, *_) = s.receive(P, meta(), 0.0)
    assert ack == SendAck(P, 11, layer_runs=True)
    return s


def run(*reqs: ReadRequest, layers: tuple[int, ...] = (0, 1, 2),
        done: tuple[str, ...] = ()) -> ReadReadyBatch:
    """A run over ``layers`` (seq 100 + layer); ``done`` on its last layer."""
    first, *rest = layers
    last = layers[-1]
    return ReadReadyBatch(first, NAMES[first], reqs, done if first == last else (),
                          seq=100 + first, hold_until_ms=HOLD,
                          also=tuple(RunLayer(i, NAMES[i], 100 + i, done if i == last else ())
                                     for i in rest))


def perform(s: DecodeSession, outs: list[Any], error: str | None = None) -> list[Any]:
    done: list[Any] = []
    for out in outs:
        if isinstance(out, Read):
            assert s.begin_read(out.token)
            done += s.read_done(out.token, 1.0, error)
        else:
            done.append(out)
    return done


def answered_seqs(outs: list[Any]) -> dict[int, str]:
    """seq -> "done"/"failed" over every reply in ``outs`` (each layer exactly once)."""
    seen: dict[int, str] = {}
    for out in outs:
        if isinstance(out, Reply):
            for one in answered(out.message):
                assert one.seq not in seen, f"layer answered twice: {one}"
                seen[one.seq] = "done" if isinstance(one, ReadDone) else "failed"
    return seen


# ---------------------------------------------------------------- the wire


def test_a_run_travels_after_the_hold_and_round_trips() -> None:
    msg = run(ReadRequest("a", (1, 2), (), 0, 0), done=("a",))
    fields = fields_of(msg)
    assert fields[9] == [] and fields[10] == [[1, NAMES[1], 101, []], [2, NAMES[2], 102, ["a"]]]
    assert message_from_fields(fields) == msg
    assert CODEC.decode(CODEC.encode(msg)) == msg
    assert msg.named_ext_ids == ("a",)
    assert [b.layer_idx for b in msg.layers()] == [0, 1, 2]
    assert [b.done_ext_ids for b in msg.layers()] == [(), (), ("a",)]
    assert all(not b.also and b.read_reqs == msg.read_reqs for b in msg.layers())
    # No run without a hold; a signing envelope in field 10's place is not a run.
    assert len(fields_of(ReadReadyBatch(0, NAMES[0], msg.read_reqs, also=msg.also))) == 7
    assert message_from_fields([*fields[:10], b"\x00" * 56]).also == ()


def test_replies_answer_every_layer_of_a_run() -> None:
    done = ReadDone(0, 100, ("x",), ((1, 101), (2, 102)))
    failed = ReadFailed(0, "boom", 100, ((1, 101),))
    for reply in (done, failed):
        assert CODEC.decode(CODEC.encode(reply)) == reply
    assert answered(done) == (ReadDone(0, 100, ("x",)), ReadDone(1, 101, ("x",)),
                              ReadDone(2, 102, ("x",)))
    assert answered(failed) == (ReadFailed(0, "boom", 100), ReadFailed(1, "boom", 101))
    assert answered(ReadDone(4, 9)) == (ReadDone(4, 9),)
    # A reply without a run is encoded as before (older Prefills read it).
    assert fields_of(ReadDone(0, 5)) == [b"read_done", 0, 5]


def test_the_feature_is_negotiated_in_the_handshake() -> None:
    fields = fields_of(meta())
    assert fields[5] == [FEATURE_LAYER_RUNS]
    assert message_from_fields(fields, CODEC._unpack_nested).features == (FEATURE_LAYER_RUNS,)
    # Only after a generation (an older reader ignores a field it does not know).
    assert len(fields_of(meta(generation=None))) == 4
    # The ACK's flag byte, only where Prefill stated features.
    assert CODEC.encode(MetaAck(7, layer_runs=True)) == ACK + (7).to_bytes(8, "big") + b"\x01"
    assert CODEC.encode(MetaAck(7)) == ACK + (7).to_bytes(8, "big")
    s = DecodeSession(destinations=DST, d_rank=0, d_tp=1, generation=11)
    assert s.receive(P, meta(features=()), 0.0)[0] == SendAck(P, 11, layer_runs=False)
    assert s.receive(P, meta(), 0.0)[0] == SendAck(P, 11, layer_runs=True)
    assert s.receive(P, meta(generation=None), 0.0)[0] == SendAck(P, None, layer_runs=False)


def test_a_run_longer_than_the_limit_is_malformed() -> None:
    too_long = tuple(RunLayer(0, NAMES[0], i) for i in range(MAX_RUN_LAYERS))
    msg = ReadReadyBatch(0, NAMES[0], (), seq=1, hold_until_ms=HOLD, also=too_long)
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        CODEC.decode(CODEC.encode(msg))
    with pytest.raises(ProtocolError, match="run layer"):
        message_from_fields([*fields_of(run())[:10], [[1, NAMES[1]]]])


# ---------------------------------------------------------------- Decode


def test_a_run_is_one_read_one_reply_and_completes_its_requests() -> None:
    s = session()
    s.admit("a" + X9, [7, 8], [], 0.0)
    outs = s.receive(P, run(ReadRequest("a", (1, 2), (), 0, 0), done=("a",)), 0.5)
    (read,) = outs
    assert isinstance(read, Read)
    # Each layer's blocks 1, 2 -> 7, 8 (merged per layer), one after the other.
    assert read.plan.local_addrs.tolist() == [0x900000 + 7 * BPB + 0x10000 * i for i in range(3)]
    assert read.plan.remote_addrs.tolist() == [0x10000 * (i + 1) + BPB for i in range(3)]
    assert read.plan.lengths.tolist() == [2 * BPB] * 3 and read.plan.total_bytes == 6 * BPB
    assert read.plan.main_blocks.tolist() == [6]
    outs = perform(s, outs)
    assert outs[0] == Reply(P, ReadDone(0, 100, (), ((1, 101), (2, 102))))
    assert [o.layer_idx for o in outs if isinstance(o, LayerDone)] == [0, 1, 2]
    res = s.finish_step([s.local_report()], (), 2.0)
    assert res.finished == {"a" + X9} and not res.failed


def test_a_layer_of_a_run_that_cannot_be_read_fails_alone_and_every_layer_is_answered() -> None:
    s = session({NAMES[0]: DST[NAMES[0]], NAMES[2]: DST[NAMES[2]]})  # layer 1 unknown here
    s.admit("a" + X9, [7, 8], [], 0.0)
    outs = perform(s, s.receive(P, run(ReadRequest("a", (1, 2), (), 0, 0)), 0.5))
    assert answered_seqs(outs) == {100: "done", 101: "failed", 102: "done"}
    (failed,) = [o for o in outs if isinstance(o, LayerFailed)]
    assert failed.layer_idx == 1 and "unknown to decode destinations" in failed.reason
    # The failed layer failed its request; the layers after it skip that request.
    res = s.finish_step([s.local_report()], (), 2.0)
    assert res.failed == {"a" + X9}


def test_a_failed_read_fails_every_layer_of_the_run_in_one_reply() -> None:
    s = session()
    s.admit("a" + X9, [7, 8], [], 0.0)
    outs = perform(s, s.receive(P, run(ReadRequest("a", (1, 2), (), 0, 0)), 0.5), "io")
    (reply,) = [o for o in outs if isinstance(o, Reply)]
    assert reply.message == ReadFailed(0, "read failed: io", 100, ((1, 101), (2, 102)))
    assert [o.layer_idx for o in outs if isinstance(o, LayerFailed)] == [0, 1, 2]
    assert s.finish_step([s.local_report()], (), 2.0).failed == {"a" + X9}


def test_a_run_with_digests_is_refused_whole() -> None:
    s = session()
    s.admit("a" + X9, [7, 8], [], 0.0)
    req = ReadRequest("a", (1, 2), (), 0, 0, digests=((1, 2),))
    outs = s.receive(P, run(req), 0.5)
    assert answered_seqs(outs) == {100: "failed", 101: "failed", 102: "failed"}
    assert "digests are per layer" in outs[0].message.error


def test_a_run_naming_a_request_decode_forgot_answers_it_skipped_for_every_layer() -> None:
    s = session()
    s.admit("a" + X9, [7, 8], [], 0.0)
    outs = perform(s, s.receive(P, run(ReadRequest("a", (1, 2), (), 0, 0),
                                       ReadRequest("gone", (3,), (), 0, 0)), 0.5))
    assert outs[0] == Reply(P, ReadDone(0, 100, ("gone",), ((1, 101), (2, 102))))


def test_merged_plans_sum_each_requests_blocks() -> None:
    s = session()
    s.admit("a" + X9, [7, 8], [], 0.0)
    s.admit("b" + X9, [9], [], 0.0)
    batch = run(ReadRequest("a", (1, 2), (), 0, 0), ReadRequest("b", (4,), (), 0, 0))
    (read,) = s.receive(P, batch, 0.5)
    assert read.plan.ext_req_ids == ("a", "b")
    assert read.plan.main_blocks.tolist() == [6, 3]
    assert merge_plans([read.plan]) is read.plan


# ---------------------------------------------------------------- Prefill's session


def _prefill(layers: int = 4) -> Any:
    from rd2h.domain.prefill.prefill_session import PrefillSession, PrefillTimeouts
    return PrefillSession({n: SourceLayout(f"model.layers.{n}.attn",
                                           (TensorComponent(0x1000 * (n + 1), 64),))
                           for n in range(layers)},
                          PrefillTimeouts(meta_ack_s=2.0, layer_ack_s=5.0, device_event_s=3.0))


def _send(s: Any, layer: int, frame: int, awaits: bool = False) -> Any:
    from rd2h.domain.prefill.announce import LayerTarget, group_batches
    target = LayerTarget("A", ReadRequest("r", (0,), (0,), 0, 0), False, 0, 1, "r",
                         awaits=awaits)
    aid = s.announce(layer, group_batches(layer, s.layer_name(layer), [target]), 0.0)
    (send,) = [o for o in s.event_done(aid, 0.1) if type(o).__name__ == "SendBatch"]
    s.sent("A", aid, 0.2, frame)
    return send


def test_prefill_counts_frames_not_layers_and_only_where_decode_reads_runs() -> None:
    s = _prefill()
    s.prepare(["A"], 0.0)
    s.ack_received("A", 0.0, 5, layer_runs=True)
    assert s.layer_runs("A")
    first = _send(s, 0, frame=1)
    _send(s, 1, frame=2)
    _send(s, 2, frame=2)  # a layer run: frame 2 carries layers 1 and 2
    assert s.frames_on_wire("A") == 2
    s.reply("A", ReadDone(0, first.batch.seq), 0.3)
    assert s.frames_on_wire("A") == 1
    # Layers naming requests Decode may not have admitted yet (parallel dispatch) may be
    # kept there until it does: they never hold other layers back here.
    _send(s, 3, frame=3, awaits=True)
    assert s.frames_on_wire("A") == 1
    # A new handshake (Decode restarted) asks again; an ACK without the flag says no.
    s.prepare(["B"], 0.0)
    s.ack_received("B", 0.0, 6)
    assert not s.layer_runs("B") and not s.layer_runs("nowhere")
