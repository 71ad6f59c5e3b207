"""Liveness and deadline logic, without sockets: the pure state (gates, per-peer
contributions, orphan expiry) and the Prefill sender / Decode receiver driven through
in-memory control channels that report lost connections like the ZMQ adapter does.
Every wait has a deadline; nothing sleeps for a fixed time."""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import pytest
from fakes.logs import RecordingLogger
from fakes.net import wait_until
from fakes.threads import voluntary_switches

from rd2h.adapters.inproc import InprocTransferEngine
from rd2h.adapters.msgpack import MsgpackCodec
from rd2h.adapters.torch.exchange import InMemoryExchangeGroup
from rd2h.app.prefill import LayerTarget, PrefillSender
from rd2h.app.settings import Rd2hSettings
from rd2h.bootstrap.container import bootstrap
from rd2h.domain.decode.contributors import PeerContributions
from rd2h.domain.decode.request_book import DecodeRequestBook
from rd2h.domain.errors import LayerSendError
from rd2h.domain.planning.layout import DestinationLayout, DestTensor, SourceLayout, TensorComponent
from rd2h.domain.wire.protocol import (
    ACK,
    MfMeta,
    ReadDone,
    ReadFailed,
    ReadReadyBatch,
    ReadRequest,
)

CODEC = MsgpackCodec()
WAIT = 5.0
X9 = "X" * 9  # vLLM's engine suffix stand-in


# ====================================================================== pure state




def test_peer_contributions_index_both_ways() -> None:
    pc = PeerContributions()
    pc.note("p1", ["a", "b"])
    pc.note("p2", ["b"])
    assert len(pc) == 3 and pc.peers == 2
    pc.done("p1", ["a"])
    pc.discard_request("b")
    assert len(pc) == 0 and pc.peers == 0
    pc.note("p1", ["c"])
    assert pc.take_peer("p1") == {"c"} and pc.take_peer("p1") == set()
    assert len(pc) == 0


def _step(*books: DecodeRequestBook, now: float = 0.0):
    reports = [b.local_report() for b in books]
    return [b.finish_step(reports, (), now=now) for b in books]


def test_lost_peer_fails_exactly_the_requests_it_was_still_contributing_to() -> None:
    book = DecodeRequestBook()
    for name, blocks in (("a", [1]), ("b", [2]), ("c", [3]), ("d", [4])):
        book.admit(name + X9, blocks, [10 + blocks[0]], now=0.0)
    book.note_contribution("p1", ["a", "b", "ghost"])  # "ghost" is not admitted: ignored
    book.note_contribution("p2", ["b", "c"])
    assert book.record_done(["a"], 0, 1, peer="p1") == ["a"]  # p1 finished a
    assert book.fail_peer("p1", "p1 gone", now=1.0) == ["b"]
    assert book.fail_peer("p2", "p2 gone", now=1.0) == ["c"]  # b already failed
    assert book.fail_peer("p3", "never seen", now=1.0) == []  # d never heard: deadline
    (out,) = _step(book)
    assert out.finished == {"a" + X9, "b" + X9, "c" + X9}
    assert out.failed == {"b" + X9, "c" + X9}
    assert out.reasons == {"b" + X9: "p1 gone", "c" + X9: "p2 gone"}
    assert out.invalid_block_ids == {2, 12, 3, 13}
    assert book.expire(now=200.0, timeout=120.0) == ["d"]
    (out,) = _step(book)
    assert out.failed == {"d" + X9} and "within 120 s" in out.reasons["d" + X9]
    assert all(v == 0 for v in book.counters().values()), book.counters()


def test_lost_member_of_a_contributor_group_fails_the_request() -> None:
    book = DecodeRequestBook()
    book.admit("r" + X9, [1], [2], now=0.0)
    book.note_contribution("member0", ["r"])
    book.note_contribution("member1", ["r"])
    assert book.record_done(["r"], 0, 2, peer="member0") == []  # waits for member 1
    assert book.fail_peer("member0", "gone", now=1.0) == []  # its part was complete
    assert book.fail_peer("member1", "member 1 gone", now=1.0) == ["r"]
    (out,) = _step(book)
    assert out.failed == {"r" + X9} and out.reasons["r" + X9] == "member 1 gone"
    assert all(v == 0 for v in book.counters().values())


def test_failure_learned_from_another_rank_for_an_unknown_request_expires() -> None:
    """A late announcement for a request both ranks already forgot: rank 0 fails it;
    rank 1 learns that in the exchange. Neither may keep that state forever."""
    r0, r1 = DecodeRequestBook(), DecodeRequestBook()
    r0.record_failed(["late"], "unknown request", now=0.0)
    _step(r0, r1, now=0.0)
    _step(r0, r1, now=0.1)
    assert r1.counters()["orphans"] == 1
    for book in (r0, r1):
        book.expire(now=10.0, timeout=5.0)
        assert all(v == 0 for v in book.counters().values()), book.counters()


# ====================================================================== Prefill sender


class FakeClients:
    """Acknowledges MF_META at once; replies to ready messages only when the test says
    so; reports lost endpoints like the ZMQ monitor does."""

    def __init__(self) -> None:
        self.replies: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.ready: queue.Queue[tuple[str, ReadReadyBatch]] = queue.Queue()
        self.metas: list[str] = []
        self.disconnects: list[str] = []
        self._lost: list[str] = []
        self._back: list[str] = []
        self._lock = threading.Lock()

    def connect(self, endpoint: str) -> None:
        pass

    def disconnect(self, endpoint: str) -> None:
        with self._lock:
            self.disconnects.append(endpoint)

    def send(self, endpoint: str, payload: bytes, timeout: float = 5.0) -> None:
        msg = CODEC.decode(payload)
        if isinstance(msg, MfMeta):
            self.metas.append(endpoint)
            self.replies.put((endpoint, ACK))
        else:
            assert isinstance(msg, ReadReadyBatch)
            self.ready.put((endpoint, msg))

    def poll(self, timeout: float) -> list[tuple[str, bytes]]:
        try:
            out = [self.replies.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                out.append(self.replies.get_nowait())
            except queue.Empty:
                return [(ep, p) for ep, p in out if p]

    def reconnected(self) -> list[str]:
        with self._lock:
            back, self._back = self._back, []
        return back

    def disconnected(self) -> list[str]:
        with self._lock:
            lost, self._lost = self._lost, []
        return lost

    def lose(self, endpoint: str, reconnects: bool = True) -> None:
        """The connection to ``endpoint`` closed; ``reconnects``: the transport connects
        again by itself (the peer is alive), reported after the loss."""
        with self._lock:
            self._lost.append(endpoint)
            if reconnects:
                self._back.append(endpoint)
        self.wake()

    def come_back(self, endpoint: str) -> None:
        with self._lock:
            self._back.append(endpoint)
        self.wake()

    def reply(self, endpoint: str, message: ReadDone | ReadFailed) -> None:
        self.replies.put((endpoint, CODEC.encode(message)))

    def wake(self) -> None:
        self.replies.put(("", b""))

    def close(self) -> None:
        pass


class NeverEvent:
    def wait(self, timeout: float) -> bool:
        threading.Event().wait(min(timeout, 0.01))
        return False


def _sender(clients: FakeClients, layers: int = 2, **deadlines: float) -> PrefillSender:
    srcs = {n: SourceLayout(f"model.layers.{n}.attn", (TensorComponent(4096 * (n + 1), 64, 1),))
            for n in range(layers)}
    container = bootstrap(Rd2hSettings(role="prefill"), control_clients=lambda: clients,
                          codec=CODEC, logger=RecordingLogger())
    sender = container.prefill_sender(p_session="s", layers=srcs, **deadlines)
    sender.start()
    return sender


REQ = ReadRequest("r", (0,), (0,), 0, 0)


def _target(endpoint: str) -> list[LayerTarget]:
    return [LayerTarget(endpoint, REQ, False, 0, 1)]


def _clean(sender: PrefillSender) -> bool:
    return sender.drain(WAIT) and all(v == 0 for v in sender.counters().values())


def test_lost_endpoint_fails_its_pending_layers_at_once() -> None:
    """The loss is reported at once; what went out keeps its storage until its hold (the
    reply deadline its frame stated): a Decode that was only slow may still read it."""
    clients = FakeClients()
    sender = _sender(clients, layer_ack_timeout_s=3.0)
    try:
        sender.submit(0, None, _target("A"))
        sender.submit(1, None, _target("B"))
        sent = {clients.ready.get(timeout=WAIT)[0] for _ in range(2)}
        t_sent = time.monotonic()
        assert sent == {"A", "B"}
        clients.lose("A")
        wait_until(lambda: sender.stats.layers_failed == 1, "the loss reported", 2.0)
        assert not sender.gate_open(0)  # held: A may still read layer 0
        assert not sender.gate_open(1)  # B is still reading layer 1
        clients.reply("B", ReadDone(1))
        sender.wait_for_layer_send(1, timeout=WAIT)
        with pytest.raises(LayerSendError) as info:
            sender.wait_for_layer_send(0, timeout=WAIT)
        assert time.monotonic() - t_sent > 2.5  # its 3 s hold, not at once
        assert "layer 0" in str(info.value) and "A disconnected" in str(info.value)
        assert _clean(sender), sender.counters()
        assert clients.disconnects == []  # the transport reconnects by itself
        sender.submit(0, None, _target("A"))  # a new announcement handshakes again
        assert clients.ready.get(timeout=WAIT)[0] == "A"
        assert clients.metas.count("A") == 2
    finally:
        assert sender.stop(WAIT)


def test_an_endpoint_reported_gone_fails_new_sends_at_once_until_it_is_back() -> None:
    """Decode died: the monitor reported the loss and nothing reconnected. A new
    announcement to it fails at once, not after ``meta_ack_s`` (no handshake is tried);
    once the transport connects again, the next one handshakes as usual."""
    clients = FakeClients()
    sender = _sender(clients, meta_ack_timeout_s=30.0, layer_ack_timeout_s=30.0)
    try:
        sender.submit(0, None, _target("A"))
        assert clients.ready.get(timeout=WAIT)[0] == "A"
        clients.reply("A", ReadDone(0))
        sender.wait_for_layer_send(0, timeout=WAIT)
        clients.lose("A", reconnects=False)
        wait_until(lambda: sender.counters()["unacked_sends"] == 0 and not clients._lost,
                   "the loss to be seen")
        time.sleep(0.05)  # the sender loop handled the loss
        t0 = time.monotonic()
        sender.submit(1, None, _target("A"))
        with pytest.raises(LayerSendError, match="has not reconnected"):
            sender.wait_for_layer_send(1, timeout=WAIT)
        assert time.monotonic() - t0 < 2.0  # not the 30 s handshake deadline
        assert clients.metas.count("A") == 1  # no handshake was tried
        clients.come_back("A")
        wait_until(lambda: not clients._back, "the reconnection to be seen")
        time.sleep(0.05)
        sender.submit(1, None, _target("A"))
        assert clients.ready.get(timeout=WAIT)[0] == "A"
        assert clients.metas.count("A") == 2
        clients.reply("A", ReadDone(1))
        sender.wait_for_layer_send(1, timeout=WAIT)
        assert _clean(sender), sender.counters()
    finally:
        assert sender.stop(WAIT)


def test_acknowledgement_deadline_fails_the_endpoints_layers_and_resets_it() -> None:
    clients = FakeClients()
    sender = _sender(clients, layer_ack_timeout_s=0.3)
    try:
        sender.submit(0, None, _target("A"))
        sender.submit(1, None, _target("A"))
        t0 = time.monotonic()
        for layer in (0, 1):
            with pytest.raises(LayerSendError) as info:
                sender.wait_for_layer_send(layer, timeout=WAIT)
            assert "no acknowledgement of layer 0 from decode endpoint A within 0.3 s" in str(
                info.value
            )
        assert time.monotonic() - t0 < 2.0
        assert clients.disconnects == ["A"]  # Decode learns it through the lost peer
        assert _clean(sender), sender.counters()
    finally:
        assert sender.stop(WAIT)


def test_a_failed_layer_is_reported_only_once_its_storage_is_free() -> None:
    clients = FakeClients()
    sender = _sender(clients)
    try:
        sender.submit(0, None, _target("A"))  # two chunks of layer 0 to the same endpoint
        sender.submit(0, None, _target("A"))
        clients.ready.get(timeout=WAIT)
        clients.ready.get(timeout=WAIT)
        clients.reply("A", ReadFailed(0, "boom"))
        with pytest.raises(LayerSendError, match=r"within 0\.3 s; it already failed: .*boom"):
            sender.wait_for_layer_send(0, timeout=0.3)
        assert not sender.gate_open(0)  # the second announcement may still be read
        clients.reply("A", ReadDone(0))
        with pytest.raises(LayerSendError, match="decode endpoint A: boom"):
            sender.wait_for_layer_send(0, timeout=WAIT)
        assert sender.gate_open(0)
        assert _clean(sender)
    finally:
        assert sender.stop(WAIT)


def test_an_announcement_whose_layer_already_failed_is_never_sent() -> None:
    clients = FakeClients()
    sender = _sender(clients, event_timeout_s=0.3)
    try:
        sender.submit(0, NeverEvent(), _target("A"))  # blocks the sender for 0.3 s
        sender.submit(1, None, _target("A"))  # queued behind it
        clients.lose("A")  # layer 1 fails while still queued
        for layer in (0, 1):
            with pytest.raises(LayerSendError):
                sender.wait_for_layer_send(layer, timeout=WAIT)
        assert _clean(sender), sender.counters()
        with pytest.raises(queue.Empty):
            clients.ready.get(timeout=0.2)
    finally:
        assert sender.stop(WAIT)


# ====================================================================== Decode receiver


class FakeServer:
    endpoint = "mem://d0"

    def __init__(self) -> None:
        self.inbound: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue()
        self.sent: list[tuple[bytes, object]] = []
        self._lost: list[bytes] = []
        self._lock = threading.Lock()

    def recv(self, timeout: float) -> tuple[bytes, bytes] | None:
        try:
            return self.inbound.get(timeout=timeout)
        except queue.Empty:
            return None

    def recv_many(self, timeout: float, limit: int) -> list[tuple[bytes, bytes]]:
        item = self.recv(timeout)
        return [] if item is None else [item]

    def send(self, identity: bytes, payload: bytes) -> bool:
        self.sent.append((identity, "ACK" if payload == ACK else CODEC.decode(payload)))
        return True

    def disconnected(self) -> list[bytes]:
        with self._lock:
            lost, self._lost = self._lost, []
        return lost

    def lose(self, identity: bytes) -> None:
        with self._lock:
            self._lost.append(identity)
        self.wake()  # like the ZMQ server, ``recv`` returns to report the loss at once

    def wake(self) -> None:
        self.inbound.put(None)  # ``recv`` returns it: None, as after its timeout

    def shed(self) -> list[tuple[bytes, int, int]]:
        return []

    def close(self) -> None:
        pass


def test_decode_fails_the_requests_of_a_vanished_prefill_peer() -> None:
    nb, bpb = 8, 64
    p_engine, d_engine = InprocTransferEngine(), InprocTransferEngine()
    src_arr = np.arange(nb * bpb, dtype=np.uint8).reshape(nb, bpb)
    dst_arr = np.zeros((nb, bpb), dtype=np.uint8)
    p_engine.register_memory(src_arr.ctypes.data, src_arr.nbytes)
    d_engine.register_memory(dst_arr.ctypes.data, dst_arr.nbytes)
    name = "model.layers.0.attn"
    src = SourceLayout(name, (TensorComponent(src_arr.ctypes.data, bpb, 1),))
    dst = DestinationLayout(name, (DestTensor(dst_arr.ctypes.data, bpb, nb),))
    server = FakeServer()
    container = bootstrap(Rd2hSettings(role="decode"), control_server=lambda: server,
                          codec=CODEC, transport=d_engine, logger=RecordingLogger())
    receiver = container.decode_receiver(destinations={name: dst})
    receiver.start()
    try:
        receiver.admit("a" + X9, [1], [])
        receiver.admit("b" + X9, [2], [])
        receiver.admit("c" + X9, [3], [])  # never announced: ends at its deadline
        peer = b"peer-1"
        server.inbound.put((peer, CODEC.encode(MfMeta(p_engine.session_id,
                                                      {name: src.to_metadata()}))))
        batch = ReadReadyBatch(0, name, (ReadRequest("a", (5,), (), 0, 0),
                                         ReadRequest("b", (6,), (), 0, 0)), ("a",))
        server.inbound.put((peer, CODEC.encode(batch)))
        wait_until(lambda: any(isinstance(m, ReadDone) for _, m in server.sent))
        assert np.array_equal(dst_arr[[1, 2]], src_arr[[5, 6]])
        server.lose(peer)
        wait_until(lambda: receiver.counters()["peers"] == 0)
        out = receiver.step(InMemoryExchangeGroup(1).member(0), (), timeout=WAIT)
        assert out.finished == {"a" + X9, "b" + X9}
        assert out.failed == {"b" + X9}
        assert "disconnected before announcing the final layer" in out.reasons["b" + X9]
        assert out.invalid_block_ids == {2}
        counters = receiver.counters()
        assert counters["admitted"] == 1 and counters["peer_contributions"] == 0
    finally:
        assert receiver.stop(WAIT)
        p_engine.close()
        d_engine.close()


def test_stopping_the_sender_fails_pending_layers_naming_their_endpoints() -> None:
    clients = FakeClients()
    sender = _sender(clients)
    sender.submit(0, None, _target("A"))
    clients.ready.get(timeout=WAIT)
    assert sender.stop(WAIT)
    with pytest.raises(LayerSendError, match=r"layer 0: prefill sender stopped \(layer 0 "
                                             r"awaited A\)"):
        sender.wait_for_layer_send(0, timeout=WAIT)
    assert all(v == 0 for v in sender.counters().values()), sender.counters()


def test_heartbeat_deadlines_are_validated_and_wired() -> None:
    import pydantic

    from rd2h.app.settings import Deadlines

    with pytest.raises(pydantic.ValidationError, match="heartbeat_timeout_s 2 must exceed"):
        Deadlines(heartbeat_ivl_s=3, heartbeat_timeout_s=2)
    Deadlines(heartbeat_ivl_s=0, heartbeat_timeout_s=1)  # 0: heartbeats off
    settings = Rd2hSettings(role="prefill", deadlines=Deadlines(heartbeat_ivl_s=0.5,
                                                                heartbeat_timeout_s=2))
    clients = bootstrap(settings).control_clients()
    try:
        assert clients._heartbeat == (0.5, 2.0)
    finally:
        clients.close()


def test_cpu_layers_leave_the_event_helper_asleep_while_the_sender_works() -> None:
    """On CPU a layer's event is None: the sender's loop notifies its condition on every
    pass, and its device-event helper, asleep on a condition of its own, stays asleep."""
    # Thread objects, not idents: an ended thread's ident is reused by a new one.
    before = set(threading.enumerate())
    clients = FakeClients()
    sender = _sender(clients, layer_ack_timeout_s=3.0)
    try:
        helpers = [t for t in threading.enumerate()
                   if t not in before and t.name == "rd2h-prefill-events"]
        assert len(helpers) == 1
        tid = helpers[0].native_id
        time.sleep(0.05)
        start = voluntary_switches(tid)
        for _ in range(20):
            sender.submit(0, None, _target("A"))
            assert clients.ready.get(timeout=WAIT)[0] == "A"
            clients.reply("A", ReadDone(0))
            sender.wait_for_layer_send(0, timeout=WAIT)
        assert voluntary_switches(tid) - start <= 2  # once per loop pass when shared
        assert _clean(sender), sender.counters()
    finally:
        assert sender.stop(WAIT)
