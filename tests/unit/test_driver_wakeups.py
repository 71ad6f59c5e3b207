"""The drivers sleep until their session's next deadline or the next input, never on a
poll interval: with a manual clock, every wait the loop makes is recorded, and time
passes only when the test lets a wait run out (the fake advances the clock to its end)
or moves the clock itself. Each wait must end on input or at a deadline the loop then acts on."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from fakes.clock import ManualClock
from fakes.logs import RecordingLogger

from rd2h.adapters.inproc import InprocTransferEngine
from rd2h.adapters.msgpack import MsgpackCodec
from rd2h.adapters.torch.exchange import InMemoryExchangeGroup
from rd2h.app.prefill import LayerTarget
from rd2h.app.settings import Deadlines, Rd2hSettings
from rd2h.bootstrap.container import bootstrap
from rd2h.domain.errors import LayerSendError
from rd2h.domain.planning.layout import DestinationLayout, DestTensor, SourceLayout, TensorComponent
from rd2h.domain.wire.protocol import ACK, MfMeta, ReadReadyBatch, ReadRequest

CODEC = MsgpackCodec()
WAIT = 5.0  # real seconds any step of these tests may take (they take milliseconds)
NAME = "model.layers.0.attn"
X9 = "-abcdefgh"  # vLLM's engine suffix
IDLE = 3600.0  # the drivers' one bound on a wait with nothing due (``_IDLE_WAIT_S``)


class Stepper:
    """The blocking half of a fake transport. A wait with a timeout is recorded and
    ends on input (``push``) or when the test lets it run out (``elapse``: the manual
    clock advances to the end of that wait); a wait of 0 only looks."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.waits: list[float] = []  # every blocking wait's timeout, in order
        self.ended: list[str] = []  # how each ended: "input" or "time"
        self._inbox: list[Any] = []
        self._elapse = False
        self._blocked = False
        self._seen = 0
        self._cond = threading.Condition()

    def push(self, item: Any) -> None:
        with self._cond:
            self._inbox.append(item)
            self._cond.notify_all()

    def take(self, timeout: float) -> list[Any]:
        with self._cond:
            if timeout > 0 and not self._inbox:
                until = self.clock.now() + timeout
                self.waits.append(timeout)
                self._blocked = True
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._inbox or self._elapse, 4 * WAIT)
                self._blocked = False
                self._cond.notify_all()
                if not self._inbox:
                    self._elapse = False
                    self.clock.advance(max(0.0, until - self.clock.now()))
                    self.ended.append("time")
                    return []
                self.ended.append("input")
            out, self._inbox = self._inbox, []
            return out

    def next_wait(self) -> float:
        """Block until the driver sleeps again; how long it means to."""
        with self._cond:
            assert self._cond.wait_for(
                lambda: self._blocked and len(self.waits) > self._seen, WAIT), self.waits
            self._seen = len(self.waits)
            return self.waits[-1]

    def elapse(self) -> float:
        """Let the driver's current wait run out; returns its next wait."""
        with self._cond:
            assert self._blocked
            self._elapse = True
            self._cond.notify_all()
        return self.next_wait()


class SteppedClients:
    """``ControlClients`` over a ``Stepper``: Decode answers only when the test says."""

    def __init__(self, clock: ManualClock) -> None:
        self.stepper = Stepper(clock)
        self.sent: list[tuple[str, object]] = []
        self.disconnects: list[str] = []

    def connect(self, endpoint: str) -> None:
        pass

    def disconnect(self, endpoint: str) -> None:
        self.disconnects.append(endpoint)

    def send(self, endpoint: str, payload: bytes, timeout: float = 5.0) -> None:
        self.sent.append((endpoint, CODEC.decode(payload)))

    def poll(self, timeout: float) -> list[tuple[str, bytes]]:
        return [(ep, p) for ep, p in self.stepper.take(timeout) if p]

    def disconnected(self) -> list[str]:
        return []

    def reconnected(self) -> list[str]:
        return []

    def wake(self) -> None:
        self.stepper.push(("", b""))

    def close(self) -> None:
        pass


class SteppedServer:
    """``ControlServer`` over a ``Stepper`` (no Prefill talks to it here)."""

    endpoint = "mem://d0"

    def __init__(self, clock: ManualClock) -> None:
        self.stepper = Stepper(clock)

    def recv(self, timeout: float) -> tuple[bytes, bytes] | None:
        return next((i for i in self.stepper.take(timeout) if i is not None), None)

    def recv_many(self, timeout: float, limit: int) -> list[tuple[bytes, bytes]]:
        item = self.recv(timeout)
        return [] if item is None else [item]

    def send(self, identity: bytes, payload: bytes) -> bool:
        return True

    def disconnected(self) -> list[bytes]:
        return []

    def wake(self) -> None:
        self.stepper.push(None)

    def shed(self) -> list[tuple[bytes, int, int]]:
        return []

    def close(self) -> None:
        pass


def test_the_sender_wakes_only_for_input_and_at_its_deadlines() -> None:
    clock = ManualClock()
    clients = SteppedClients(clock)
    deadlines = Deadlines(meta_ack_s=10, layer_ack_s=30, device_event_s=20, idle_link_s=300)
    container = bootstrap(Rd2hSettings(role="prefill", deadlines=deadlines), clock=clock,
                          control_clients=lambda: clients, codec=CODEC,
                          logger=RecordingLogger())
    sender = container.prefill_sender(
        p_session="p", layers={0: SourceLayout(NAME, (TensorComponent(0x100000, 64),))})
    steps = clients.stepper
    sender.start()
    try:
        assert steps.next_wait() == IDLE  # nothing in flight: no deadline to wake for
        target = LayerTarget("A", ReadRequest("r", (0,), (), 0, 0), True, 0, 1)
        assert sender.submit(0, None, [target]) == 1  # input: wakes it at once
        assert steps.next_wait() == pytest.approx(10, abs=0.5)  # the MF_META ACK's deadline
        assert [type(m) for _, m in clients.sent] == [MfMeta]
        steps.push(("A", ACK))  # input: the batch goes, its reply deadline runs
        assert steps.next_wait() == pytest.approx(30, abs=0.5)
        assert [type(m) for _, m in clients.sent] == [MfMeta, ReadReadyBatch]
        # No reply: the loop sleeps through to the reply deadline, wakes once, fails it.
        assert steps.elapse() == pytest.approx(300 - 30, abs=0.5)  # now the idle close
        with pytest.raises(LayerSendError, match="no acknowledgement of layer 0"):
            sender.wait_for_layer_send(0, timeout=0)
        assert clients.disconnects == ["A"]  # the silent connection is reset
        assert steps.elapse() == IDLE  # idle link closed: nothing due any more
        assert clients.disconnects == ["A", "A"]
        assert steps.waits == [IDLE, pytest.approx(10, abs=0.5), pytest.approx(30, abs=0.5),
                               pytest.approx(270, abs=0.5), IDLE]
        assert steps.ended == ["input", "input", "time", "time"]  # no other wake-up
    finally:
        assert sender.stop(WAIT)
    assert steps.ended[-1] == "input"  # stop wakes the last wait


def test_the_receiver_expires_requests_at_their_deadline_without_a_worker_step() -> None:
    clock = ManualClock()
    server = SteppedServer(clock)
    transfer = InprocTransferEngine()
    container = bootstrap(Rd2hSettings(role="decode", deadlines=Deadlines(request_s=10)),
                          clock=clock, control_server=lambda: server, codec=CODEC,
                          transport=transfer, logger=RecordingLogger())
    receiver = container.decode_receiver(
        destinations={NAME: DestinationLayout(NAME, (DestTensor(0x900000, 64, 8),))})
    assert not receiver.main_shared  # each rank its own main cache (vLLM's)
    steps = server.stepper
    receiver.start()
    try:
        assert steps.next_wait() == IDLE  # nothing admitted: no deadline
        receiver.admit("a" + X9, [1], [])  # due sooner than the wait ends: wakes it
        assert steps.next_wait() == pytest.approx(10, abs=0.5)
        clock.advance(4)  # the loop sleeps on
        receiver.admit("b" + X9, [2], [])  # due after a: no wake-up
        assert steps.elapse() == pytest.approx(4, abs=0.5)  # a expired; b is due next
        assert receiver.counters()["failed"] == 1 and receiver.wait_for_progress(0)
        assert steps.elapse() == IDLE  # b expired too: nothing left to wait for
        assert receiver.counters()["failed"] == 2
        assert steps.waits == [IDLE, pytest.approx(10, abs=0.5), pytest.approx(4, abs=0.5),
                               IDLE]
        assert steps.ended == ["input", "time", "time"]  # the admission, then deadlines
        out = receiver.step(InMemoryExchangeGroup(1).member(0), timeout=WAIT)
        assert out.failed == out.finished == {"a" + X9, "b" + X9}
        assert "no KV arrived within 10 s" in out.reasons["a" + X9]
    finally:
        assert receiver.stop(WAIT)
        transfer.close()
    assert steps.ended[-1] == "input"  # stop wakes the last wait


class GatedEvent:
    """A device event that completes when the test says; records each wait's timeout."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.timeouts: list[float] = []

    def wait(self, timeout: float) -> bool:
        self.timeouts.append(timeout)
        return self.done.wait(min(timeout, 4 * WAIT))


def test_the_sender_wakes_when_a_device_event_completes_not_to_look_at_it() -> None:
    """A pending device event is waited on off the loop (up to the session's deadline for
    it), and its completion wakes the loop: no wait of the loop is cut short to poll it."""
    clock = ManualClock()
    clients = SteppedClients(clock)
    deadlines = Deadlines(meta_ack_s=10, layer_ack_s=30, device_event_s=20, idle_link_s=300)
    container = bootstrap(Rd2hSettings(role="prefill", deadlines=deadlines), clock=clock,
                          control_clients=lambda: clients, codec=CODEC,
                          logger=RecordingLogger())
    sender = container.prefill_sender(
        p_session="p", layers={0: SourceLayout(NAME, (TensorComponent(0x100000, 64),))})
    steps = clients.stepper
    event = GatedEvent()
    sender.start()
    try:
        assert steps.next_wait() == IDLE
        target = LayerTarget("A", ReadRequest("r", (0,), (), 0, 0), True, 0, 1)
        assert sender.submit(0, event, [target]) == 1  # input: wakes it at once
        assert steps.next_wait() == pytest.approx(20, abs=0.5)  # the event's deadline
        assert clients.sent == []  # not announced before its KV is on the device
        event.done.set()  # the helper wakes the loop: the layer goes out at once
        assert steps.next_wait() == pytest.approx(10, abs=0.5)  # the MF_META ACK's deadline
        assert [type(m) for _, m in clients.sent] == [MfMeta]
        assert event.timeouts == [pytest.approx(20, abs=0.5)]  # one wait, to its deadline
        assert steps.ended == ["input", "input"]  # no other wake-up
    finally:
        assert sender.stop(WAIT)
