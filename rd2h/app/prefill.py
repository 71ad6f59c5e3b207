"""Prefill sender: announces ready layers to Decode endpoints and drives the
storage-slot gates (spec 3.3, 4, 7.1).

The compute path calls ``submit`` after a layer's KV scatter (gates close right
there, in the caller's thread) and ``wait_for_layer_send`` before a layer's
storage is written again. A background thread owns the sockets: it waits for
the device event, sends MF_META once per connection (and waits for b"ACK"),
sends one READ_READY_BATCH per endpoint, drains replies and expires deadlines.
If the thread ends for any reason, every pending layer fails and its gates
open, so the compute path raises instead of deadlocking. No wait is unbounded.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field

from rd2h.app.tickets import AnnouncementTickets
from rd2h.domain.completion import StorageSlotGates
from rd2h.domain.errors import CompletionError, LayerSendError, ProtocolError
from rd2h.domain.layout import SourceLayout
from rd2h.domain.protocol import MfMeta, ReadDone, ReadFailed, ReadReadyBatch, ReadRequest
from rd2h.ports.codec import WireCodec
from rd2h.ports.control import ControlClients
from rd2h.ports.runtime import Clock, DeviceEvent, Logger


@dataclass(frozen=True)
class LayerTarget:
    """One request's share of a layer for one Decode endpoint."""

    endpoint: str
    request: ReadRequest | None
    done: bool = False
    member: int = 0
    ratio: int = 1
    ext_req_id: str = ""


@dataclass(frozen=True)
class _Task:
    layer_idx: int
    event: DeviceEvent | None
    batches: Mapping[str, ReadReadyBatch]
    epoch: int = 0  # the layer's gate epoch when announced; a later one means stale


@dataclass(frozen=True)
class _Handshake:
    """Connect and exchange MF_META ahead of the first layer (``prepare``)."""

    endpoints: tuple[str, ...]
    done: threading.Event
    errors: dict[str, str]


@dataclass
class SenderStats:
    layers_sent: int = 0
    layers_failed: int = 0
    ack_latencies_ms: list[float] = field(default_factory=list)


def group_batches(
    layer_idx: int, layer_name: str, targets: Iterable[LayerTarget]
) -> dict[str, ReadReadyBatch]:
    """One READ_READY_BATCH per endpoint, with every request for that endpoint."""
    reqs: dict[str, list[ReadRequest]] = {}
    done: dict[str, list[str]] = {}
    group: dict[str, tuple[int, int]] = {}
    for t in targets:
        prev = group.setdefault(t.endpoint, (t.member, t.ratio))
        if prev != (t.member, t.ratio):
            raise ValueError(f"endpoint {t.endpoint}: mixed contributor positions {prev}")
        reqs.setdefault(t.endpoint, [])
        done.setdefault(t.endpoint, [])
        if t.request is not None:
            reqs[t.endpoint].append(t.request)
        if t.done:
            ext = t.ext_req_id or (t.request.ext_req_id if t.request else "")
            if not ext:
                raise ValueError("a done target needs its external request id")
            done[t.endpoint].append(ext)
    return {
        ep: ReadReadyBatch(layer_idx, layer_name, tuple(reqs[ep]), tuple(done[ep]), *group[ep])
        for ep in reqs
    }


class PrefillSender:
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
        poll_interval_s: float = 0.02,
        start_timeout_s: float = 10.0,
        stop_timeout_s: float = 5.0,
    ) -> None:
        self._clients_factory = clients_factory
        self._codec = codec
        self._clock = clock
        self._log = log
        self._meta_timeout = meta_ack_timeout_s
        self._ack_timeout = layer_ack_timeout_s
        self._event_timeout = event_timeout_s
        self._reconnect_after = reconnect_after_s
        self._poll = poll_interval_s
        self._start_timeout = start_timeout_s
        self._stop_timeout = stop_timeout_s
        self._layers = dict(layers)
        self._names = {idx: lay.layer_name for idx, lay in self._layers.items()}
        self._gates = StorageSlotGates()
        for idx, lay in self._layers.items():
            self._gates.register_layer(idx, *lay.storage_keys)
        self._meta_frame = codec.encode(
            MfMeta(p_session, {lay.layer_name: lay.to_metadata() for lay in self._layers.values()})
        )
        self._cond = threading.Condition()
        self._queue: queue.Queue[_Task | _Handshake] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dead: str | None = None
        self._meta_ok: set[str] = set()
        self._meta_failed: dict[str, tuple[float, str]] = {}
        self._refused: dict[str, str] = {}  # endpoint -> why its ACK failed authentication
        self._sent_at: dict[tuple[int, str], list[float]] = {}
        self._unfinished = 0  # tasks queued or being processed (under _cond)
        self._lost_now: set[str] = set()  # endpoints the transport saw disconnect
        self._started = threading.Event()
        self._clients: ControlClients | None = None
        self._tickets = AnnouncementTickets()
        self.stats = SenderStats()

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("prefill sender already started")
        self._clients = self._clients_factory()
        self._thread = threading.Thread(target=self._run, name="rd2h-prefill-sender", daemon=True)
        self._thread.start()
        if not self._started.wait(self._start_timeout):
            self._stop.set()
            raise TimeoutError(
                f"prefill sender thread did not start within {self._start_timeout:g} s"
            )

    def stop(self, timeout: float | None = None) -> bool:
        """Stop the sender thread (pending layers fail, gates open); True if it ended
        within ``timeout`` (default: the configured stop deadline)."""
        timeout = self._stop_timeout if timeout is None else timeout
        self._stop.set()
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # ------------------------------------------------------------ compute path
    def submit(
        self,
        layer_idx: int,
        event: DeviceEvent | None,
        targets: Iterable[LayerTarget],
        ticket: Hashable | None = None,
    ) -> int:
        """Queue a layer's announcements; returns the number of endpoints targeted.

        With a ``ticket``, ``take_resolved()`` later reports ``(ticket, error)`` once
        every endpoint of this announcement replied or the layer failed."""
        name = self._names.get(layer_idx)
        if name is None:
            raise CompletionError(f"layer {layer_idx} has no storage slot mapping")
        batches = group_batches(layer_idx, name, targets)
        with self._cond:
            if self._dead is not None or self._thread is None:
                reason = self._dead or "prefill sender not started"
                raise LayerSendError(layer_idx, reason)
            budget = self._event_timeout + self._meta_timeout + self._ack_timeout
            self._gates.announce(layer_idx, list(batches), deadline=self._clock.now() + budget)
            if ticket is not None:
                self._tickets.open(ticket, layer_idx, batches)
            if batches:  # under the lock: the exiting thread drains the queue under it too
                self._unfinished += 1
                self._queue.put(
                    _Task(layer_idx, event, batches, self._gates.epoch(layer_idx))
                )
        if batches and self._clients is not None:
            self._clients.wake()
        return len(batches)

    def prepare(self, endpoints: Iterable[str], timeout: float) -> dict[str, str]:
        """Connect to ``endpoints`` and exchange MF_META now, ahead of the first layer, so
        the first announcement does not pay the handshake. Returns ``{endpoint: error}``
        for the endpoints that failed (empty when all succeeded); bounded by ``timeout``."""
        job = _Handshake(tuple(dict.fromkeys(endpoints)), threading.Event(), {})
        with self._cond:
            if self._dead is not None or self._thread is None:
                reason = self._dead or "prefill sender not started"
                return dict.fromkeys(job.endpoints, reason)
            self._queue.put(job)
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
                state = self._gates.state(layer_idx)
                if state.open:
                    if state.error is not None:
                        raise LayerSendError(layer_idx, state.error)
                    return
                remaining = deadline - self._clock.now()
                if remaining <= 0:
                    who = ", ".join(str(e) for e in state.waiting_on) or "?"
                    failed = f"; it already failed: {state.error}" if state.error else ""
                    raise LayerSendError(
                        layer_idx,
                        f"no acknowledgement from {who} within {timeout:g} s{failed}",
                    )
                self._cond.wait(min(remaining, 1.0))

    def take_resolved(self) -> list[tuple[Hashable, str | None]]:
        """Tickets (see ``submit``) resolved since the last call, with their error."""
        with self._cond:
            return self._tickets.take_resolved()

    def gate_open(self, layer_idx: int) -> bool:
        """Whether the layer's storage may be written now (no endpoint still reading)."""
        with self._cond:
            return self._gates.state(layer_idx).open

    def drain(self, timeout: float) -> bool:
        """Wait until every queued announcement was processed and every layer resolved
        (acknowledged, failed or expired); False if ``timeout`` passed first. Lets a
        caller check that nothing is left before tearing down."""
        deadline = self._clock.now() + timeout
        with self._cond:
            while self._unfinished or self._gates.pending_layers:
                remaining = deadline - self._clock.now()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 0.1))
            return True

    def counters(self) -> dict[str, int]:
        """Leak accounting: every value is 0 when no announcement is in flight."""
        with self._cond:
            return {
                "pending_layers": len(self._gates.pending_layers),
                "closed_slots": self._gates.closed_slots,
                "queued_tasks": self._unfinished,
                "unacked_sends": sum(len(v) for v in list(self._sent_at.values())),
                "open_tickets": self._tickets.open_count,
            }

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------ sender thread
    def _run(self) -> None:
        reason = "prefill sender stopped"
        self._started.set()
        try:
            while not self._stop.is_set():
                self._drain(0 if not self._queue.empty() else self._poll)
                self._expire()
                try:
                    task = self._queue.get_nowait()
                except queue.Empty:
                    continue
                if isinstance(task, _Handshake):
                    self._handshake(task)
                    continue
                try:
                    self._process(task)
                finally:
                    with self._cond:
                        self._unfinished -= 1
                        self._cond.notify_all()
        except BaseException as exc:
            reason = f"prefill sender crashed: {exc!r}"
            self._log.error("prefill sender crashed", error=repr(exc))
        finally:
            with self._cond:
                self._dead = reason
                # Name what each layer was waiting on: the caller learns layer and endpoint.
                waiting = {lyr: self._gates.state(lyr).waiting_on
                           for lyr in self._gates.pending_layers}
                for lyr, eps in waiting.items():
                    who = ", ".join(str(e) for e in eps) or "no endpoint"
                    self._gates.fail_layer(lyr, f"{reason} (layer {lyr} awaited {who})")
                failed = sorted(waiting)
                self._tickets.fail_all(reason)
                while not self._queue.empty():  # never processed; their gates failed above
                    left = self._queue.get_nowait()
                    if isinstance(left, _Handshake):
                        left.errors.update(dict.fromkeys(left.endpoints, reason))
                        left.done.set()
                self._unfinished = 0
                self._sent_at.clear()
                self._cond.notify_all()
            if failed:
                self._log.warning("failed pending layers on sender exit", layers=failed)
            if self._clients is not None:
                self._clients.close()

    def _ack(self, layer_idx: int, endpoint: str, error: str | None) -> None:
        if error is not None and endpoint not in error:
            error = f"decode endpoint {endpoint}: {error}"  # the caller learns who failed
        with self._cond:
            completed = self._gates.acknowledge(layer_idx, endpoint, error)
            self._tickets.reply(layer_idx, endpoint, error)
            if completed:
                self._cond.notify_all()
        sent = self._sent_at.get((layer_idx, endpoint))
        if sent:
            self.stats.ack_latencies_ms.append((self._clock.now() - sent.pop(0)) * 1e3)
            if not sent:
                del self._sent_at[(layer_idx, endpoint)]
        if error is not None:
            self.stats.layers_failed += 1
            self._log.warning("layer not read by decode", layer=layer_idx, endpoint=endpoint,
                              error=error)

    def _reset_endpoint(self, endpoint: str, reason: str, *, close: bool) -> None:
        """No reply will come from ``endpoint`` for what was sent so far: fail every layer
        still waiting on it (gates open, the compute path raises). With ``close`` the
        connection is dropped as well, so that Decode fails the requests this rank was
        contributing to (it must not complete them from storage Prefill may now reuse);
        the next announcement to ``endpoint`` connects and handshakes again."""
        with self._cond:
            layers = self._gates.fail_endpoint(endpoint, reason)
            self._tickets.fail_endpoint(endpoint, reason)
            self._cond.notify_all()
        self._meta_ok.discard(endpoint)
        for key in [k for k in self._sent_at if k[1] == endpoint]:
            del self._sent_at[key]
        if close and self._clients is not None:
            self._clients.disconnect(endpoint)
        self.stats.layers_failed += len(layers)
        log = self._log.warning if layers else self._log.info  # idle: e.g. Decode shut down
        log("decode endpoint reset", endpoint=endpoint, failed_layers=layers, reason=reason)

    def _expire(self) -> None:
        now = self._clock.now()
        late: dict[str, int] = {}
        for (layer_idx, endpoint), times in self._sent_at.items():
            if times and times[0] + self._ack_timeout <= now:
                late.setdefault(endpoint, layer_idx)
        for endpoint, layer_idx in sorted(late.items()):
            self._reset_endpoint(
                endpoint,
                f"no acknowledgement of layer {layer_idx} from decode endpoint {endpoint} "
                f"within {self._ack_timeout:g} s",
                close=True,
            )
        with self._cond:
            expired = self._gates.expire(self._clock.now())
            for item in expired:
                self._tickets.fail_layer(
                    item.layer_idx, f"no acknowledgement within {self._ack_timeout:g} s"
                )
            if expired:
                self._cond.notify_all()
        for item in expired:
            self._log.warning("layer acknowledgement deadline passed", layer=item.layer_idx,
                              endpoints=[str(e) for e in item.endpoints])
            for ep in item.endpoints:
                self._sent_at.pop((item.layer_idx, str(ep)), None)

    def _drain(self, timeout: float) -> list[tuple[str, bytes]]:
        """Handle every reply that arrives within ``timeout``; return raw ACK frames."""
        assert self._clients is not None
        acks = []
        for endpoint, payload in self._clients.poll(timeout):
            try:
                if self._codec.is_ack(payload):
                    acks.append((endpoint, payload))
                    continue
            except ProtocolError as exc:  # an ACK without valid authentication
                self._log.error("refusing acknowledgement", endpoint=endpoint, error=exc.detail)
                self._refused[endpoint] = exc.detail
                continue
            try:
                msg = self._codec.decode(payload)
            except ProtocolError as exc:
                self._log.warning("malformed reply", endpoint=endpoint, error=exc.detail)
                continue
            if isinstance(msg, ReadDone):
                self._ack(msg.layer_idx, endpoint, None)
            elif isinstance(msg, ReadFailed):
                # Decode may have restarted behind the same endpoint (ZMQ reconnects
                # silently and the new ROUTER has no MF_META for us): handshake again.
                self._meta_ok.discard(endpoint)
                self._ack(msg.layer_idx, endpoint, msg.error or "decode reported READ_FAILED")
            else:
                self._log.warning("unexpected message from decode", endpoint=endpoint)
        # After the replies: one that arrived before its connection closed still counts.
        for endpoint in self._clients.disconnected():
            self._lost_now.add(endpoint)
            self._reset_endpoint(
                endpoint,
                f"decode endpoint {endpoint} disconnected (process gone, connection reset "
                f"or heartbeat timeout)",
                close=False,
            )
        return acks

    def _ensure_meta(self, endpoint: str) -> None:
        """MF_META once per connection, acknowledged within the deadline."""
        assert self._clients is not None
        if endpoint in self._meta_ok:
            return
        failed = self._meta_failed.get(endpoint)
        if failed is not None:
            if self._clock.now() < failed[0]:
                raise ConnectionError(failed[1])
            del self._meta_failed[endpoint]
        self._clients.connect(endpoint)
        self._lost_now.discard(endpoint)
        deadline = self._clock.now() + self._meta_timeout
        self._refused.pop(endpoint, None)
        try:
            self._send(endpoint, self._meta_frame, self._meta_timeout)
            while True:
                remaining = deadline - self._clock.now()
                refused = self._refused.pop(endpoint, None)
                if refused is not None:
                    raise ConnectionError(f"decode endpoint {endpoint} refused: {refused}")
                if endpoint in self._lost_now:
                    raise ConnectionError(
                        f"decode endpoint {endpoint} disconnected during the MF_META handshake"
                    )
                if self._stop.is_set():
                    raise ConnectionError(
                        f"prefill sender stopped while waiting for the MF_META "
                        f"acknowledgement from {endpoint}"
                    )
                if remaining <= 0:
                    raise ConnectionError(
                        f"no MF_META acknowledgement from {endpoint} "
                        f"within {self._meta_timeout:g} s (decode down or unreachable, or "
                        f"refusing this peer: is auth_secret the same on both sides?)"
                    )
                if any(ep == endpoint for ep, _ in self._drain(min(remaining, self._poll))):
                    self._meta_ok.add(endpoint)
                    self._log.info("decode endpoint acknowledged metadata", endpoint=endpoint)
                    return
        except ConnectionError as exc:
            self._clients.disconnect(endpoint)
            self._meta_failed[endpoint] = (self._clock.now() + self._reconnect_after, str(exc))
            raise

    def _send(self, endpoint: str, frame: bytes, timeout: float) -> None:
        """Send one frame within ``timeout``, in short slices so that a stop interrupts it."""
        assert self._clients is not None
        deadline = self._clock.now() + timeout
        slice_s = max(self._poll, 0.005)
        while True:
            try:
                remaining = deadline - self._clock.now()
                self._clients.send(endpoint, frame, timeout=max(0.0, min(remaining, slice_s)))
                return
            except ConnectionError:
                if self._stop.is_set():
                    raise ConnectionError(
                        f"prefill sender stopped before {endpoint} was reachable"
                    ) from None
                if self._clock.now() >= deadline:
                    raise ConnectionError(
                        f"decode endpoint {endpoint} is not reachable within {timeout:g} s"
                    ) from None

    def _wait_event(self, event: DeviceEvent) -> str | None:
        """Wait for the device event in short slices; the reason it failed, or None."""
        deadline = self._clock.now() + self._event_timeout
        slice_s = max(self._poll, 0.005)
        while not event.wait(max(0.0, min(deadline - self._clock.now(), slice_s))):
            if self._stop.is_set():
                return "prefill sender stopped while waiting for the device event"
            if self._clock.now() >= deadline:
                return f"device event not complete within {self._event_timeout:g} s"
        return None

    def _handshake(self, job: _Handshake) -> None:
        for endpoint in job.endpoints:
            try:
                self._ensure_meta(endpoint)
            except ConnectionError as exc:
                job.errors[endpoint] = str(exc)
        job.done.set()

    def _process(self, task: _Task) -> None:
        log = self._log.bind(layer=task.layer_idx)
        reason = None if task.event is None else self._wait_event(task.event)
        if reason is not None:
            for ep in task.batches:
                self._ack(task.layer_idx, ep, reason)
            return
        for endpoint, batch in task.batches.items():
            with self._cond:
                live = self._gates.epoch(task.layer_idx) == task.epoch and (
                    self._gates.is_pending(task.layer_idx, endpoint)
                )
            if not live:  # the layer failed or expired meanwhile: its storage is not ours
                log.info("dropping a stale announcement", endpoint=endpoint)
                continue
            try:
                self._ensure_meta(endpoint)
                self._send(endpoint, self._codec.encode(batch), self._meta_timeout)
            except ConnectionError as exc:
                self._ack(task.layer_idx, endpoint, str(exc))
                continue
            # The acknowledgement deadline (``_expire``) runs from here.
            self._sent_at.setdefault((task.layer_idx, endpoint), []).append(self._clock.now())
            self.stats.layers_sent += 1
            log.debug("layer announced", endpoint=endpoint, requests=len(batch.read_reqs),
                      done=len(batch.done_ext_ids))
