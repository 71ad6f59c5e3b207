"""Prefill sender: the thread that drives a ``PrefillSession`` against the ports.

The compute path calls ``submit`` after a layer's KV scatter (its gates close
right there, in the caller's thread) and ``wait_for_layer_send`` before a
layer's storage is written again. The sender thread owns the sockets: it feeds
the session the replies, lost connections, finished device events and the time,
and performs what the session asks (connect, send MF_META or a
READ_READY_BATCH, disconnect). Every rule and deadline lives in the session
(``rd2h.domain.prefill.prefill_session``). Sends never block the loop: a frame that
cannot go yet waits in an outbox until it goes or its deadline ends the entry.
The loop has no poll interval: it sleeps until the session's next deadline or the next
input (a reply, a lost connection, a connection that can take a frame of the outbox
again; ``submit`` and ``prepare`` wake it, and so does a layer's device event when it
completes, waited on by a helper: ``rd2h.app.prefill_device``): see ``_wait_s``.
If the thread ends for any reason, every pending layer fails and its gates
open, so the compute path raises instead of deadlocking.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from rd2h.app.loop import LoopThread
from rd2h.app.prefill_device import DeviceEventWaiter
from rd2h.app.prefill_requests import SessionRequestsView
from rd2h.app.telemetry import SenderStats, report_prefill
from rd2h.domain.errors import LayerSendError, ProtocolError
from rd2h.domain.planning.layout import SourceLayout
from rd2h.domain.prefill.announce import LayerTarget, group_batches
from rd2h.domain.prefill.prefill_events import Connect, Disconnect, Output, SendBatch, SendMeta
from rd2h.domain.prefill.prefill_session import Named, PrefillSession, PrefillTimeouts
from rd2h.domain.wire.compat import Compat, MetaRefused, compat_of
from rd2h.domain.wire.protocol import (
    FEATURE_LAYER_RUNS,
    MAX_RUN_LAYERS,
    MetaAck,
    MfMeta,
    ReadDone,
    ReadFailed,
    ReadReadyBatch,
    RunLayer,
    answered,
)
from rd2h.ports.codec import WireCodec
from rd2h.ports.control import ControlClients
from rd2h.ports.runtime import Clock, DeviceEvent, Logger

__all__ = ["LayerTarget", "PrefillSender", "SenderStats", "group_batches"]

_IDLE_WAIT_S = 3600.0  # nothing due: only input wakes the loop (this bounds one wait)
# Layer runs: with this many frames to an endpoint unanswered, its next announcements
# wait in the outbox (Decode is behind: it has the next frame queued already) and go
# together, in one frame, when a reply comes.
FRAMES_AHEAD = 2
DEFAULT_MAX_LAYERS_PER_FRAME = 64


@dataclass
class _Outgoing:
    """An outbox item: what it sends, and its frame once encoded (a frame that could not
    go yet is kept as it is: a signing codec numbered it)."""

    actions: list[SendMeta | SendBatch]
    frame: bytes | None = None


@dataclass
class _Handshake:
    """``prepare``: connect and exchange MF_META ahead of the first layer."""
    endpoints: tuple[str, ...]
    done: threading.Event = field(default_factory=threading.Event)
    errors: dict[str, str] = field(default_factory=dict)
    left: set[str] = field(default_factory=set)


class PrefillSender(LoopThread):
    def __init__(
        self,
        *,
        clients_factory: Callable[[], ControlClients],
        codec: WireCodec,
        p_session: str,
        layers: Mapping[int, SourceLayout],
        clock: Clock,
        log: Logger,
        meta_ack_timeout_s: float = 10.0,
        layer_ack_timeout_s: float = 30.0,
        event_timeout_s: float = 30.0,
        reconnect_after_s: float = 5.0,
        idle_link_s: float = 300.0,
        start_timeout_s: float = 10.0,
        stop_timeout_s: float = 5.0,
        compat: Compat | None = None,  # MF_META's compat map (the codec adds ``auth``)
        wall: Callable[[], float] = time.time,  # Unix seconds: each announcement's hold
        max_layers_per_frame: int = DEFAULT_MAX_LAYERS_PER_FRAME,
    ) -> None:
        super().__init__("rd2h-prefill-sender", start_timeout_s, stop_timeout_s)
        if not 1 <= max_layers_per_frame <= MAX_RUN_LAYERS:
            raise ValueError(f"max_layers_per_frame must be in [1, {MAX_RUN_LAYERS}], got "
                             f"{max_layers_per_frame}")
        # Layer runs (1: one layer per frame, the feature not stated).
        self._max_run = max_layers_per_frame
        self._frames = 0  # frames sent, numbering each for ``PrefillSession.sent``
        self._clients_factory = clients_factory
        self._codec = codec
        self._clock = clock
        self._wall = wall
        self._log = log
        self._session = PrefillSession(layers, PrefillTimeouts(
            meta_ack_s=meta_ack_timeout_s, layer_ack_s=layer_ack_timeout_s,
            device_event_s=event_timeout_s, reconnect_after_s=reconnect_after_s,
            idle_link_s=idle_link_s))
        # Always a compat map (the generation, a nonce of this sender, follows it).
        stated = (compat or compat_of()).with_values(auth=codec.signing)
        layer_map = {lay.layer_name: lay.to_metadata() for lay in layers.values()}
        self._meta = MfMeta(p_session, layer_map, stated, secrets.randbits(63),
                            (FEATURE_LAYER_RUNS,) if max_layers_per_frame > 1 else ())
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # guards the session, the queues and the jobs
        self._events = DeviceEventWaiter(self._cond, clock, self._session.event_deadline,
                                         self._interrupt, work=threading.Condition(lock))
        self._jobs: deque[_Handshake] = deque()
        # Held announcements (``submit(hold=True)``), in order, until ``release``.
        self._holding: list[tuple[int, DeviceEvent | None]] = []
        self._sleeping = False  # the loop is (about to be) blocked in its poll: ``submit`` wakes it
        self._active: list[_Handshake] = []
        self._outbox: dict[str, deque[_Outgoing]] = {}
        self._clients: ControlClients | None = None
        self.stats = SenderStats()
        # The session's request book, for the vLLM role (under the same lock).
        self.requests = SessionRequestsView(self._cond, self._session, clock)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self.started:
            raise RuntimeError("prefill sender already started")
        self._clients = self._clients_factory()
        self._events.start("rd2h-prefill-events")
        self._launch()

    def _interrupt(self) -> None:
        if self._clients is not None:
            self._clients.wake()

    alive = LoopThread.running
    # ------------------------------------------------------------ compute path
    def submit(
        self,
        layer_idx: int,
        event: DeviceEvent | None,
        targets: Iterable[LayerTarget],
        named: Named | None = None,
        final: Iterable[str] = (),
        *,
        hold: bool = False,
    ) -> int:
        """Queue a layer's announcements; returns the number of endpoints targeted.

        ``named`` (per endpoint, the (request id, ext id) pairs it announces) and
        ``final``: the session's request book holds those requests until each
        endpoint's entry ends (``requests``).

        ``hold``: keep the announcements back (the loop is not woken) until ``release``
        or a later ``submit`` without it, which send everything held first, in order:
        layers announced together go in one frame to a Decode that reads layer runs.
        The caller releases them when its forward ends; waiting on a layer's gate
        (``wait_for_layer_send``), ``drain`` and ``stop`` release them too. A held
        layer's entries exist at once: their deadlines run from here."""
        batches = group_batches(layer_idx, self._session.layer_name(layer_idx), targets)
        with self._cond:
            aid = self._session.announce(
                layer_idx, batches, self._clock.now(), named, final,
                refused=None if self.started else "prefill sender not started")
            if batches:
                if hold:
                    self._holding.append((aid, event))
                    return len(batches)
                self._unhold()
                self._events.add(aid, event)
        if batches and self._clients is not None and self._sleeping:
            self._clients.wake()  # only a sleeping loop needs it (see ``_loop``)
        return len(batches)

    def release(self) -> bool:
        """Send the held announcements (``submit(hold=True)``) now; False: none held."""
        if not self._holding:  # read without the lock: only the compute path adds to it
            return False
        with self._cond:
            released = self._unhold()
        if released and self._clients is not None and self._sleeping:
            self._clients.wake()
        return released

    @property
    def held(self) -> int:
        """Layers held back by ``submit(hold=True)`` and not yet released."""
        with self._cond:
            return len(self._holding)

    def _unhold(self) -> bool:
        """Under the lock: hand the held announcements to the event waiter, in order."""
        if not self._holding:
            return False
        for aid, event in self._holding:
            self._events.add(aid, event)
        self._holding.clear()
        return True

    def prepare(self, endpoints: Iterable[str], timeout: float) -> dict[str, str]:
        """Connect to ``endpoints`` and exchange MF_META now, ahead of the first layer, so
        the first announcement does not pay the handshake. Returns ``{endpoint: error}``
        for the endpoints that failed (empty when all succeeded); bounded by ``timeout``."""
        job = _Handshake(tuple(dict.fromkeys(endpoints)))
        with self._cond:
            reason = self._session.dead or (None if self.started else "prefill sender not started")
            if reason is not None:
                return dict.fromkeys(job.endpoints, reason)
            self._jobs.append(job)
        if self._clients is not None:
            self._clients.wake()
        if not job.done.wait(timeout):
            return {ep: f"handshake not finished within {timeout:g} s" for ep in job.endpoints}
        return dict(job.errors)

    def wait_for_layer_send(self, layer_idx: int, timeout: float) -> None:
        """Block until the layer's storage may be reused; then raise ``LayerSendError``
        if the layer failed (or the sender died). A failed layer still waits for its
        open gate: another endpoint may still be reading that storage. Past ``timeout``
        it raises with the storage still in use (the caller must not overwrite it)."""
        deadline = self._clock.now() + timeout
        with self._cond:
            while True:
                state = self._session.gate(layer_idx)
                if not state.open and self._unhold():  # it may wait on a held layer
                    self._interrupt()
                if state.open:
                    if state.error is not None:
                        raise LayerSendError(layer_idx, state.error)
                    return
                remaining = deadline - self._clock.now()
                if remaining <= 0:
                    who = ", ".join(str(e) for e in state.waiting_on) or "?"
                    failed = f"; it already failed: {state.error}" if state.error else ""
                    raise LayerSendError(
                        layer_idx, f"no acknowledgement from {who} within {timeout:g} s{failed}"
                    )
                self._cond.wait(min(remaining, 1.0))

    @property
    def timeouts(self) -> PrefillTimeouts:
        return self._session.timeouts  # every announcement entry ends by these

    def gate_open(self, layer_idx: int) -> bool:
        """Whether the layer's storage may be written now (no endpoint still reading)."""
        with self._cond:
            return self._session.gate(layer_idx).open
    def drain(self, timeout: float) -> bool:
        """Wait until every queued announcement was processed and every layer resolved
        (acknowledged, failed or expired); False if ``timeout`` passed first."""
        deadline = self._clock.now() + timeout
        self.release()
        with self._cond:
            while self._events.pending or not self._session.idle:
                remaining = deadline - self._clock.now()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 0.1))
            return True

    def counters(self) -> dict[str, int]:
        """Leak accounting: every value is 0 when no announcement is in flight."""
        with self._cond:
            out = self._session.counters()
            out["queued_tasks"] = self._events.pending + len(self._holding)
            return out

    # ------------------------------------------------------------ sender thread
    def _loop(self) -> None:
        assert self._clients is not None
        reason = "prefill sender stopped"
        try:
            while not self._stop.is_set():
                wait = self._wait_s()
                if wait > 0:
                    # ``submit`` wakes the loop only while this is set: set it, then look
                    # for work once more (a submit that saw it unset left its work to be
                    # seen here), so no announcement waits for the poll's timeout.
                    self._sleeping = True
                    if self._events.has_done:
                        wait = 0.0
                frames = self._clients.poll(wait)
                self._sleeping = False
                self._feed(frames)
                self._flush()
                self._start_jobs()
                self._take_events()
        except BaseException as exc:
            reason = f"prefill sender crashed: {exc!r}"
            self._log.error("prefill sender crashed", error=repr(exc))
        finally:
            with self._cond:
                failed = self._session.pending_layers
                self._note(self._session.stop(reason))
                self._events.close()
                self._holding.clear()
                for job in self._jobs:
                    job.errors.update(dict.fromkeys(job.endpoints, reason))
                    job.done.set()
                for job in self._active:
                    job.errors.update(dict.fromkeys(job.left, reason))
                    job.done.set()
                self._jobs.clear()
                self._active.clear()
                self._cond.notify_all()
            if failed:
                self._log.warning("failed pending layers on sender exit", layers=list(failed))
            self._outbox.clear()
            self._clients.close()

    def _wait_s(self) -> float:
        """Until the session's next deadline (none: ``_IDLE_WAIT_S``); 0 with work queued.
        A frame in the outbox needs no wake-up of its own: the transport's poll returns
        when its connection can take it again, and its entry's deadline is the session's."""
        with self._cond:
            if self._jobs or self._events.has_done:
                return 0.0
            due = self._session.next_deadline()
        return _IDLE_WAIT_S if due is None else max(0.0, due - self._clock.now())

    def _feed(self, frames: list[tuple[str, bytes]]) -> None:
        """Replies first, then lost connections (a reply that arrived before its
        connection closed still counts), then deadlines."""
        assert self._clients is not None
        lost = self._clients.disconnected()
        back = self._clients.reconnected()
        now = self._clock.now()
        outs: list[Output] = []
        with self._cond:
            for endpoint, payload in frames:
                outs += self._receive(endpoint, payload, now)
            for endpoint in lost:
                outs += self._session.connection_lost(endpoint, now)
            for endpoint in back:
                self._session.connection_restored(endpoint)
                self._log.info("decode endpoint reconnected", endpoint=endpoint)
            outs += self._session.tick(now)
            self._note(outs)
        self._execute(outs)

    def _receive(self, endpoint: str, payload: bytes, now: float) -> list[Output]:
        try:
            msg = self._codec.decode(payload, endpoint)
        except ProtocolError as exc:
            if exc.handshake:  # an ACK (or a refusal) without valid authentication
                self._log.error("refusing acknowledgement", endpoint=endpoint,
                                error=exc.detail)
                return self._session.ack_refused(endpoint, exc.detail, now)
            self._log.warning("malformed reply", endpoint=endpoint, error=exc.detail)
            return []
        if isinstance(msg, MetaAck):
            return self._session.ack_received(endpoint, now, msg.generation, msg.layer_runs)
        if isinstance(msg, MetaRefused):  # Decode refused our MF_META: what waits on it fails
            self._log.error("decode refused the handshake", endpoint=endpoint,
                            reason=msg.describe())
            self.stats.handshakes_refused += 1
            return self._session.ack_refused(endpoint, msg.describe(), now, notify=True)
        if not isinstance(msg, ReadDone | ReadFailed):
            self._log.warning("unexpected message from decode", endpoint=endpoint)
            return []
        outs: list[Output] = []
        # One per layer of a layer run (a pair naming no announcement of this endpoint
        # that waits for its reply changes nothing, as a stray reply).
        for one in answered(msg):
            outs += self._session.reply(endpoint, one, now)
        return outs

    def _start_jobs(self) -> None:
        with self._cond:
            if not self._jobs:
                return
            now, outs = self._clock.now(), []
            while self._jobs:
                job = self._jobs.popleft()
                job.left = set(job.endpoints)
                self._active.append(job)
                outs += self._session.prepare(job.endpoints, now)
            self._note(outs)
        self._execute(outs)

    def _take_events(self) -> None:
        """Announce every layer whose device event completed, in order."""
        with self._cond:
            now, outs = self._clock.now(), []
            for aid in self._events.take_done():
                outs += self._session.event_done(aid, now)
            self._note(outs)
        self._execute(outs)

    # ------------------------------------------------------------ actions
    def _execute(self, outs: list[Output]) -> None:
        assert self._clients is not None
        unreachable: dict[str, str] = {}
        for out in outs:
            if isinstance(out, Connect):
                try:
                    self._clients.connect(out.endpoint)
                except ConnectionError as exc:
                    unreachable[out.endpoint] = str(exc)
            elif isinstance(out, Disconnect):
                self._outbox.pop(out.endpoint, None)
                self._clients.disconnect(out.endpoint)
                self._codec.forget(out.endpoint)
            elif isinstance(out, SendMeta | SendBatch):
                if out.endpoint in unreachable:
                    self._send_failed(out, unreachable[out.endpoint])
                    continue
                self._outbox.setdefault(out.endpoint, deque()).append(_Outgoing([out]))
        self._flush()
        with self._cond:
            self._cond.notify_all()

    def _held(self, batch: ReadReadyBatch) -> ReadReadyBatch:
        """With its hold: the session keeps what went out until its reply deadline."""
        hold_ms = int((self._wall() + self._session.timeouts.layer_ack_s) * 1000)
        return dataclasses.replace(batch, hold_until_ms=hold_ms)

    def _flush(self) -> None:
        """Send what waits in the outbox, in order per endpoint; what cannot go yet stays
        (the session's deadline ends it, and its ``Disconnect`` empties the outbox). To a
        Decode that reads layer runs, announcements wait while ``FRAMES_AHEAD`` frames are
        unanswered, and consecutive ones with the same read entries go in one frame."""
        assert self._clients is not None
        for endpoint in list(self._outbox):
            box = self._outbox.get(endpoint)
            while box:
                item = box[0]
                if item.frame is None and not self._encode(endpoint, box):
                    break  # Decode is behind: wait for a reply
                assert item.frame is not None
                try:
                    self._clients.send(endpoint, item.frame, timeout=0.0)
                except ConnectionError:
                    break
                box.popleft()
                if isinstance(item.actions[0], SendBatch):
                    self._frames += 1
                    with self._cond:
                        now = self._clock.now()
                        for action in item.actions:
                            self._session.sent(endpoint, action.announcement, now,  # type: ignore[union-attr]
                                               self._frames)
                        self.stats.layers_sent += len(item.actions)
                        self.stats.frames_sent += 1
                    first = item.actions[0].batch
                    self._log.debug("layers announced", layer=first.layer_idx,
                                    layers=len(item.actions), endpoint=endpoint,
                                    requests=len(first.read_reqs))
            if not self._outbox.get(endpoint):
                self._outbox.pop(endpoint, None)

    def _encode(self, endpoint: str, box: deque[_Outgoing]) -> bool:
        """Encode the head of ``box``: MF_META, or an announcement with the ones after
        it that can share its frame (a layer run); False when it must wait for a reply."""
        head = box[0]
        action = head.actions[0]
        if isinstance(action, SendMeta):
            head.frame = self._codec.encode(self._meta, endpoint)
            return True
        first = action.batch
        held = self._held(first)
        # A run rides after the hold (fields 9 and 10): none without one.
        runs = (self._max_run > 1 and held.seq is not None and held.hold_until_ms is not None
                and not _has_digests(first))
        if runs:
            with self._cond:
                runs = self._session.layer_runs(endpoint)
                if runs and self._session.frames_on_wire(endpoint) >= FRAMES_AHEAD:
                    return False
        while runs and len(head.actions) < self._max_run and len(box) > 1:
            nxt = box[1]
            other = nxt.actions[0]
            if nxt.frame is not None or not isinstance(other, SendBatch) or not _same_entries(
                    first, other.batch):
                break
            head.actions.append(other)
            del box[1]
        if len(head.actions) > 1:
            held = dataclasses.replace(held, also=tuple(
                RunLayer(a.batch.layer_idx, a.batch.layer_name, a.batch.seq or 0,
                         a.batch.done_ext_ids)
                for a in head.actions[1:] if isinstance(a, SendBatch)))
        head.frame = self._codec.encode(held, endpoint)
        return True

    def _send_failed(self, action: SendMeta | SendBatch, reason: str) -> None:
        with self._cond:
            outs = self._session.send_failed(action, reason, self._clock.now())
            self._note(outs)
        self._execute(outs)

    def _note(self, outs: list[Output]) -> None:
        """Stats, logs and ``prepare`` jobs from the session's events, under the lock
        that changed the session: whoever wakes on it sees them."""
        for done in report_prefill(outs, self.stats, self._log):
            for job in list(self._active):
                if done.endpoint not in job.left:
                    continue
                job.left.discard(done.endpoint)
                if done.error is not None:
                    job.errors[done.endpoint] = done.error
                if not job.left:
                    self._active.remove(job)
                    job.done.set()


def _has_digests(batch: ReadReadyBatch) -> bool:
    return any(r.digests is not None for r in batch.read_reqs)


def _same_entries(a: ReadReadyBatch, b: ReadReadyBatch) -> bool:
    """Whether ``b`` can ride in ``a``'s frame as a layer run: the same read entries (no
    digests: those are per layer), contributor position, ratio and awaited requests."""
    return (a.group_member_idx == b.group_member_idx and a.tp_ratio == b.tp_ratio
            and a.awaits == b.awaits and a.read_reqs == b.read_reqs and not _has_digests(b))
