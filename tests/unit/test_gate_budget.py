"""One gate budget (issue 23, item 1): how long a layer's storage may stay in use is
derived once from the deadlines (``PrefillTimeouts.gate_budget_s``) and used by the
buffer-reuse wait, the preemption settle and the demo. A slow but healthy Decode that
answers inside the session's own deadlines never makes the reuse wait raise."""

from __future__ import annotations

import queue
import threading
import time

from fakes.clock import ManualClock
from fakes.logs import RecordingLogger

from rd2h.adapters.msgpack import MsgpackCodec
from rd2h.app.connector.plans import DecodeEndpoint, PrefillSend, StepPlan
from rd2h.app.settings import Deadlines, Rd2hSettings
from rd2h.bootstrap.container import bootstrap
from rd2h.domain.planning.layout import SourceLayout, TensorComponent
from rd2h.domain.prefill.prefill_state import GATE_SLACK_S, PrefillTimeouts
from rd2h.domain.wire.protocol import ACK, MfMeta, ReadDone, ReadReadyBatch

NAME = "model.layers.0.self_attn.attn"
CODEC = MsgpackCodec()


def test_the_budget_covers_every_phase_an_entry_can_go_through() -> None:
    t = PrefillTimeouts(meta_ack_s=10, layer_ack_s=30, device_event_s=30)
    assert t.longest_entry_s == 30 + 10 + 2 * 30
    assert t.gate_budget_s == t.longest_entry_s + GATE_SLACK_S
    # The formulas it replaces were all shorter than what the session may legitimately
    # wait: layer + MF_META ack (the worker's reuse wait), event + ack + layer + 1 (demo).
    assert t.gate_budget_s > t.layer_ack_s + t.meta_ack_s
    assert t.gate_budget_s > t.device_event_s + t.meta_ack_s + t.layer_ack_s + 1


class SlowEvent:
    def __init__(self, seconds: float) -> None:
        self._until = time.monotonic() + seconds

    def wait(self, timeout: float) -> bool:
        left = self._until - time.monotonic()
        if left > timeout:
            time.sleep(timeout)
            return False
        time.sleep(max(0.0, left))
        return True


class SlowEvents:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def record(self) -> SlowEvent:
        return SlowEvent(self.seconds)


class SlowDecode:
    """A healthy Decode that is slow: ACKs after ``ack_s``, answers READ_DONE ``reply_s``
    after each announcement."""

    def __init__(self, ack_s: float, reply_s: float) -> None:
        self.ack_s, self.reply_s = ack_s, reply_s
        self._replies: queue.Queue[tuple[str, bytes]] = queue.Queue()

    def _later(self, delay: float, endpoint: str, payload: bytes) -> None:
        threading.Timer(delay, self._replies.put, ((endpoint, payload),)).start()

    def connect(self, endpoint: str) -> None:
        pass

    def disconnect(self, endpoint: str) -> None:
        pass

    def send(self, endpoint: str, payload: bytes, timeout: float = 5.0) -> None:
        msg = CODEC.decode(payload)
        if isinstance(msg, MfMeta):
            self._later(self.ack_s, endpoint, ACK)
        else:
            assert isinstance(msg, ReadReadyBatch)
            self._later(self.reply_s, endpoint, CODEC.encode(ReadDone(msg.layer_idx, msg.seq)))

    def poll(self, timeout: float) -> list[tuple[str, bytes]]:
        try:
            out = [self._replies.get(timeout=timeout)]
        except queue.Empty:
            return []
        while not self._replies.empty():
            out.append(self._replies.get_nowait())
        return [(ep, p) for ep, p in out if p]

    def disconnected(self) -> list[str]:
        return []

    def reconnected(self) -> list[str]:
        return []

    def wake(self) -> None:
        self._replies.put(("", b""))

    def close(self) -> None:
        pass


def test_a_slow_but_healthy_decode_answering_inside_the_deadlines_never_raises() -> None:
    # Each phase ends just inside its own deadline: device event 0.25 s of 0.3, the ACK
    # 0.2 s of 0.3, the reply 0.35 s of 0.4. Together about 0.8 s: more than the reuse
    # wait used to allow (layer + MF_META ack = 0.7 s), well inside the session's bound.
    deadlines = Deadlines(device_event_s=0.3, meta_ack_s=0.3, layer_ack_s=0.4, stop_s=2)
    container = bootstrap(
        Rd2hSettings(role="prefill", buffer_reuse=True, deadlines=deadlines),
        clock=ManualClock(), logger=RecordingLogger(), codec=CODEC,
        control_clients=lambda: SlowDecode(ack_s=0.2, reply_s=0.35),
        device_events=SlowEvents(0.25))
    sender = container.prefill_sender(
        p_session="p", layers={0: SourceLayout(NAME, (TensorComponent(0x100000, 64),))})
    worker = container.prefill_worker(sender=sender, layer_names={0: NAME})
    assert worker.reuse_timeout_s == sender.timeouts.gate_budget_s == worker.settle_timeout_s
    old_formula = 0.4 + 0.3
    worker.start()
    try:
        worker.bind_connector_metadata(StepPlan(sends=(PrefillSend(
            "a-0123abcd", "a", DecodeEndpoint("10.0.0.9", 31000, 1), (1,), (1,), 0, 0,
            True),)))
        t0 = time.monotonic()
        worker.save_kv_layer(NAME)
        assert worker.layers_announced == 1
        worker.wait_for_layer_load(NAME)  # the next step's reuse wait: must not raise
        waited = time.monotonic() - t0
        assert waited > old_formula, waited  # the old bound would have raised here
        assert worker.get_transfer_results({"a-0123abcd"}).finished_sending == {"a-0123abcd"}
        assert worker.requests_failed == 0
    finally:
        worker.shutdown()
