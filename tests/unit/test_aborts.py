"""Aborts travel and fail nobody else (issue 21): a READ_READY_BATCH naming a request
Decode no longer knows is read for every other request and answered with a READ_DONE
that names the skipped one; a request vLLM aborted while its KV was still coming is
reported finished once no read can land in its blocks (vLLM frees them only then)."""

from __future__ import annotations

from rd2h.domain.decode.decode_session import (
    DecodeSession,
    LayerDone,
    Read,
    Reply,
    SendAck,
    Skipped,
)
from rd2h.domain.decode.request_book import DecodeRequestBook, StepOutcome
from rd2h.domain.planning.layout import DestinationLayout, DestTensor, SourceLayout, TensorComponent
from rd2h.domain.wire.protocol import (
    MfMeta,
    ReadDone,
    ReadReadyBatch,
    ReadRequest,
    fields_of,
    message_from_fields,
)

X9 = "-abcdefgh"
NAME = "model.layers.0.attn"
BPB, NB = 64, 16
SRC = SourceLayout(NAME, (TensorComponent(0x10000, BPB, num_blocks=NB),))
DST = DestinationLayout(NAME, (DestTensor(0x90000, BPB, NB),))
P = b"peer-1"


def session() -> DecodeSession:
    s = DecodeSession(destinations={NAME: DST}, d_rank=0, d_tp=1, main_shared=False)
    assert s.receive(P, MfMeta("p", {NAME: SRC.to_metadata()}), 0.0)[0] == SendAck(P)
    return s


def step(s: DecodeSession, finished: tuple[str, ...] = ()) -> StepOutcome:
    return s.finish_step([s.local_report()], finished, 1.0)


def clean(s: DecodeSession) -> bool:
    counters = s.counters()
    counters.pop("peers")
    return counters == dict.fromkeys(counters, 0) and s.reads_in_flight == 0


def test_read_done_names_skipped_requests_on_the_wire() -> None:
    msg = ReadDone(3, 7, ("gone-1", "gone-2"))
    fields = fields_of(msg)
    assert fields[3] == ["gone-1", "gone-2"]
    assert message_from_fields(fields) == msg
    # Without an echoed id (an older peer) nothing is appended after the layer.
    assert fields_of(ReadDone(3, None, ("x",))) == [b"read_done", 3]
    # A peer that does not know the field sends none; a signing envelope (bin) in its
    # place is not a list of ids.
    assert message_from_fields([b"read_done", 3, 7]) == ReadDone(3, 7)
    assert message_from_fields([b"read_done", 3, 7, b"\x00" * 56]) == ReadDone(3, 7)


def test_an_unknown_request_is_skipped_and_the_rest_of_the_layer_is_read() -> None:
    s = session()
    s.admit("live" + X9, [5, 6], [], 0.0)
    msg = ReadReadyBatch(0, NAME, (ReadRequest("aborted", (1,), (), 0, 0),
                                   ReadRequest("live", (2, 3), (), 0, 0)),
                         ("aborted", "live"), seq=11)
    (read,) = s.receive(P, msg, 0.5)
    assert isinstance(read, Read)
    assert read.plan.remote_addrs.tolist() == [0x10000 + 2 * BPB]  # only 'live'
    assert read.plan.local_addrs.tolist() == [0x90000 + 5 * BPB]
    assert s.begin_read(read.token)
    out = s.read_done(read.token, 0.6)
    assert out == [Reply(P, ReadDone(0, 11, ("aborted",))), LayerDone(0, ("live",)),
                   Skipped(0, ("aborted",))]
    res = step(s)
    assert res.finished == {"live" + X9} and not res.failed
    assert clean(s)  # no orphan kept for the id this rank had forgotten


def test_a_batch_of_only_unknown_requests_is_answered_at_once() -> None:
    s = session()
    msg = ReadReadyBatch(0, NAME, (ReadRequest("x", (1,), (), 0, 0),), (), seq=2)
    assert s.receive(P, msg, 0.0) == [Reply(P, ReadDone(0, 2, ("x",))), LayerDone(0, ()),
                                      Skipped(0, ("x",))]
    assert clean(s)


def test_bounds_violations_still_fail_the_layer() -> None:
    s = session()
    s.admit("live" + X9, [5], [], 0.0)
    msg = ReadReadyBatch(0, NAME, (ReadRequest("gone", (1,), (), 0, 0),
                                   ReadRequest("live", (NB + 4,), (), 0, 0)), (), seq=3)
    (reply, _failed) = s.receive(P, msg, 0.0)
    assert isinstance(reply, Reply) and type(reply.message).__name__ == "ReadFailed"


def test_an_abort_while_waiting_is_reported_once_no_read_can_land() -> None:
    s = session()
    s.admit("a" + X9, [5], [], 0.0)
    (read,) = s.receive(P, ReadReadyBatch(0, NAME, (ReadRequest("a", (1,), (), 0, 0),),
                                          (), seq=1), 0.1)
    assert s.begin_read(read.token)
    # vLLM aborts it while the read is in flight: not reported yet (bytes may land).
    res = step(s, finished=("a" + X9,))
    assert not res.finished and s.counters()["aborting"] == 1
    # A later announcement of it is skipped, not read and not failed.
    (reply, _, skipped) = s.receive(P, ReadReadyBatch(1, NAME, (ReadRequest(
        "a", (2,), (), 0, 0),), ("a",), seq=2), 0.2)
    assert reply == Reply(P, ReadDone(1, 2, ("a",))) and skipped == Skipped(1, ("a",))
    s.read_done(read.token, 0.3)
    res = step(s)
    assert res.finished == res.aborted == {"a" + X9} and not res.failed
    assert not res.invalid_block_ids
    assert step(s).finished == frozenset()  # reported exactly once
    assert clean(s)


def test_a_request_reported_before_the_abort_is_not_reported_again() -> None:
    book = DecodeRequestBook()
    book.admit("a" + X9, [1], [2], now=0.0)
    book.record_done(["a"], 0, 1)
    first = book.finish_step([book.local_report()], ())
    assert first.finished == {"a" + X9}
    # vLLM aborts it afterwards (its blocks already freed on the report): nothing more.
    again = book.finish_step([book.local_report()], ["a" + X9])
    assert again.finished == frozenset() and again.aborted == frozenset()


def test_abort_on_every_tp_rank_each_reports_when_its_own_reads_are_done() -> None:
    books = [DecodeRequestBook(), DecodeRequestBook()]
    for b in books:
        b.admit("a" + X9, [1], [2], now=0.0)
    reports = [b.local_report() for b in books]
    out0 = books[0].finish_step(reports, ["a" + X9], busy=())
    out1 = books[1].finish_step(reports, ["a" + X9], busy={"a"})
    assert out0.aborted == {"a" + X9} and out1.aborted == frozenset()
    reports = [b.local_report() for b in books]
    assert books[1].finish_step(reports, (), busy=()).aborted == {"a" + X9}
    assert books[0].finish_step(reports, ()).finished == frozenset()


# ---------------------------------------------------------------- the roles, end to end


def test_prefill_stops_announcing_a_request_decode_aborted_and_releases_it() -> None:
    """Prefill and Decode workers over an in-memory control channel and the inproc
    transport: Decode aborts one of two requests before Prefill's first layer; the other
    is read intact, the aborted one is skipped, never announced again and released."""
    import numpy as np
    from fakes.clock import ManualClock
    from fakes.logs import RecordingLogger
    from fakes.rig import Rig

    from rd2h.app.connector.plans import DecodeEndpoint, DecodeLoad, PrefillSend, StepPlan

    layers = {0: "model.layers.0.attn", 1: "model.layers.1.attn"}
    rig = Rig(control="memory", clock=ManualClock())
    p_engine, d_engine = rig.engine(), rig.engine()
    rng = np.random.default_rng(5)
    p_bufs = [rng.integers(1, 255, (NB, BPB), dtype=np.uint8) for _ in layers]
    d_bufs = [np.zeros((NB, BPB), dtype=np.uint8) for _ in layers]
    for b in p_bufs:
        p_engine.register_memory(b.ctypes.data, b.nbytes)
    for b in d_bufs:
        d_engine.register_memory(b.ctypes.data, b.nbytes)
    # Decode listens on tcp://10.0.0.9:31000 of the rig's in-memory network.
    dworker = rig.decode_worker(
        {n: DestinationLayout(n, (DestTensor(d_bufs[i].ctypes.data, BPB, NB),))
         for i, n in layers.items()}, d_engine,
        settings={"host": "10.0.0.9", "kv_port": 31000, "deadlines": {"request_s": 30}})
    p_log = RecordingLogger()
    pworker = rig.prefill_worker(
        {i: SourceLayout(n, (TensorComponent(p_bufs[i].ctypes.data, BPB, 1, 0, NB),))
         for i, n in layers.items()}, p_engine.session_id, log=p_log)
    sender = pworker.sender
    try:
        live, gone = "live" + X9, "gone" + X9
        dworker.bind_connector_metadata(StepPlan(loads=(
            DecodeLoad(live, (5, 6, 7), (5, 6, 7)), DecodeLoad(gone, (1, 2), (1, 2)))))
        res = dworker.get_transfer_results({gone})  # the client went away: vLLM aborted it
        assert res.finished_recving == {gone} and not res.failed_recving
        assert dworker.requests_aborted == 1 and dworker.requests_done == 0
        dec = DecodeEndpoint("10.0.0.9", 31000, 1)
        sends = (PrefillSend(live, "live", dec, (0, 1), (0, 1), 0, 0, False),
                 PrefillSend(gone, "gone", dec, (2, 3), (2, 3), 0, 0, False))
        pworker.bind_connector_metadata(StepPlan(sends=sends))
        pworker.save_kv_layer(layers[0])
        pworker.save_kv_layer(layers[1])
        assert pworker.layers_announced == 2
        assert sender.drain(5)
        np.testing.assert_array_equal(d_bufs[0][[5, 6]], p_bufs[0][[0, 1]])
        np.testing.assert_array_equal(d_bufs[1][[5, 6]], p_bufs[1][[0, 1]])
        assert not d_bufs[0][[1, 2]].any()  # nothing landed in the aborted request's blocks
        # Next chunk: only 'live' is announced; 'gone' is released once vLLM finishes it.
        sends = (PrefillSend(live, "live", dec, (4,), (4,), 2, 2, True),
                 PrefillSend(gone, "gone", dec, (5,), (5,), 2, 2, True))
        pworker.bind_connector_metadata(StepPlan(sends=sends))
        pworker.save_kv_layer(layers[0])
        pworker.save_kv_layer(layers[1])
        assert pworker.layers_announced == 4
        assert sender.drain(5)
        assert pworker.get_transfer_results({gone, live}).finished_sending == {gone, live}
        assert pworker.requests_skipped == 1 and pworker.requests_failed == 0
        assert [kw["request"] for e, kw in p_log.at("warning")
                if e.startswith("not announcing")] == [gone]
        res = dworker.get_transfer_results(set())
        assert res.finished_recving == {live} and not res.failed_recving
        np.testing.assert_array_equal(d_bufs[1][7], p_bufs[1][4])
        assert pworker.counters()["requests"] == 0
        assert dworker.counters() == dict.fromkeys(dworker.counters(), 0) | {"peers": 1}
    finally:
        rig.close()
