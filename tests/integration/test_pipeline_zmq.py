"""The pull pipeline end to end in one process: PrefillSender -> real ZeroMQ sockets on
127.0.0.1 -> DecodeReceiver, with the ``inproc`` transport copying real numpy memory.

Prefill source tensors and Decode destination tensors are numpy arrays registered
with their engines. Where a test needs to speak the wire directly it uses a raw
DEALER (fake Prefill) or a raw ROUTER (fake Decode) and ``MsgpackCodec``.
Every wait has a deadline; nothing sleeps for a fixed time to "let things happen".
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from fakes.net import HOST, free_port, wait_until
from fakes.rig import (
    COMPONENTS,
    FULL,
    MAIN_ONLY,
    P_BLOCKS,
    PLAIN,
    SENTINEL,
    WAIT,
    Bufs,
    DSide,
    PSide,
    Rig,
    Shape,
    decode_memory,
    internal,
    layer_name,
    recv_frame,
    recv_reply,
    step,
    step_all,
    targets,
)

from rd2h.adapters.torch.events import CpuDeviceEvents
from rd2h.adapters.zmq.channel import (
    BindError,
    tcp_endpoint,
)
from rd2h.app.decode import DecodeReceiver
from rd2h.app.prefill import PrefillSender
from rd2h.demo.faults import SlowTransfer
from rd2h.domain.decode.request_book import StepOutcome
from rd2h.domain.errors import LayerSendError
from rd2h.domain.planning.layout import SourceLayout, TensorComponent
from rd2h.domain.wire.protocol import (
    ACK,
    FEATURE_LAYER_RUNS,
    MF_META,
    READ_READY_BATCH,
    Message,
    MetaAck,
    MfMeta,
    ReadDone,
    ReadFailed,
    ReadReadyBatch,
    ReadRequest,
)

pytestmark = pytest.mark.integration

CODEC = PLAIN



# ====================================================================== wire helpers


def router_recv(router: zmq.Socket, timeout: float = WAIT) -> tuple[bytes, Message]:
    """What a Prefill DEALER sent to the raw ROUTER: (identity, decoded message)."""
    frames = recv_frame(router, timeout)
    identity, payload = frames[0], [f for f in frames[1:] if f]
    assert len(payload) == 1, frames
    return identity, CODEC.decode(payload[0])


def router_reply(router: zmq.Socket, identity: bytes, payload: bytes) -> None:
    router.send_multipart([identity, b"", payload])


def read_req(
    ext: str,
    p_main: Sequence[int],
    start: int = 0,
    p_idx: Sequence[int] | None = None,
    idx_start: int | None = None,
) -> ReadRequest:
    return ReadRequest(
        ext,
        tuple(p_main),
        tuple(p_main if p_idx is None else p_idx),
        start,
        start if idx_start is None else idx_start,
    )


def assert_landed(
    p: PSide,
    d: DSide,
    layer: int,
    p_main: Sequence[int],
    d_main: Sequence[int],
    d_idx: Sequence[int],
    p_idx: Sequence[int] | None = None,
    comps: Iterable[str] = COMPONENTS,
) -> None:
    """Decode's destination blocks hold exactly Prefill's source blocks."""
    p_idx = p_main if p_idx is None else p_idx
    for comp in comps:
        if (layer, comp) not in d.bufs:
            continue
        main = comp.startswith("main")
        src = p.bufs[(layer, comp)][list(p_main if main else p_idx)]
        dst = d.bufs[(layer, comp)][list(d_main if main else d_idx)]
        np.testing.assert_array_equal(dst, src, err_msg=f"layer {layer} {comp}")


def assert_untouched(d_bufs: Bufs, written: Mapping[tuple[int, str], Iterable[int]]) -> None:
    """Every destination row not in ``written`` still holds SENTINEL."""
    for key, arr in d_bufs.items():
        mask = np.ones(arr.shape[0], dtype=bool)
        mask[list(written.get(key, ()))] = False
        assert (arr[mask] == SENTINEL).all(), f"unexpected bytes in {key}"


def rows_of(
    layers: Iterable[int], d_main: Iterable[int], d_idx: Iterable[int]
) -> dict[tuple[int, str], set[int]]:
    out: dict[tuple[int, str], set[int]] = {}
    for layer in layers:
        for comp in COMPONENTS:
            out.setdefault((layer, comp), set()).update(
                d_main if comp.startswith("main") else d_idx
            )
    return out


def assert_no_leaks(
    *, receivers: Iterable[DecodeReceiver] = (), senders: Iterable[PrefillSender | None] = ()
) -> None:
    for r in receivers:
        counters = {k: v for k, v in r.counters().items() if k != "peers"}
        assert counters == dict.fromkeys(counters, 0), counters
    for s in senders:
        if s is not None:
            assert all(v == 0 for v in s.counters().values()), (
                s.counters()
            )


def snapshot_equal(before: Bufs, after: Bufs) -> None:
    assert before.keys() == after.keys()
    for key in before:
        np.testing.assert_array_equal(after[key], before[key], err_msg=str(key))


@dataclass(frozen=True)
class Req:
    ext: str
    p_main: tuple[int, ...]
    d_main: tuple[int, ...]
    d_idx: tuple[int, ...]
    p_idx: tuple[int, ...] = field(default=())

    @property
    def p_index(self) -> tuple[int, ...]:
        return self.p_idx or self.p_main

    def read(self, start: int = 0, end: int | None = None) -> ReadRequest:
        end = len(self.p_main) if end is None else end
        return read_req(self.ext, self.p_main[start:end], start, self.p_index[start:end], start)


# ====================================================================== 1. happy path


def test_happy_path_chunked_bytes_land_and_requests_finish(rig: Rig) -> None:
    shapes = {0: FULL, 1: FULL}
    d = rig.decode(shapes)  # both sides built by the container from settings
    assert d.endpoint == tcp_endpoint(HOST, d.container.config.kv_port())
    p = rig.prefill(shapes, seed=1)
    assert p.sender is not None
    events = CpuDeviceEvents()
    # Main and indexer ids are separate lists on both sides; D's ids never leave D.
    a = Req("req-a", p_main=(5, 1, 6), p_idx=(2, 7, 0), d_main=(9, 3, 4), d_idx=(0, 7, 2))
    b = Req("req-b", p_main=(2, 3), p_idx=(4, 3), d_main=(10, 11), d_idx=(5, 6))
    for r in (a, b):
        assert d.receiver.admit(internal(r.ext), r.d_main, r.d_idx) == r.ext
    # Two chunks: a = [0, 2) then [2, 3); b = [0, 2) then nothing new (done only).
    chunks = [((a, 0, 2), (b, 0, 2)), ((a, 2, 3), (b, 2, 2))]
    last = max(shapes)
    out = None
    for ci, chunk in enumerate(chunks):
        final = ci == len(chunks) - 1
        for layer in shapes:
            done = [r.ext for r, _, _ in chunk] if final and layer == last else []
            reads = [r.read(s, e) for r, s, e in chunk if e > s]
            n = p.sender.submit(layer, events.record(), targets(d.endpoint, reads, done))
            assert n == 1  # one READ_READY_BATCH per endpoint, all requests in it
        for layer in shapes:
            p.sender.wait_for_layer_send(layer, WAIT)
        out = step(d.receiver)
        if not final:
            assert out.finished == frozenset()
            assert d.receiver.counters()["admitted"] == 2
    assert out is not None
    assert out.finished == {internal(a.ext), internal(b.ext)}
    assert out.failed == frozenset()
    assert out.invalid_block_ids == frozenset()
    for layer in shapes:
        for r in (a, b):
            assert_landed(p, d, layer, r.p_main, r.d_main, r.d_idx, r.p_index)
    written = rows_of(shapes, a.d_main + b.d_main, a.d_idx + b.d_idx)
    assert_untouched(d.bufs, written)
    assert d.receiver.stats.layers_done == 4
    assert d.receiver.stats.layers_failed == 0
    assert p.sender.stats.layers_sent == 4
    assert_no_leaks(receivers=[d.receiver], senders=[p.sender])


# ====================================================================== 2. MF_META first


def test_read_ready_before_mf_meta_fails_until_meta_is_sent(rig: Rig) -> None:
    shapes = {0: FULL}
    d = rig.decode(shapes)
    p = rig.prefill_memory(shapes, seed=2)  # memory only: the test drives the wire
    m = Req("req-m", p_main=(1, 2), p_idx=(3, 4), d_main=(6, 8), d_idx=(1, 9))
    n = Req("req-n", p_main=(0,), d_main=(0,), d_idx=(0,))
    for r in (m, n):
        d.receiver.admit(internal(r.ext), r.d_main, r.d_idx)
    batch = ReadReadyBatch(0, layer_name(0), (m.read(),), (m.ext,), 0, 1)
    dealer = rig.dealer(d.endpoint)

    dealer.send(CODEC.encode(batch))
    reply = recv_reply(dealer)
    assert isinstance(reply, ReadFailed) and reply.layer_idx == 0
    assert "MF_META" in reply.error
    # The failure is recorded before the reply is sent.
    assert d.receiver.counters()["failed"] == 1
    assert_untouched(d.bufs, {})

    dealer.send(CODEC.encode(p.meta()))
    assert recv_reply(dealer) == ACK  # raw bytes, not msgpack
    # m failed: it is not read again (answered, skipped); n is read.
    dealer.send(CODEC.encode(dataclasses.replace(batch, seq=5)))
    assert recv_reply(dealer) == ReadDone(0, 5, (m.ext,))
    assert_untouched(d.bufs, {})
    batch = ReadReadyBatch(0, layer_name(0), (n.read(),), (n.ext,), 0, 1)
    dealer.send(CODEC.encode(batch))
    assert recv_reply(dealer) == ReadDone(0)
    assert_landed(p, d, 0, n.p_main, n.d_main, n.d_idx, n.p_index)

    # MF_META is per connection: a second connection has not sent one.
    other = rig.dealer(d.endpoint)
    other.send(CODEC.encode(ReadReadyBatch(0, layer_name(0), (n.read(),), (n.ext,))))
    reply = recv_reply(other)
    assert isinstance(reply, ReadFailed) and "MF_META" in reply.error
    assert_untouched(d.bufs, rows_of([0], n.d_main, n.d_idx))

    out = step(d.receiver)
    # A failure is sticky: the request is reported finished *and* failed, blocks invalid.
    assert out.finished == {internal(m.ext), internal(n.ext)}
    assert out.failed == {internal(m.ext), internal(n.ext)}
    assert out.invalid_block_ids == set(m.d_main + m.d_idx + n.d_main + n.d_idx)
    assert "MF_META" in out.reasons[internal(m.ext)]
    assert_no_leaks(receivers=[d.receiver])


# ====================================================================== 3. zero-block ranks


def test_decode_rank_owning_no_blocks_still_answers_read_done(rig: Rig) -> None:
    """P TP 2 -> D TP 2 (ratio 1), main-only layer, one block per chunk: the rank that
    owns none of a chunk's block (rotation by the chunk start) still acknowledges."""
    shapes = {0: MAIN_ONLY}
    pool = {"destinations": "sparse_kv_pool"}  # main KV in one TP-shared pool
    d0 = rig.decode(shapes, d_rank=0, d_tp=2, settings=pool)
    d1 = rig.decode(shapes, d_rank=1, d_tp=2, shared_main=d0.bufs, settings=pool)
    # main KV is replicated on every P rank: same seed, same bytes
    p0 = rig.prefill(shapes, seed=3)
    p1 = rig.prefill(shapes, seed=3)
    r = Req("req-z", p_main=(4, 6), d_main=(7, 2), d_idx=(5, 1))
    for d in (d0, d1):
        d.receiver.admit(internal(r.ext), r.d_main, r.d_idx)

    # chunk 1 = block [0, 1): rank 0 owns it, rank 1 owns nothing
    for p, d in ((p0, d0), (p1, d1)):
        p.sender.submit(0, None, targets(d.endpoint, [r.read(0, 1)]))
    for p in (p0, p1):
        p.sender.wait_for_layer_send(0, WAIT)  # raises on READ_FAILED
    assert d1.receiver.stats.layers_done == 1
    assert d1.receiver.stats.descriptors == 0
    assert d0.receiver.stats.descriptors == 2  # K and V of one block
    assert_untouched(d0.bufs, {(0, "main_k"): {7}, (0, "main_v"): {7}})

    # chunk 2 = block [1, 2) (final): rotation gives it to rank 1; rank 0 owns nothing
    for p, d in ((p0, d0), (p1, d1)):
        p.sender.submit(0, None, targets(d.endpoint, [r.read(1, 2)], done=[r.ext]))
    for p in (p0, p1):
        p.sender.wait_for_layer_send(0, WAIT)
    assert d0.receiver.stats.descriptors == 2 and d1.receiver.stats.descriptors == 2
    assert_landed(p0, d0, 0, r.p_main, r.d_main, r.d_idx)

    outs = step_all([d0.receiver, d1.receiver])
    for out in outs:
        assert out.finished == {internal(r.ext)}
        assert out.failed == frozenset()
    assert_no_leaks(receivers=[d0.receiver, d1.receiver], senders=[p0.sender, p1.sender])


def test_contributor_member_owning_nothing_acks_and_counts_for_completion(rig: Rig) -> None:
    """Ratio 2 on a main-only layer: member 1 never reads main, so it owns nothing;
    it still gets READ_DONE and its final-layer report completes the request."""
    shapes = {0: MAIN_ONLY}
    d = rig.decode(shapes)
    m0 = rig.prefill(shapes, seed=4)
    m1 = rig.prefill(shapes, seed=4)
    r = Req("req-y", p_main=(1, 2, 3), d_main=(4, 5, 6), d_idx=(0, 1, 2))
    d.receiver.admit(internal(r.ext), r.d_main, r.d_idx)

    m1.sender.submit(0, None, targets(d.endpoint, [r.read()], [r.ext], member=1, ratio=2))
    m1.sender.wait_for_layer_send(0, WAIT)
    assert d.receiver.stats.layers_done == 1 and d.receiver.stats.descriptors == 0
    assert_untouched(d.bufs, {})
    assert step(d.receiver).finished == frozenset()  # member 0 has not reported

    m0.sender.submit(0, None, targets(d.endpoint, [r.read()], [r.ext], member=0, ratio=2))
    m0.sender.wait_for_layer_send(0, WAIT)
    assert_landed(m0, d, 0, r.p_main, r.d_main, r.d_idx)
    out = step(d.receiver)
    assert out.finished == {internal(r.ext)} and out.failed == frozenset()
    assert_no_leaks(receivers=[d.receiver], senders=[m0.sender, m1.sender])


# ====================================================================== 4. layout mismatch


@pytest.mark.parametrize(
    ("p_shape", "d_shape", "component"),
    [
        (Shape(main_k=64), FULL, "main"),  # P advertises a different main block size
        (FULL, MAIN_ONLY, "indexer"),  # P has an indexer D does not have
        (MAIN_ONLY, FULL, "indexer"),  # D expects an indexer P does not have
        (Shape(scale=4), FULL, "scale"),  # LIC8 scale block size differs
        (Shape(scale=None), FULL, "scale"),  # D expects a scale P does not have
    ],
    ids=[
        "main-block-size",
        "p-extra-indexer",
        "p-missing-indexer",
        "scale-size",
        "p-missing-scale",
    ],
)
def test_layout_mismatch_fails_layer_and_writes_nothing(
    rig: Rig, p_shape: Shape, d_shape: Shape, component: str
) -> None:
    d = rig.decode({0: d_shape})
    p = rig.prefill({0: p_shape}, seed=5)
    r = Req("req-l", p_main=(0, 1), d_main=(2, 3), d_idx=(4, 5))
    d.receiver.admit(internal(r.ext), r.d_main, r.d_idx)
    before = d.snapshot()

    p.sender.submit(0, None, targets(d.endpoint, [r.read()], [r.ext]))
    with pytest.raises(LayerSendError) as info:
        p.sender.wait_for_layer_send(0, WAIT)
    message = str(info.value)
    assert info.value.layer_idx == 0
    assert repr(layer_name(0)) in message
    assert f"{component} layout mismatch" in message
    snapshot_equal(before, d.bufs)
    assert d.receiver.stats.layers_failed == 1 and d.receiver.stats.bytes_read == 0

    out = step(d.receiver)
    assert out.failed == {internal(r.ext)} == out.finished
    assert out.invalid_block_ids == set(r.d_main + r.d_idx)
    assert_no_leaks(receivers=[d.receiver], senders=[p.sender])


# ====================================================================== 5. transport failure


@pytest.mark.parametrize("fault", ["prefill-session-closed", "outside-registered-memory"])
def test_transport_failure_fails_layer_and_marks_requests(rig: Rig, fault: str) -> None:
    shapes = {0: FULL}
    d = rig.decode(shapes)
    p = rig.prefill_memory(shapes, seed=6)
    layouts = dict(p.layouts)
    if fault == "outside-registered-memory":
        # V of layer 0 advertised at memory P never registered (real memory, so a
        # transport that skipped the check would still not crash the test).
        stray = np.zeros_like(p.bufs[(0, "main_v")])
        rig.keep.append(stray)
        lay = layouts[0]
        layouts[0] = SourceLayout(
            lay.layer_name,
            (lay.main[0], TensorComponent(stray.ctypes.data, stray.shape[1])),
            lay.indexer,
            lay.scale,
        )
    sender = rig.start_sender(p, layouts=layouts)
    a = Req("req-t1", p_main=(0, 1), d_main=(2, 3), d_idx=(4, 5))
    b = Req("req-t2", p_main=(5,), d_main=(7,), d_idx=(8,))
    for r in (a, b):
        d.receiver.admit(internal(r.ext), r.d_main, r.d_idx)
    before = d.snapshot()
    if fault == "prefill-session-closed":
        p.engine.close()

    sender.submit(0, None, targets(d.endpoint, [a.read(), b.read()], [a.ext, b.ext]))
    with pytest.raises(LayerSendError) as info:
        sender.wait_for_layer_send(0, WAIT)
    message = str(info.value)
    assert "read failed" in message
    expected = (
        "unknown or closed"
        if fault == "prefill-session-closed"
        else "outside the registered memory"
    )
    assert expected in message
    snapshot_equal(before, d.bufs)  # the batch is validated as a whole before copying

    out = step(d.receiver)
    assert out.failed == {internal(a.ext), internal(b.ext)} == out.finished
    assert out.invalid_block_ids == set(a.d_main + a.d_idx + b.d_main + b.d_idx)
    assert all("read failed" in out.reasons[internal(r.ext)] for r in (a, b))
    assert_no_leaks(receivers=[d.receiver], senders=[sender])


# ====================================================================== 6. duplicate reports


def test_duplicate_final_reports_from_one_member_do_not_complete(rig: Rig) -> None:
    shapes = {0: FULL}
    d = rig.decode(shapes)
    m0 = rig.prefill(shapes, seed=7)
    m1 = rig.prefill(shapes, seed=8)  # different bytes: shows who wrote which block
    r = Req("req-dup", p_main=(1, 4), p_idx=(3, 6), d_main=(3, 8), d_idx=(2, 5))
    d.receiver.admit(internal(r.ext), r.d_main, r.d_idx)

    for _ in range(2):  # member 0 reports its final layer twice
        m0.sender.submit(0, None, targets(d.endpoint, [r.read()], [r.ext], member=0, ratio=2))
        m0.sender.wait_for_layer_send(0, WAIT)
        out = step(d.receiver)
        assert out.finished == frozenset()
        counters = d.receiver.counters()
        assert counters["contributors"] == 1 and counters["terminal"] == 0

    # Member 0 pulled all of main and its half of the indexer (block 0 of 2).
    assert_landed(m0, d, 0, r.p_main, r.d_main, r.d_idx, r.p_index, comps=("main_k", "main_v"))
    assert_landed(
        m0, d, 0, r.p_main[:1], r.d_main[:1], r.d_idx[:1], r.p_index[:1], comps=("indexer", "scale")
    )
    assert (d.bufs[(0, "indexer")][r.d_idx[1]] == SENTINEL).all()

    m1.sender.submit(0, None, targets(d.endpoint, [r.read()], [r.ext], member=1, ratio=2))
    m1.sender.wait_for_layer_send(0, WAIT)
    assert_landed(
        m1, d, 0, r.p_main[1:], r.d_main[1:], r.d_idx[1:], r.p_index[1:], comps=("indexer", "scale")
    )
    out = step(d.receiver)
    assert out.finished == {internal(r.ext)} and out.failed == frozenset()
    assert_no_leaks(receivers=[d.receiver], senders=[m0.sender, m1.sender])


# ====================================================================== 7. sender exit, deadlines


@pytest.mark.parametrize("endpoint_kind", ["silent-router", "no-listener"])
def test_sender_stop_fails_pending_layers_promptly(rig: Rig, endpoint_kind: str) -> None:
    shapes = {0: FULL, 1: FULL}
    if endpoint_kind == "silent-router":
        router, endpoint = rig.router()
    else:
        router, endpoint = None, tcp_endpoint(HOST, free_port())
    # Long deadlines: only stop() may end these waits quickly.
    p = rig.prefill(shapes, seed=9, meta_ack_timeout_s=30.0, layer_ack_timeout_s=30.0)
    r = Req("req-s", p_main=(0,), d_main=(0,), d_idx=(0,))
    for layer in shapes:
        assert p.sender.submit(layer, None, targets(endpoint, [r.read()])) == 1
    if router is not None:
        _, msg = router_recv(router)  # the sender is now waiting for the MF_META ACK
        assert isinstance(msg, MfMeta)

    t0 = time.monotonic()
    assert p.sender.stop(WAIT), "sender thread did not end"
    for layer in shapes:
        with pytest.raises(LayerSendError) as info:
            p.sender.wait_for_layer_send(layer, WAIT)
        assert "stopped" in str(info.value)
    assert time.monotonic() - t0 < 1.5, "stop() did not interrupt the sender promptly"
    assert not p.sender.alive
    assert_no_leaks(senders=[p.sender])
    with pytest.raises(LayerSendError, match="stopped"):
        p.sender.submit(0, None, targets(endpoint, [r.read()]))


def test_mf_meta_ack_deadline_fails_layer_naming_endpoint(rig: Rig) -> None:
    router, endpoint = rig.router()  # receives, never answers
    p = rig.prefill({0: FULL}, meta_ack_timeout_s=0.3)
    r = Req("req-ma", p_main=(0,), d_main=(0,), d_idx=(0,))
    t0 = time.monotonic()
    p.sender.submit(0, None, targets(endpoint, [r.read()]))
    with pytest.raises(LayerSendError) as info:
        p.sender.wait_for_layer_send(0, WAIT)
    elapsed = time.monotonic() - t0
    assert endpoint in str(info.value) and "MF_META" in str(info.value)
    assert 0.25 <= elapsed < 2.0, elapsed
    _, msg = router_recv(router, 0)  # the MF_META was sent, once
    assert isinstance(msg, MfMeta) and msg.p_session == p.engine.session_id
    assert_no_leaks(senders=[p.sender])


def test_layer_ack_deadline_fails_layer_naming_it(rig: Rig) -> None:
    router, endpoint = rig.router()
    p = rig.prefill(
        {0: FULL, 3: FULL}, meta_ack_timeout_s=0.4, layer_ack_timeout_s=0.2, event_timeout_s=0.2
    )
    r = Req("req-la", p_main=(0,), d_main=(0,), d_idx=(0,))
    t0 = time.monotonic()
    p.sender.submit(3, None, targets(endpoint, [r.read()], [r.ext]))
    identity, meta = router_recv(router)
    assert isinstance(meta, MfMeta)
    router_reply(router, identity, ACK)  # ACK the metadata ...
    _, ready = router_recv(router)
    assert isinstance(ready, ReadReadyBatch) and ready.layer_idx == 3  # ... never answer this
    with pytest.raises(LayerSendError) as info:
        p.sender.wait_for_layer_send(3, WAIT)
    elapsed = time.monotonic() - t0
    message = str(info.value)
    assert info.value.layer_idx == 3 and "layer 3" in message
    assert "no acknowledgement" in message and endpoint in message
    assert elapsed < 2.0, elapsed  # the layer's deadline, not the wait's own 5 s
    assert_no_leaks(senders=[p.sender])


class NeverEvent:
    """A device event whose work never completes."""

    def wait(self, timeout: float) -> bool:
        time.sleep(min(timeout, 0.01))
        return False


@pytest.mark.parametrize("how", ["event-deadline", "stop"])
def test_device_event_wait_is_bounded_and_stoppable(rig: Rig, how: str) -> None:
    router, endpoint = rig.router()
    event_timeout = 0.2 if how == "event-deadline" else 30.0
    p = rig.prefill({0: FULL}, event_timeout_s=event_timeout)
    r = Req("req-ev", p_main=(0,), d_main=(0,), d_idx=(0,))
    t0 = time.monotonic()
    p.sender.submit(0, NeverEvent(), targets(endpoint, [r.read()]))
    if how == "stop":
        assert p.sender.stop(WAIT)
    with pytest.raises(LayerSendError) as info:
        p.sender.wait_for_layer_send(0, WAIT)
    assert time.monotonic() - t0 < 2.0
    assert ("device event not complete" if how == "event-deadline" else "stopped") in str(
        info.value
    )
    assert router.poll(0) == 0  # nothing was announced for a layer that never completed
    assert_no_leaks(senders=[p.sender])


def test_sender_handshakes_again_after_decode_restarts_on_its_endpoint(rig: Rig) -> None:
    """ZMQ reconnects the DEALER silently; the new ROUTER has no MF_META for it. A
    READ_FAILED makes the sender send MF_META again, so later layers recover."""
    shapes = {0: FULL}
    d = rig.decode(shapes)
    # Short deadlines: a frame that went into the dying connection expires well
    # within one wait below, and the next attempt goes over the new one.
    p = rig.prefill(
        shapes, seed=13, meta_ack_timeout_s=1.0, layer_ack_timeout_s=0.5, event_timeout_s=0.5
    )
    first = Req("req-r0", p_main=(0,), d_main=(0,), d_idx=(0,))
    d.receiver.admit(internal(first.ext), first.d_main, first.d_idx)
    p.sender.submit(0, None, targets(d.endpoint, [first.read()], [first.ext]))
    p.sender.wait_for_layer_send(0, WAIT)
    assert step(d.receiver).finished == {internal(first.ext)}
    assert d.receiver.stop(WAIT)

    port = int(d.endpoint.rsplit(":", 1)[1])
    restarted: list[DecodeReceiver] = []

    def rebind() -> bool:  # zmq closes sockets asynchronously: the port frees shortly
        try:
            bound = rig.receiver(d.destinations, d.engine, settings={"kv_port": port})
        except BindError:
            return False
        restarted.append(bound.receiver)
        return True

    wait_until(rebind, "the decode port to be free again")
    d2 = restarted[0]
    # Several attempts: on a loaded machine the first ones can still meet the dying
    # connection (or expire under the short deadlines above) before the new one is used.
    reqs = [Req(f"req-r{i}", p_main=(i,), d_main=(i,), d_idx=(i,)) for i in range(1, P_BLOCKS)]
    ok = None
    for r in reqs:
        d2.admit(internal(r.ext), r.d_main, r.d_idx)
        p.sender.submit(0, None, targets(d.endpoint, [r.read()], [r.ext]))
        try:
            p.sender.wait_for_layer_send(0, WAIT)
        except LayerSendError:
            # Until the transport has connected again, a send fails at once ("has not
            # reconnected"): give it a moment.
            time.sleep(0.3)
            continue
        ok = r
        break
    assert ok is not None, "the sender never recovered after the decode restart"
    assert_landed(p, d, 0, ok.p_main, ok.d_main, ok.d_idx)
    admitted = {internal(r.ext) for r in reqs[: reqs.index(ok) + 1]}
    out = step(d2)
    assert internal(ok.ext) in out.finished and internal(ok.ext) not in out.failed
    assert out.finished <= admitted
    # An earlier attempt whose frame went into the dying connection never reached the
    # new receiver: that request still waits (its request deadline would fail it).
    # vLLM aborting it must leave nothing behind.
    step(d2, finished_by_vllm=admitted - out.finished)
    assert_no_leaks(receivers=[d2], senders=[p.sender])


# ====================================================================== 8. malformed frames


def test_malformed_frames_do_not_stop_the_receive_loop(rig: Rig) -> None:
    shapes = {0: FULL}
    d = rig.decode(shapes)
    p = rig.prefill_memory(shapes, seed=10)
    r = Req("req-x", p_main=(2, 3, 4), d_main=(1, 0, 11), d_idx=(6, 7, 8))
    d.receiver.admit(internal(r.ext), r.d_main, r.d_idx)
    dealer = rig.dealer(d.endpoint)
    valid = CODEC.encode(ReadReadyBatch(0, layer_name(0), (r.read(),), (r.ext,)))
    meta = CODEC.encode(p.meta())

    def pack(value: Any) -> bytes:
        return msgpack.packb(value, use_bin_type=True)

    junk = [
        b"\xc1garbage",  # 0xc1 is never valid msgpack
        valid[:-3],  # truncated tuple
        valid + b"\x00",  # trailing bytes
        pack([b"bogus_tag", 1, 2]),  # unknown tag: logged and ignored
        pack(["read_ready_batch", 0, layer_name(0), []]),  # tag as str, not bin
        pack(42),
        pack([]),
        pack({"a": 1}),
        pack([READ_READY_BATCH]),  # too short to name a layer
        pack([READ_READY_BATCH, -1, layer_name(0), []]),  # negative layer index
        pack([MF_META, "s", b"\xc1"]),  # nested metadata not msgpack
        pack([MF_META, "s", {"layer": {"base_addrs": [1]}}]),  # metadata lacks keys
        b"\x91" * 100_000 + b"\xc0",  # arrays nested 100k deep
        b"\xdd\xff\xff\xff\xff",  # array header claiming 4G items
    ]
    for frame in junk:
        dealer.send(frame)
    dealer.send_multipart([b"\x93\x01", b"\x02"])  # multi-frame, malformed when joined
    dealer.send_multipart([valid, b"extra"])  # multi-frame: valid + junk
    dealer.send(b"")  # empty frame
    dealer.send_multipart([b"", b""])  # only empty frames
    # READ_READY with a readable layer index but bad fields -> READ_FAILED for it
    bad_ready = [
        pack([READ_READY_BATCH, 7, layer_name(0), "not-a-list"]),
        pack([READ_READY_BATCH, 8, layer_name(0), [[r.ext, [1, -2]]]]),
        pack([READ_READY_BATCH, 9, layer_name(0), [[r.ext, [1], [1], 0]]]),
        pack([READ_READY_BATCH, 10, layer_name(0), [], [], 3, 2]),  # member >= ratio
        pack([READ_READY_BATCH, 11, layer_name(0), [], [], 0]),  # member without ratio
        pack([READ_READY_BATCH, 12, 99, []]),  # layer name not a str
    ]
    for frame in bad_ready:
        dealer.send(frame)
        dealer.send(b"\xc1")  # garbage between them gets no reply
    for layer in range(7, 13):
        reply = recv_reply(dealer)
        assert isinstance(reply, ReadFailed) and reply.layer_idx == layer, reply
        assert "malformed" in reply.error
    # Replies come in order on one connection: the next reply must be the ACK.
    dealer.send_multipart([b"", meta])  # an empty delimiter frame is ignored
    assert recv_reply(dealer) == ACK
    dealer.send(valid)
    assert recv_reply(dealer) == ReadDone(0)

    assert d.receiver.running
    assert_landed(p, d, 0, r.p_main, r.d_main, r.d_idx)
    assert_untouched(d.bufs, rows_of([0], r.d_main, r.d_idx))
    assert d.receiver.stats.malformed >= len(junk) + len(bad_ready)
    assert "ignoring unknown message type" in d.log.events("warning")
    # Unparseable messages name no request, so nothing was failed.
    out = step(d.receiver)
    assert out.finished == {internal(r.ext)} and out.failed == frozenset()
    assert_no_leaks(receivers=[d.receiver])


# ====================================================================== 9. bind failure


def test_second_receiver_on_a_bound_port_raises_bind_error(rig: Rig) -> None:
    shapes = {0: FULL}
    d = rig.decode(shapes)
    port = int(d.endpoint.rsplit(":", 1)[1])
    engine = rig.engine()
    _, _, dests = decode_memory(shapes, engine)

    container = rig.container("decode", {"kv_port": port}, transport=engine)
    second = container.decode_receiver(destinations=dests)
    t0 = time.monotonic()
    with pytest.raises(BindError, match=str(port)):
        second.start()
    assert time.monotonic() - t0 < 2.0
    assert not second.running and second.stop(1.0)
    with pytest.raises(BindError, match=str(port)):  # through the rig: refused, not retried
        rig.receiver(dests, engine, settings={"kv_port": port})

    # The first receiver still serves.
    dealer = rig.dealer(d.endpoint)
    dealer.send(CODEC.encode(rig.prefill_memory(shapes).meta()))
    assert recv_reply(dealer) == ACK


# ====================================================================== 10. storage-slot gates


def test_shared_storage_gate_blocks_until_slow_decode_acks(rig: Rig) -> None:
    router, endpoint = rig.router()  # a slow Decode: the test decides when it answers
    shapes = {0: FULL, 1: FULL, 2: FULL}
    p = rig.prefill(shapes, share={2: 0})  # layers 0 and 2 use one physical buffer
    assert p.layouts[2].storage_keys == p.layouts[0].storage_keys
    r = Req("req-g", p_main=(0, 1), d_main=(0, 1), d_idx=(0, 1))
    p.sender.submit(0, None, targets(endpoint, [r.read()]))
    identity, meta = router_recv(router)
    assert isinstance(meta, MfMeta)
    router_reply(router, identity, ACK)
    _, ready = router_recv(router)
    assert isinstance(ready, ReadReadyBatch) and ready.layer_idx == 0

    t0 = time.monotonic()
    with pytest.raises(LayerSendError, match=r"within 0\.3 s") as info:
        p.sender.wait_for_layer_send(2, timeout=0.3)  # layer 2 shares layer 0's slots
    assert endpoint in str(info.value)
    assert 0.25 <= time.monotonic() - t0 < 2.0
    p.sender.wait_for_layer_send(1, timeout=0.3)  # separate storage: open
    assert p.sender.counters()["closed_slots"] == 2  # main and indexer(+scale) slots

    router_reply(router, identity, CODEC.encode(ReadDone(0)))
    p.sender.wait_for_layer_send(2, WAIT)
    p.sender.wait_for_layer_send(0, WAIT)
    assert_no_leaks(senders=[p.sender])


def test_shared_storage_reuse_with_real_decode_lands_both_layers(rig: Rig) -> None:
    shapes = {0: FULL, 1: FULL, 2: FULL}
    d = rig.decode(shapes)
    p = rig.prefill(shapes, seed=11, share={2: 0})
    r = Req("req-reuse", p_main=(3, 5), p_idx=(1, 2), d_main=(4, 9), d_idx=(10, 3))
    d.receiver.admit(internal(r.ext), r.d_main, r.d_idx)
    rng = np.random.default_rng(99)
    expected: dict[tuple[int, str], np.ndarray] = {}
    for layer in shapes:
        if layer == 2:  # compute may overwrite the shared buffer only once the gate opens
            p.sender.wait_for_layer_send(2, WAIT)
            for comp in COMPONENTS:
                arr = p.bufs[(2, comp)]
                arr[:] = rng.integers(0, 256, arr.shape, dtype=np.uint8)
        for comp in COMPONENTS:
            ids = r.p_main if comp.startswith("main") else r.p_index
            expected[(layer, comp)] = p.bufs[(layer, comp)][list(ids)].copy()
        done = [r.ext] if layer == 2 else []
        p.sender.submit(layer, None, targets(d.endpoint, [r.read()], done))
    for layer in shapes:
        p.sender.wait_for_layer_send(layer, WAIT)
    for (layer, comp), want in expected.items():
        ids = r.d_main if comp.startswith("main") else r.d_idx
        np.testing.assert_array_equal(
            d.bufs[(layer, comp)][list(ids)], want, err_msg=f"layer {layer} {comp}"
        )
    assert not np.array_equal(expected[(0, "main_k")], expected[(2, "main_k")])
    out = step(d.receiver)
    assert out.finished == {internal(r.ext)} and out.failed == frozenset()
    assert_no_leaks(receivers=[d.receiver], senders=[p.sender])


# ====================================================================== 11. leak accounting


def test_mixed_outcomes_leave_no_state_behind(rig: Rig) -> None:
    """Success, a planning failure, a request vLLM finished early and a done report
    that arrives before admission: after the steps that report them, nothing is left."""
    shapes = {0: FULL, 1: MAIN_ONLY}
    d = rig.decode(shapes)
    p = rig.prefill(shapes, seed=12)
    ok = Req("req-ok", p_main=(0, 1), d_main=(0, 1), d_idx=(0, 1))
    # D admitted 1 block, P announces 2: "do not fit" fails the whole layer (one batch)
    too_big = Req("req-big", p_main=(2, 3), d_main=(2,), d_idx=(2,))
    early = Req("req-early", p_main=(4,), d_main=(3,), d_idx=(3,))
    for r in (ok, too_big, early):
        d.receiver.admit(internal(r.ext), r.d_main, r.d_idx)

    # vLLM finishes (e.g. cancels) req-early before any KV: vLLM holds its blocks until
    # the connector names it, so it is reported (aborted) and cleaned in this step.
    out = step(d.receiver, finished_by_vllm=[internal(early.ext)])
    assert out.finished == out.aborted == {internal(early.ext)}
    assert d.receiver.counters()["admitted"] == 2

    p.sender.submit(0, None, targets(d.endpoint, [ok.read()]))
    p.sender.wait_for_layer_send(0, WAIT)
    p.sender.submit(0, None, targets(d.endpoint, [too_big.read()]))
    with pytest.raises(LayerSendError, match="do not fit"):
        p.sender.wait_for_layer_send(0, WAIT)
    # final layer: main-only, done for both; too_big is already terminal (failed)
    p.sender.submit(1, None, targets(d.endpoint, [ok.read()], [ok.ext, too_big.ext]))
    p.sender.wait_for_layer_send(1, WAIT)
    out = step(d.receiver)
    assert out.finished == {internal(ok.ext), internal(too_big.ext)}
    assert out.failed == {internal(too_big.ext)}
    assert out.invalid_block_ids == set(too_big.d_main + too_big.d_idx)
    assert_landed(p, d, 0, ok.p_main, ok.d_main, ok.d_idx)
    assert_landed(p, d, 1, ok.p_main, ok.d_main, ok.d_idx)
    assert_no_leaks(receivers=[d.receiver], senders=[p.sender])

    # A done-only report (no blocks left to read) before the worker admitted the request
    # stays pending until the admission maps it, then is reported once.
    late = Req("req-late", p_main=(), d_main=(5,), d_idx=(5,))
    p.sender.submit(1, None, targets(d.endpoint, done=[late.ext]))
    p.sender.wait_for_layer_send(1, WAIT)
    assert step(d.receiver).finished == frozenset()
    assert d.receiver.counters()["pending_finished"] == 1
    d.receiver.admit(internal(late.ext), late.d_main, late.d_idx)
    out = step(d.receiver)
    assert out.finished == {internal(late.ext)} and out.failed == frozenset()
    assert_no_leaks(receivers=[d.receiver], senders=[p.sender])


def test_request_deadline_fails_and_cleans_up(rig: Rig) -> None:
    d = rig.decode({0: FULL}, request_timeout_s=0.2)
    r = Req("req-slow", p_main=(), d_main=(1, 2), d_idx=(3,))
    d.receiver.admit(internal(r.ext), r.d_main, r.d_idx)
    outcomes: list[StepOutcome] = []

    def stepped() -> bool:
        outcomes.append(step(d.receiver))
        return bool(outcomes[-1].finished)

    wait_until(stepped, "the request deadline to fail the request", timeout=WAIT)
    out = outcomes[-1]
    assert out.failed == {internal(r.ext)}
    assert out.invalid_block_ids == {1, 2, 3}
    assert "no KV arrived" in out.reasons[internal(r.ext)]
    assert_no_leaks(receivers=[d.receiver])


def test_announcement_for_a_request_decode_forgot_is_skipped_and_leaves_nothing(
        rig: Rig) -> None:
    """vLLM aborts a request on Decode while Prefill still announces it: the aborted
    request is reported at once (vLLM frees its blocks then); the announcement is
    answered READ_DONE naming it as skipped, nothing is read into its old blocks, and no
    state is kept for the id."""
    d = rig.decode({0: FULL}, request_timeout_s=0.3)
    p = rig.prefill({0: FULL}, seed=14)
    r = Req("req-gone", p_main=(0,), d_main=(0,), d_idx=(0,))
    d.receiver.admit(internal(r.ext), r.d_main, r.d_idx)
    out = step(d.receiver, finished_by_vllm=[internal(r.ext)])
    assert out.finished == out.aborted == {internal(r.ext)} and not out.failed
    assert_no_leaks(receivers=[d.receiver])

    p.sender.submit(0, None, targets(d.endpoint, [r.read()], [r.ext]))
    p.sender.wait_for_layer_send(0, WAIT)  # answered, not failed
    assert_untouched(d.bufs, {})
    assert d.receiver.stats.skipped == 1
    assert step(d.receiver).finished == frozenset()  # reported once
    assert_no_leaks(receivers=[d.receiver], senders=[p.sender])


# ====================================================================== layer runs


def _slow_decode(rig: Rig, shapes: Mapping[int, Shape], seconds: float) -> DSide:
    """A Decode rank whose every batched read first waits ``seconds``: Prefill gets ahead."""
    engine = rig.engine()
    whole, bufs, dests = decode_memory(shapes, engine, None)
    rig.keep.append(whole)
    bound = rig.receiver(dests, SlowTransfer(engine, seconds))
    return DSide(engine, whole, bufs, dests, bound.receiver, bound.endpoint)


def _announce_every_layer(p: PSide, d: DSide, shapes: Mapping[int, Shape], ext: str, *,
                          hold: bool = False) -> Req:
    """Admit one request of three blocks on Decode, then announce it in every layer
    (``hold``: held back), its final report on the last."""
    a = Req(ext, p_main=(5, 1, 6), p_idx=(2, 7, 0), d_main=(9, 3, 4), d_idx=(0, 7, 2))
    assert d.receiver.admit(internal(a.ext), a.d_main, a.d_idx) == a.ext
    events = CpuDeviceEvents()
    for layer in shapes:
        done = [a.ext] if layer == max(shapes) else []
        assert p.sender.submit(layer, events.record(), targets(d.endpoint, [a.read()], done),
                               hold=hold) == 1
    return a


def _landed_alone(p: PSide, d: DSide, shapes: Mapping[int, Shape], a: Req) -> None:
    """Every layer's gate opened, Decode's step finished ``a`` alone, its bytes landed in
    every layer and nothing else of Decode's memory was written."""
    for layer in shapes:
        p.sender.wait_for_layer_send(layer, WAIT)
    out = step(d.receiver)
    assert out.finished == {internal(a.ext)} and not out.failed
    for layer in shapes:
        assert_landed(p, d, layer, a.p_main, a.d_main, a.d_idx, a.p_index)
    assert_untouched(d.bufs, rows_of(shapes, a.d_main, a.d_idx))


@pytest.mark.parametrize("max_layers", [64, 1])
def test_layers_ready_while_decode_reads_go_as_one_layer_run(rig: Rig, max_layers: int) -> None:
    """While two frames to a Decode that reads layer runs are unanswered, Prefill keeps
    the next announcements and sends them together, in one frame: one batched read and
    one reply on Decode for all of them, every byte landed. ``max_layers_per_frame: 1``
    offers no runs: one layer per frame, as before."""
    shapes = {i: FULL for i in range(8)}
    d = _slow_decode(rig, shapes, 0.05)
    p = rig.prefill(shapes, seed=3, settings={"limits": {"max_layers_per_frame": max_layers}})
    assert p.sender is not None
    a = _announce_every_layer(p, d, shapes, "run-a")
    _landed_alone(p, d, shapes, a)
    assert d.receiver.stats.layers_done == 8 and d.receiver.stats.layers_failed == 0
    assert p.sender.stats.layers_sent == 8 and p.sender.stats.layers_failed == 0
    if max_layers == 1:
        assert p.sender.stats.frames_sent == 8
    else:  # at most two frames went before the first reply; the rest waited and went as one
        assert p.sender.stats.frames_sent <= 3
    assert_no_leaks(receivers=[d.receiver], senders=[p.sender])


def test_held_layers_go_in_one_frame_when_released_and_land(rig: Rig) -> None:
    """``submit(hold=True)`` keeps a layer back (the sender's thread never sees it) until
    ``release``: then every held layer goes, in order, as one layer run, read in one
    batched read and answered by one reply; every byte lands."""
    shapes = {i: FULL for i in range(8)}
    d = rig.decode(shapes)
    p = rig.prefill(shapes, seed=5)
    assert p.sender is not None
    a = _announce_every_layer(p, d, shapes, "held-a", hold=True)
    assert p.sender.held == 8 and p.sender.counters()["queued_tasks"] == 8
    assert p.sender.stats.frames_sent == 0 and not p.sender.gate_open(0)
    assert p.sender.release() and not p.sender.release()  # once; then nothing is held
    _landed_alone(p, d, shapes, a)
    assert p.sender.stats.frames_sent == 1 and p.sender.stats.layers_sent == 8
    assert d.receiver.stats.layers_done == 8
    assert_no_leaks(receivers=[d.receiver], senders=[p.sender])


def test_a_layer_not_held_takes_the_held_ones_with_it_in_order(rig: Rig) -> None:
    """A ``submit`` without ``hold`` sends what was held before it, first: one frame."""
    shapes = {i: FULL for i in range(4)}
    d = rig.decode(shapes)
    p = rig.prefill(shapes, seed=6)
    assert p.sender is not None
    a = Req("held-b", p_main=(3, 4), d_main=(1, 2), d_idx=(5, 6))
    assert d.receiver.admit(internal(a.ext), a.d_main, a.d_idx) == a.ext
    for layer in shapes:
        last = layer == max(shapes)
        p.sender.submit(layer, None, targets(d.endpoint, [a.read()], [a.ext] if last else []),
                        hold=not last)
    assert p.sender.held == 0
    for layer in shapes:
        p.sender.wait_for_layer_send(layer, WAIT)
    assert step(d.receiver).finished == {internal(a.ext)}
    assert p.sender.stats.frames_sent == 1 and p.sender.stats.layers_sent == 4
    assert_no_leaks(receivers=[d.receiver], senders=[p.sender])


@pytest.mark.parametrize("how", ["gate", "drain"])
def test_waiting_on_a_held_layer_releases_it(rig: Rig, how: str) -> None:
    """A gate wait (shared buffers: the next write waits for this layer's read) or
    ``drain`` on a held layer sends it instead of waiting out its deadline."""
    shapes = {0: FULL, 1: FULL}
    d = rig.decode(shapes)
    p = rig.prefill(shapes, seed=7)
    assert p.sender is not None
    a = Req("held-c", p_main=(2,), d_main=(4,), d_idx=(4,))
    assert d.receiver.admit(internal(a.ext), a.d_main, a.d_idx) == a.ext
    p.sender.submit(0, None, targets(d.endpoint, [a.read()]), hold=True)
    p.sender.submit(1, None, targets(d.endpoint, [a.read()], [a.ext]), hold=True)
    t0 = time.monotonic()
    if how == "gate":
        p.sender.wait_for_layer_send(1, WAIT)
    else:
        assert p.sender.drain(WAIT)
    assert time.monotonic() - t0 < WAIT / 2 and p.sender.held == 0
    p.sender.wait_for_layer_send(0, WAIT)
    assert step(d.receiver).finished == {internal(a.ext)}
    assert_no_leaks(receivers=[d.receiver], senders=[p.sender])


def test_stop_fails_held_layers(rig: Rig) -> None:
    """Held layers are pending layers: the sender's stop fails them, and nothing is left."""
    shapes = {0: FULL}
    d = rig.decode(shapes)
    p = rig.prefill(shapes, seed=8)
    assert p.sender is not None
    p.sender.submit(0, None, targets(d.endpoint, [read_req("held-d", (1,))]), hold=True)
    assert p.sender.stop(WAIT)
    with pytest.raises(LayerSendError, match="stopped"):
        p.sender.wait_for_layer_send(0, WAIT)
    assert p.sender.held == 0
    assert_no_leaks(senders=[p.sender])


def test_a_decode_that_does_not_read_layer_runs_gets_one_layer_per_frame(rig: Rig) -> None:
    """An older Decode (or the original implementation) acknowledges MF_META without the
    layer-runs flag: every READ_READY_BATCH then carries one layer, none is held back,
    and its one-layer replies answer them."""
    shapes = {i: FULL for i in range(6)}
    p = rig.prefill(shapes, seed=4)
    assert p.sender is not None
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = free_port()
    router.bind(f"tcp://{HOST}:{port}")
    endpoint = f"tcp://{HOST}:{port}"
    try:
        events = CpuDeviceEvents()
        for layer in shapes:
            p.sender.submit(layer, events.record(), targets(endpoint, [read_req("x", (1, 2))]))
        identity, meta = router_recv(router)
        assert isinstance(meta, MfMeta) and meta.features == (FEATURE_LAYER_RUNS,)
        router_reply(router, identity, CODEC.encode(MetaAck(5)))  # no flag byte
        seen = []
        while len(seen) < len(shapes):
            identity, msg = router_recv(router)
            assert isinstance(msg, ReadReadyBatch) and msg.also == ()
            seen.append(msg.layer_idx)
            router_reply(router, identity, CODEC.encode(ReadDone(msg.layer_idx, msg.seq)))
        assert sorted(seen) == list(shapes)
        for layer in shapes:
            p.sender.wait_for_layer_send(layer, WAIT)
        assert p.sender.stats.frames_sent == len(shapes) and p.sender.stats.layers_failed == 0
    finally:
        router.close(0)
