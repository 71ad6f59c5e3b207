"""Decode receiver: the ROUTER loop that drives a ``DecodeSession`` against the ports.

The loop receives frames, decodes them, feeds them to the session with the
time, and performs what the session asks: acknowledge MF_META, reply, or run
one batched read (outside the lock, so the engine side can admit and step
meanwhile). Every rule lives in the session (``rd2h.domain.decode.decode_session``).
Per READ_READY_BATCH exactly one READ_DONE or READ_FAILED goes back, also when
this rank owns none of the blocks; a malformed or hostile message never stops
the loop. The loop has no poll interval: it sleeps until the session's next deadline
(it expires late requests itself, worker steps or not) or the next input: a message, a
lost connection, ``stop``, or an admission or step that made something due sooner.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from rd2h.app.loop import LoopThread
from rd2h.app.read_checks import ReadChecks
from rd2h.app.telemetry import DecodeStats, add_sample, report_decode
from rd2h.domain.decode.decode_session import (
    DEFAULT_MAX_PEERS,
    DEFAULT_PARK_S,
    DEFAULT_PARKED_BYTES,
    DEFAULT_PARKED_BYTES_PER_PEER,
    DecodeSession,
    Expired,
    Forget,
    LayerDone,
    Output,
    Read,
    Reply,
    SendAck,
    SendRefusal,
)
from rd2h.domain.decode.orphans import DEFAULT_ORPHANS_PER_PEER, DEFAULT_ORPHANS_TOTAL
from rd2h.domain.decode.request_book import StepOutcome
from rd2h.domain.errors import ProtocolError, TransferError
from rd2h.domain.planning.layout import DestinationLayout
from rd2h.domain.planning.planning import ReadPlan
from rd2h.domain.wire.compat import Compat
from rd2h.domain.wire.protocol import MetaAck, ReadReadyBatch
from rd2h.ports import runtime as rt
from rd2h.ports.codec import WireCodec
from rd2h.ports.control import ControlServer
from rd2h.ports.transfer import TransferEngine

_RETRY_S = 0.05  # after a failed receive (a zmq error), wait this long before the next
_IDLE_WAIT_S = 3600.0  # nothing due: only input wakes the loop (this bounds one wait)
_BATCH = 64  # messages handled per wake at most (then deadlines and losses again)
_SHED_LOG_S = 5.0  # at most one warning this often about messages dropped over budget


class DecodeReceiver(LoopThread):
    """One Decode TP rank's receive loop and request book.

    ``on_read`` (optional) sees every successful read as ``(p_session, plan)``; the
    demo uses it to replay the same descriptors on the bare transport.
    ``on_progress`` (optional) is called, on the loop thread, each time a request
    reached a terminal state on this rank: a worker loop that sleeps between steps
    (and the other TP ranks' loops, which must step with it) can wake at once.
    ``compat`` (optional): what this rank states for MF_META's compatibility map (the
    codec adds its ``signing``); an MF_META whose map differs is refused.
    ``wall`` (Unix seconds) and ``hold_margin_s``: an announcement's hold (until when
    Prefill keeps its blocks) must not have ended, less the margin, before the read
    starts nor when it ended, else the layer fails (see ``ReadChecks.hold_ended``).
    """

    def __init__(
        self,
        *,
        server_factory: Callable[[], ControlServer],
        codec: WireCodec,
        transfer: TransferEngine,
        destinations: Mapping[str, DestinationLayout],
        d_rank: int,
        d_tp: int,
        clock: rt.Clock,
        log: rt.Logger,
        request_timeout_s: float = 120.0,
        on_read: Callable[[str, ReadPlan], None] | None = None,
        on_progress: Callable[[], None] | None = None,
        main_shared: bool = True,
        start_timeout_s: float = 10.0,
        stop_timeout_s: float = 5.0,
        max_peers: int = DEFAULT_MAX_PEERS,
        max_orphans_per_peer: int = DEFAULT_ORPHANS_PER_PEER,
        max_orphans: int = DEFAULT_ORPHANS_TOTAL,
        timeline: rt.Timeline = rt.NO_TIMELINE,
        compat: Compat | None = None,
        wall: Callable[[], float] = time.time,
        hold_margin_s: float = 0.25,
        digest: rt.Digest | None = None,
        park_s: float = DEFAULT_PARK_S,
        max_parked_bytes_per_peer: int = DEFAULT_PARKED_BYTES_PER_PEER,
        max_parked_bytes: int = DEFAULT_PARKED_BYTES,
    ) -> None:
        self._timeline = timeline
        super().__init__(f"rd2h-decode-{d_rank}", start_timeout_s, stop_timeout_s)
        self._server_factory = server_factory
        self._codec = codec
        self._transfer = transfer
        self._clock = clock
        self._log = log
        self._on_read = on_read
        self._on_progress = on_progress
        self._session = DecodeSession(destinations=destinations, d_rank=d_rank, d_tp=d_tp,
                                      main_shared=main_shared,
                                      request_timeout_s=request_timeout_s,
                                      max_peers=max_peers,
                                      max_orphans_per_peer=max_orphans_per_peer,
                                      max_orphans=max_orphans, compat=None if compat is None
                                      else compat.with_values(auth=codec.signing),
                                      generation=secrets.randbits(63), park_s=park_s,
                                      hold_margin_s=hold_margin_s,
                                      max_parked_bytes_per_peer=max_parked_bytes_per_peer,
                                      max_parked_bytes=max_parked_bytes)
        self._wall = wall
        self._lock = threading.Lock()
        self._progress = threading.Event()
        self._server: ControlServer | None = None
        self._sleep_until = 0.0  # when the loop's wait ends (under the lock; ``_wait_s``)
        self._shed_since: dict[bytes, int] = {}  # dropped per peer since the last warning
        self._shed_logged_at = float("-inf")
        self.stats = DecodeStats()
        self._checks = ReadChecks(self.stats, log, wall, hold_margin_s, digest)

    @property
    def d_rank(self) -> int:
        return self._session.d_rank

    @property
    def d_tp(self) -> int:
        return self._session.d_tp

    @property
    def main_shared(self) -> bool:
        return self._session.main_shared

    # ------------------------------------------------------------ lifecycle
    def start(self) -> str:
        """Bind and start the loop; a bind failure raises here (no thread started)."""
        if self.started:
            raise RuntimeError("decode receiver already started")
        self._server = self._server_factory()
        self._launch()
        self._log.info("decode receiver listening", endpoint=self._server.endpoint)
        return self._server.endpoint

    def _interrupt(self) -> None:
        if self._server is not None:
            self._server.wake()

    def stop(self, timeout: float | None = None) -> bool:
        ended = super().stop(timeout)
        if ended and self._server is not None:
            self._server.close()
        return ended

    # ------------------------------------------------------------ engine side
    def admit(self, internal_id: str, main_block_ids: Iterable[int],
              indexer_block_ids: Iterable[int],
              group_block_ids: Sequence[Sequence[int]] = ()) -> str:
        """Destinations of a request: main and indexer lists, and every KV cache group's
        list (a layer of a group reads into that group's blocks; ``NO_BLOCK``: none)."""
        with self._lock:
            ext = self._session.admit(internal_id, main_block_ids, indexer_block_ids,
                                      self._clock.now(), group_block_ids)
            self._due_sooner()
            return ext

    def step(
        self, exchange: rt.TpGroupExchange, finished_by_vllm: Iterable[str] = (),
        timeout: float = 30.0,
    ) -> StepOutcome:
        """One worker step: expire late requests, exchange terminal sets, resolve."""
        self.expire()
        with self._lock:
            report = self._session.local_report()
        reports = exchange.all_gather(report, timeout)
        with self._lock:
            out = self._session.finish_step(reports, finished_by_vllm, self._clock.now())
            self._due_sooner()  # state learned from the other ranks expires too
            return out

    def expire(self) -> list[str]:
        """Fail admitted requests past the request deadline and drop stale state of
        requests never admitted here; the loop does this at each deadline, ``step``
        first. Callable any time; returns the requests that just failed."""
        with self._lock:
            outs = self._session.tick(self._clock.now())
        self._report(outs)
        return [ext for out in outs if isinstance(out, Expired) for ext in out.requests]

    def abandon(self, internal_ids: Iterable[str]) -> None:
        """Drop the state of requests given up on outside a step (e.g. the TP exchange
        failed, so no step can resolve them any more)."""
        with self._lock:
            self._session.drop(internal_ids)

    def fail_loads(self, reasons: Mapping[str, str]) -> list[str]:
        """Fail these requests (internal id -> reason) now: their KV will not come (the
        proxy could not dispatch them to Prefill). Returns those that were still waiting."""
        failed: dict[str, str] = {}
        with self._lock:
            for internal_id, reason in reasons.items():
                for ext in self._session.fail_loads((internal_id,), reason):
                    failed[ext] = reason
        for ext, reason in failed.items():  # each with its own reason
            self._log.warning("failing a request whose KV will not come", request=ext,
                              reason=reason)
        if failed:
            self.stats.failed_fast += len(failed)
            self._progress.set()
        return list(failed)

    def wait_for_progress(self, timeout: float) -> bool:
        """Block until a request reached a terminal state on this rank since the last
        call (or ``timeout`` passed); lets a worker loop step when there is news."""
        happened = self._progress.wait(timeout)
        self._progress.clear()
        return happened

    def in_flight(self) -> int:
        """Requests admitted on this rank and not yet resolved by a step."""
        with self._lock:
            return self._session.admitted_count

    def counters(self) -> dict[str, int]:
        with self._lock:
            return self._session.counters()

    # ------------------------------------------------------------ loop
    def _loop(self) -> None:
        assert self._server is not None
        while not self._stop.is_set():
            try:
                items = self._receive(self._wait_s())
                self._apply_losses()
                self._report_shed()
            except Exception as exc:  # socket closed under us or a zmq error
                if self._stop.is_set():
                    break
                self._log.error("control socket receive failed", error=repr(exc))
                self._stop.wait(_RETRY_S)
                continue
            self._release_parked()
            for identity, payload in items:
                if self._stop.is_set():
                    break
                t0 = self._clock.now()
                try:
                    self._handle(identity, payload)
                except Exception as exc:  # never let one message kill the loop
                    self.stats.malformed += 1
                    self._log.error("message handling failed", error=repr(exc))
                self.stats.handle_seconds += self._clock.now() - t0

    def _receive(self, timeout: float) -> list[tuple[bytes, bytes]]:
        """Every message already queued (up to ``_BATCH``), or wait ``timeout`` for one:
        a busy rank handles what piled up in one wake, with one loss check and one
        deadline look for all of it (each read still checks for losses after it)."""
        assert self._server is not None
        return self._server.recv_many(timeout, _BATCH)

    def _wait_s(self) -> float:
        """Expire what is due, then wait until the session's next deadline (none:
        ``_IDLE_WAIT_S``); ``_due_sooner`` wakes the wait when that moves earlier."""
        for expired in (False, True):
            with self._lock:
                now, due = self._clock.now(), self._session.next_deadline()
                if expired or due is None or due > now:
                    wait = _IDLE_WAIT_S if due is None else max(0.0, due - now)
                    self._sleep_until = now + wait if due is None else due
                    return wait
            self.expire()  # outside the lock: it reports (and may wake the engine side)
        raise AssertionError("unreachable")

    def _due_sooner(self) -> None:
        """Under the lock, after the engine side changed the session: wake the loop if
        something is now due before its wait ends (once; it then waits for that)."""
        due = self._session.next_deadline()
        if due is not None and due < self._sleep_until and self._server is not None:
            self._sleep_until = due
            self._server.wake()

    def _apply_losses(self) -> None:
        """Connection losses the control server saw since the last look."""
        assert self._server is not None
        lost = self._server.disconnected()
        if lost:
            now = self._clock.now()
            with self._lock:
                outs = [o for peer in lost for o in self._session.peer_lost(peer, now)]
            for peer in lost:
                self._codec.forget(peer)
            self._report(outs)

    def _report_shed(self) -> None:
        """Count what the control server dropped over its receive budget; one warning
        per ``_SHED_LOG_S`` at most, naming the peers (a flood must not flood the log)."""
        assert self._server is not None
        shed = self._server.shed()
        if not shed:
            return
        for identity, messages, nbytes in shed:
            self.stats.shed += messages
            self.stats.shed_bytes += nbytes
            self._shed_since[identity] = self._shed_since.get(identity, 0) + messages
        now = self._clock.now()
        if now - self._shed_logged_at < _SHED_LOG_S:
            return
        self._shed_logged_at = now
        peers, self._shed_since = self._shed_since, {}
        self._log.warning(
            "peers send faster than this rank handles: messages over the receive budget "
            "were dropped unread (their own deadlines fail what waited on them)",
            messages=sum(peers.values()), peers=len(peers),
            worst=max(peers, key=peers.__getitem__).hex()[:16], total_dropped=self.stats.shed)

    def _release_parked(self) -> None:
        """Announcements kept for their requests' admission (parallel dispatch) that are
        due now: admitted, or out of time. On the loop's thread: they may read."""
        with self._lock:
            if not self._session.parked_count:
                return
            outs = self._session.release(self._clock.now())
        if outs:
            self._perform(outs)

    def _handle(self, identity: bytes, payload: bytes) -> None:
        try:
            message = self._codec.decode(payload, identity)
        except ProtocolError as exc:
            with self._lock:
                outs = self._session.reject(identity, exc)
        else:
            now = self._clock.now()
            if isinstance(message, ReadReadyBatch):
                if self.stats.first_ready_at is None:
                    self.stats.first_ready_at = now
                self._log.debug("announcement received", layer=message.layer_idx,
                                requests=len(message.read_reqs),
                                done=len(message.done_ext_ids))
            with self._lock:
                outs = self._session.receive(identity, message, now,
                                             wall_ms=int(self._wall() * 1000),
                                             size=len(payload))
        self._perform(outs)

    def _perform(self, outs: list[Output]) -> None:
        """Count and log first: once a reply is out, Prefill (and whoever waits on it)
        may look at this rank's stats."""
        assert self._server is not None
        self._report(outs)
        for out in outs:
            if isinstance(out, SendAck):
                frame = self._codec.encode(MetaAck(out.generation, out.layer_runs), out.peer)
                self._server.send(out.peer, frame)  # type: ignore[arg-type]
            elif isinstance(out, SendRefusal):
                frame = self._codec.encode(out.refusal, out.peer)
                self._server.send(out.peer, frame)  # type: ignore[arg-type]
            elif isinstance(out, Reply):
                frame = self._codec.encode(out.message, out.peer)
                if not self._server.send(out.peer, frame):  # type: ignore[arg-type]
                    self._log.warning("reply not delivered", layer=out.message.layer_idx)
            elif isinstance(out, Read):
                self._perform(self._read(out))
            elif isinstance(out, Forget):  # e.g. a replayed MF_META keeps no signing state
                self._codec.forget(out.peer)

    def _read(self, read: Read) -> list[Output]:
        """One batched read; a loss seen before it ended fails the layer (the check after
        the read covers the time since the previous one: the batch's start or the last
        read's end)."""
        with self._lock:
            go = self._session.begin_read(read.token)
        error = self._checks.hold_ended(read, "before the read") if go else None
        if go and error is None:
            plan = read.plan
            t0 = self._clock.now()
            try:
                self._transfer.batch_read(read.p_session, plan.local_addrs, plan.remote_addrs,
                                          plan.lengths)
            except Exception as exc:  # any failure of the read fails its layer, answered
                self.stats.reads_failed += 1
                error = str(exc) if isinstance(exc, TransferError) else (
                    f"{type(exc).__name__}: {exc}")
            else:
                end = self._clock.now()
                self.stats.last_read_end_at = end
                self.stats.read_seconds += end - t0
                add_sample(self.stats.read_latencies_ms, (end - t0) * 1e3)
                self.stats.bytes_read += plan.total_bytes
                self.stats.descriptors += plan.num_descriptors
                error = self._checks.hold_ended(read, "when the read ended")
                if error is None and plan.checks is not None:
                    error = self._checks.verify(read, plan.checks)
                if error is None and self._on_read is not None:
                    self._on_read(read.p_session, plan)
            self._apply_losses()
        with self._lock:
            return self._session.read_done(read.token, self._clock.now(), error)

    def _report(self, outs: Iterable[Output]) -> None:
        outs = list(outs)
        for out in outs if self._timeline is not rt.NO_TIMELINE else ():
            if isinstance(out, LayerDone):
                for ext in out.completed:
                    self._timeline.stamp(ext, rt.HopName.DECODE_KV_COMPLETE)
        if report_decode(outs, self.stats, self._log):
            self._progress.set()
            if self._on_progress is not None:
                self._on_progress()
