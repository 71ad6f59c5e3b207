"""Prefill preemption against a real Decode, in memory (spec 12: "before a preempted
request's blocks are reused, every announcement covering them is answered or failed;
Decode never completes from reused storage").

A real ``PrefillScheduler`` and ``PrefillWorker`` (with its ``PrefillSender``) and a real
``DecodeReceiver`` / ``DecodeWorker``, built by the shared rig through the container,
share an in-memory control network and the inproc transport. The test plays vLLM's
engine: it schedules steps, calls the hooks in vLLM's order (``requests_preempted`` +
``build_connector_meta`` on the scheduler; ``handle_preemptions``,
``bind_connector_metadata``, the forward, ``save_kv_layer``, ``get_transfer_results`` on
the worker) and writes each request's "KV" into the Prefill cache: a block's bytes depend
only on the request, the block's position and the layer, so a recomputed block is
byte-identical, and another request's block is not.

Decode's reads go through ``GatedTransfer``: a read waits until the test opens the gate,
which is how a read that is still in flight when vLLM preempts looks.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from fakes.clock import ManualClock
from fakes.logs import RecordingLogger
from fakes.rig import Rig

from rd2h.adapters.inproc import InprocTransferEngine
from rd2h.app.connector.plans import DecodeLoad, StepPlan
from rd2h.app.connector.roles import RequestFacts, ScheduledRequest, TransferResults
from rd2h.domain.errors import CompletionError, TransferError
from rd2h.domain.planning.layout import DestinationLayout, DestTensor, SourceLayout, TensorComponent

WAIT = 5.0  # every wait's deadline (they take milliseconds)
BS = 4  # tokens per block
BPB = 32  # bytes per block of the one main tensor of a layer
NB = 16  # blocks on each side
LAYERS = 2
NAMES = {i: f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)}
D_EP_PORT = 31000
SUFFIX = "-0a1b2c3d"


def kv(rid: str, block: int, layer: int) -> np.ndarray:
    """The bytes of one block of a request's KV (a recompute gives the same)."""
    seed = sum(map(ord, rid)) * 31 + block * 7 + layer * 3
    return np.full(BPB, seed % 251 + 1, dtype=np.uint8)


class ImmediateEvents:
    """Device events of CPU tensors: complete when recorded (``stall``: never)."""

    def __init__(self) -> None:
        self.stall = False

    class _Event:
        def __init__(self, done: bool) -> None:
            self._done = done

        def wait(self, timeout: float) -> bool:
            return self._done

    def record(self) -> ImmediateEvents._Event:
        return self._Event(not self.stall)


class GatedTransfer:
    """The inproc transport, except that a read waits for ``open_gate`` (bounded)."""

    def __init__(self, engine: InprocTransferEngine) -> None:
        self._engine = engine
        self._gate = threading.Event()
        self._gate.set()
        self._cond = threading.Condition()
        self.error: str | None = None
        self.waiting = 0  # reads waiting at the gate now
        self.reads = 0  # reads completed

    @property
    def session_id(self) -> str:
        return self._engine.session_id

    def register_memory(self, addr: int, size: int) -> None:
        self._engine.register_memory(addr, size)

    def close_gate(self, error: str | None = None) -> None:
        self.error = error
        self._gate.clear()

    def open_gate(self) -> None:
        self._gate.set()

    def wait_for_waiting_read(self) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self.waiting > 0, WAIT), "no read started"

    def batch_read(self, session, local_addrs, remote_addrs, lengths) -> None:
        with self._cond:
            self.waiting += 1
            self._cond.notify_all()
        try:
            if not self._gate.wait(WAIT):
                raise TransferError("gate never opened")
        finally:
            with self._cond:
                self.waiting -= 1
        if self.error is not None:
            raise TransferError(self.error)
        self._engine.batch_read(session, local_addrs, remote_addrs, lengths)
        with self._cond:
            self.reads += 1
            self._cond.notify_all()

    def close(self) -> None:
        self._engine.close()


class Engines:
    """vLLM's side of one Prefill engine and one Decode engine, driven by the test; their
    connector roles come from the shared rig (each from its container, over the rig's
    in-memory control network and manual clock)."""

    def __init__(self, rig: Rig, *, settle_timeout_s: float | None = None) -> None:
        self.clock = rig.clock
        self.p_log, self.d_log = RecordingLogger(), RecordingLogger()
        self.p_engine, d_engine = rig.engine(), rig.engine()
        self.p_bufs = [np.zeros((NB, BPB), dtype=np.uint8) for _ in NAMES]
        self.d_bufs = [np.zeros((NB, BPB), dtype=np.uint8) for _ in NAMES]
        for buf in self.p_bufs:
            self.p_engine.register_memory(buf.ctypes.data, buf.nbytes)
        for buf in self.d_bufs:
            d_engine.register_memory(buf.ctypes.data, buf.nbytes)
        self.transfer = GatedTransfer(d_engine)
        self.events = ImmediateEvents()
        self.decode = rig.decode_worker(
            {NAMES[i]: DestinationLayout(
                NAMES[i], (DestTensor(self.d_bufs[i].ctypes.data, BPB, NB),)) for i in NAMES},
            self.transfer, log=self.d_log,
            settings={"kv_port": D_EP_PORT,
                      "deadlines": {"request_s": 30, "tp_exchange_s": WAIT}})
        self.worker = rig.prefill_worker(
            {i: SourceLayout(NAMES[i], (TensorComponent(
                self.p_bufs[i].ctypes.data, BPB, 1, 0, NB),)) for i in NAMES},
            self.p_engine.session_id, log=self.p_log,
            overrides={"device_events": self.events}, settle_timeout_s=settle_timeout_s)
        self.sender = self.worker.sender
        self.sched = rig.container("prefill", logger=self.p_log).prefill_scheduler(
            block_size=BS, main_group=0, indexer_group=0)
        rig.on_close(self.transfer.open_gate)  # first: no read may wait at the gate then
        self.tables: dict[str, list[int]] = {}

    # -- vLLM's engines
    def admit(self, rid: str, prompt_len: int, d_blocks: tuple[int, ...]) -> None:
        """Decode allocated ``d_blocks`` and posted; the proxy sent the request to Prefill."""
        self.decode.bind_connector_metadata(StepPlan(loads=(DecodeLoad(rid, d_blocks, d_blocks),)))
        params = {"do_remote_decode": True, "remote_host": "127.0.0.1",
                  "remote_port": D_EP_PORT, "remote_tp_size": 1}
        tracked = self.sched.counters()["tracked"]
        self.sched.update_state_after_alloc(
            RequestFacts(rid, prompt_len, prompt_len, 0, params), ([],), 0)
        assert self.sched.counters()["tracked"] == tracked + 1

    def plan(self, scheduled: list[tuple[str, list[int] | None, int, int, bool]],
             preempted: tuple[str, ...] = ()) -> StepPlan:
        """The scheduler's side of a step: ``(rid, new blocks, computed before,
        scheduled, replace)`` per request (remote or local), then the plan."""
        self._scheduled = scheduled
        for rid, blocks, _, _, replace in scheduled:
            if blocks is not None:
                self.tables[rid] = list(blocks) if replace else self.tables[rid] + blocks
        self.sched.requests_preempted(preempted)
        return self.sched.build_connector_meta([
            ScheduledRequest(rid, None if blocks is None else (tuple(blocks),), c, n, replace)
            for rid, blocks, c, n, replace in scheduled])

    def forward(self, plan: StepPlan, *, settle: bool = True) -> None:
        """The worker's side: vLLM's hooks around the forward, which writes the KV of
        every scheduled token into the request's blocks, layer by layer."""
        if settle:
            self.worker.handle_preemptions(plan)
        self.worker.bind_connector_metadata(plan)
        for layer in NAMES:
            for rid, _, c, n, _ in self._scheduled:
                for j in range(c // BS, -(-(c + n) // BS)):
                    self.p_bufs[layer][self.tables[rid][j]] = kv(rid, j, layer)
            self.worker.save_kv_layer(NAMES[layer])
        self.worker.wait_for_save()  # vLLM's, after every forward

    def step(self, scheduled, preempted: tuple[str, ...] = ()) -> StepPlan:
        plan = self.plan(scheduled, preempted)
        self.forward(plan)
        return plan

    def decode_results(self) -> TransferResults:
        deadline = time.monotonic() + WAIT
        while True:
            res = self.decode.get_transfer_results(set())
            if res.finished_recving or time.monotonic() > deadline:
                return res
            time.sleep(0.01)

    def decode_has(self, rid: str, d_blocks: tuple[int, ...]) -> bool:
        return all(np.array_equal(self.d_bufs[layer][d], kv(rid, j, layer))
                   for layer in NAMES for j, d in enumerate(d_blocks))


@pytest.fixture
def rig():
    made: list[Rig] = []

    def make(**kw) -> Engines:
        made.append(Rig(control="memory", clock=ManualClock()))
        return Engines(made[-1], **kw)

    yield make
    for r in made:
        r.close()


A, B = "a" + SUFFIX, "local-b" + SUFFIX  # A goes to Decode; B is a local request
A_DEST = (0, 1, 2, 3, 4)  # Decode's blocks for A's 5 blocks (18 tokens, partial last)


def _open_later(rig: Engines, delay: float) -> threading.Thread:
    t = threading.Timer(delay, rig.transfer.open_gate)
    t.start()
    return t


@pytest.mark.parametrize("settle", [True, False])
def test_preempted_while_decode_reads_then_resumed(rig, settle) -> None:
    """A is preempted while Decode is still reading its first chunk, and B gets A's
    freed blocks in the same step. With ``settle`` (what vLLM's ``handle_preemptions``
    does) the step waits for Decode, A resumes with new blocks, is announced from where
    it stopped, and Decode ends with exactly A's KV. Without it Decode copies B's KV:
    the rig can tell the difference."""
    r = rig()
    r.admit(A, 18, A_DEST)
    r.transfer.close_gate()
    r.step([(A, [1, 2, 3, 4, 5], 0, 8, True)])  # A's first 2 blocks: 1, 2
    r.transfer.wait_for_waiting_read()  # Decode is reading layer 0 of them now

    plan = r.plan([(B, [1, 2], 0, 8, True)], preempted=(A,))  # B reuses A's 1 and 2
    assert plan.preempted == (A,) and plan.sends == ()
    if settle:
        opener = _open_later(r, 0.2)
        t0 = time.monotonic()
        r.forward(plan)  # handle_preemptions returns once Decode answered both layers
        assert time.monotonic() - t0 >= 0.15
        # Decode finished reading before B's KV landed (both layers: one layer run).
        assert r.transfer.reads >= 1 and not r.transfer.waiting
        assert r.sender.stats.layers_sent == LAYERS
        opener.join()
    else:
        r.forward(plan, settle=False)  # B's KV lands in blocks Decode is reading
        r.transfer.open_gate()

    # A resumes, recomputed from scratch into new blocks 6..10, in two chunks.
    first = r.step([(A, [6, 7, 8, 9, 10], 0, 8, True)])
    assert first.sends == ()  # Decode already read blocks 0 and 1
    (last,) = r.step([(A, None, 8, 10, False)]).sends
    assert (last.main_block_ids, last.main_start, last.final) == ((8, 9, 10), 2, True)

    res = r.decode_results()
    assert res.finished_recving == {A} and res.failed_recving == frozenset()
    assert r.decode_has(A, A_DEST) is settle
    assert r.sched.request_finished(A) is True
    assert r.sender.drain(WAIT)
    assert r.worker.get_transfer_results({A}).finished_sending == {A}
    if settle:
        (_, kw), = [e for e in r.p_log.at("info")
                    if e[0] == "preempted requests settled before their blocks are reused"]
        assert kw["requests"] == [A] and kw["open_announcements"] == LAYERS
        assert kw["failed"] == {}
        assert r.worker.requests_settled == 1


def test_a_failed_read_of_a_preempted_request_fails_it_and_nothing_more_is_announced(
        rig) -> None:
    r = rig()
    r.admit(A, 18, A_DEST)
    r.transfer.close_gate(error="source region unreachable")
    r.step([(A, [1, 2, 3, 4, 5], 0, 8, True)])
    r.transfer.wait_for_waiting_read()
    opener = _open_later(r, 0.1)
    r.step([(B, [1, 2], 0, 8, True)], preempted=(A,))  # settles: the reads failed
    opener.join()
    r.transfer.error = None  # both layers were answered (failed) before the step went on

    res = r.decode_results()
    assert res.failed_recving == {A} and res.finished_recving == {A}
    assert r.decode.get_block_ids_with_load_errors() == set(A_DEST)  # recomputed or failed
    failed_log = [kw for e, kw in r.d_log.at("warning") if e == "request failed to receive its KV"]
    assert "source region unreachable" in failed_log[0]["reason"]

    # A resumes: the scheduler plans its remaining blocks, the worker withholds them.
    r.step([(A, [6, 7, 8, 9, 10], 0, 8, True)])
    plan = r.plan([(A, None, 8, 10, False)])
    assert len(plan.sends) == 1
    announced = r.worker.layers_announced
    r.forward(plan)
    assert r.worker.layers_announced == announced
    withheld = [kw for e, kw in r.p_log.at("warning")
                if e == "not announcing more of a request with a failed announcement"]
    assert len(withheld) == 1 and withheld[0]["request"] == A
    assert r.sched.request_finished(A) is True
    assert r.sender.drain(WAIT)
    assert r.worker.get_transfer_results({A}).finished_sending == {A}
    assert r.worker.counters()["requests"] == 0


def test_an_announcement_decode_never_saw_makes_decode_fail_not_complete(rig) -> None:
    """Prefill fails an announcement on its own (here its device event never completes):
    Decode never read that chunk. After the preemption the request must not be completed
    on Decode from the later chunks: it fails there at its request deadline."""
    r = rig()
    r.admit(A, 18, A_DEST)
    r.events.stall = True
    r.step([(A, [1, 2, 3, 4, 5], 0, 8, True)])
    r.events.stall = False
    r.clock.advance(WAIT + 1)  # past the device-event deadline: those entries fail
    r.step([(B, [1, 2], 0, 8, True)], preempted=(A,))
    (_, kw), = [e for e in r.p_log.at("info")
                if e[0] == "preempted requests settled before their blocks are reused"]
    assert "device event not complete" in kw["failed"][A]

    r.step([(A, [6, 7, 8, 9, 10], 0, 8, True)])
    r.step([(A, None, 8, 10, False)])  # withheld: Decode does not get the rest
    assert r.sender.drain(WAIT)
    assert r.decode.get_transfer_results(set()).finished_recving == frozenset()  # not completed
    r.clock.advance(31)  # Decode's request deadline
    res = r.decode_results()
    assert res.finished_recving == {A} and res.failed_recving == {A}
    assert r.transfer.reads == 0


def test_settle_has_a_deadline_and_names_the_request(rig) -> None:
    r = rig(settle_timeout_s=0.3)
    r.admit(A, 18, A_DEST)
    r.transfer.close_gate()
    r.step([(A, [1, 2, 3, 4, 5], 0, 8, True)])
    r.transfer.wait_for_waiting_read()
    plan = r.plan([(B, [1, 2], 0, 8, True)], preempted=(A,))
    with pytest.raises(CompletionError, match=rf"preempted request\(s\) \['{A}'\].*0.3 s"):
        r.worker.handle_preemptions(plan)
    r.transfer.open_gate()


def test_settle_waits_only_for_the_preempted_requests(rig) -> None:
    r = rig()
    c = "c" + SUFFIX
    r.admit(A, 18, A_DEST)
    r.admit(c, 8, (8, 9))
    r.step([(A, [1, 2, 3, 4, 5], 0, 8, True)])
    assert r.sender.drain(WAIT)  # Decode answered A's announcements
    r.transfer.close_gate()
    r.step([(c, [11, 12], 0, 8, True)])  # c's read is still in flight below
    r.transfer.wait_for_waiting_read()
    t0 = time.monotonic()
    r.worker.handle_preemptions(r.plan([(B, [1, 2], 0, 8, True)], preempted=(A,)))
    assert time.monotonic() - t0 < 1.0
    assert r.transfer.waiting == 1  # c is still being read
    r.transfer.open_gate()
    assert r.sender.drain(WAIT)


def test_a_stopped_sender_settles_at_once(rig) -> None:
    r = rig()
    r.admit(A, 18, A_DEST)
    r.transfer.close_gate()
    r.step([(A, [1, 2, 3, 4, 5], 0, 8, True)])
    r.transfer.wait_for_waiting_read()
    assert r.sender.stop(2)  # every announcement fails (Decode sees the peer go)
    r.worker.handle_preemptions(r.plan([], preempted=(A,)))
    r.transfer.open_gate()
    res = r.decode_results()
    assert res.failed_recving == {A}


def test_the_default_settle_deadline_outlasts_every_sender_deadline(rig) -> None:
    r = rig()
    # device event, then a handshake, then a send waiting in the outbox up to its reply
    # deadline and a full reply deadline once sent; plus the sender loop's slack.
    assert r.sender.timeouts.longest_entry_s == WAIT + WAIT + 2 * WAIT
    assert r.worker.settle_timeout_s == r.sender.timeouts.longest_entry_s + 5.0
