"""Decode receiver: the ROUTER loop that validates, plans, reads and acknowledges.

Per READ_READY_BATCH it answers exactly one READ_DONE or READ_FAILED, also when
this rank owns none of the blocks. A malformed or hostile message is answered
READ_FAILED (when its layer can be named) or dropped and logged; it never stops
the loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from rd2h.domain.completion import DecodeRequestBook, StepOutcome
from rd2h.domain.errors import (
    AuthenticationError,
    LayoutMismatch,
    PlanningError,
    ProtocolError,
    TransferError,
    UnknownMessageType,
)
from rd2h.domain.layout import DestinationLayout, SourceLayout
from rd2h.domain.planning import ReadPlan, plan_reads
from rd2h.domain.protocol import MfMeta, ReadDone, ReadFailed, ReadReadyBatch, clip
from rd2h.ports.codec import WireCodec
from rd2h.ports.control import ControlServer
from rd2h.ports.runtime import Clock, Logger, TpGroupExchange
from rd2h.ports.transfer import TransferEngine


@dataclass
class _Peer:
    session: str
    layers: dict[str, SourceLayout | LayoutMismatch]


@dataclass
class DecodeStats:
    layers_done: int = 0
    layers_failed: int = 0
    reads_failed: int = 0
    bytes_read: int = 0
    descriptors: int = 0
    read_seconds: float = 0.0
    handle_seconds: float = 0.0
    malformed: int = 0
    auth_refused: int = 0
    first_ready_at: float | None = None
    last_read_end_at: float | None = None
    read_latencies_ms: list[float] = field(default_factory=list)


class DecodeReceiver:
    """One Decode TP rank's receive loop and request book.

    ``on_read`` (optional) sees every successful read as
    ``(p_session, plan)``; the demo uses it to replay the same descriptors
    on the bare transport.
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
        clock: Clock,
        log: Logger,
        request_timeout_s: float = 120.0,
        poll_interval_s: float = 0.05,
        on_read: Callable[[str, ReadPlan], None] | None = None,
        main_shared: bool = True,
        start_timeout_s: float = 10.0,
        stop_timeout_s: float = 5.0,
    ) -> None:
        self._server_factory = server_factory
        self._codec = codec
        self._transfer = transfer
        self._destinations = dict(destinations)
        self.d_rank = d_rank
        self.d_tp = d_tp
        self._clock = clock
        self._log = log
        self._request_timeout = request_timeout_s
        self._poll = poll_interval_s
        self._start_timeout = start_timeout_s
        self._stop_timeout = stop_timeout_s
        self._started = threading.Event()
        self._on_read = on_read
        # True: one main pool shared by the Decode TP ranks, each reads its share.
        # False: every rank has its own main cache and reads all main blocks.
        self.main_shared = main_shared
        self._peers: dict[bytes, _Peer] = {}
        self._book = DecodeRequestBook()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._progress = threading.Event()
        self._thread: threading.Thread | None = None
        self._server: ControlServer | None = None
        self.stats = DecodeStats()

    # ------------------------------------------------------------ lifecycle
    def start(self) -> str:
        """Bind and start the loop; a bind failure raises here (no thread started)."""
        if self._thread is not None:
            raise RuntimeError("decode receiver already started")
        self._server = self._server_factory()
        self._thread = threading.Thread(
            target=self._run, name=f"rd2h-decode-{self.d_rank}", daemon=True
        )
        self._thread.start()
        if not self._started.wait(self._start_timeout):
            self._stop.set()
            raise TimeoutError(
                f"decode receive loop did not start within {self._start_timeout:g} s"
            )
        self._log.info("decode receiver listening", endpoint=self._server.endpoint)
        return self._server.endpoint

    def stop(self, timeout: float | None = None) -> bool:
        """Stop the loop; True if it ended within ``timeout`` (default: the configured
        stop deadline)."""
        timeout = self._stop_timeout if timeout is None else timeout
        self._stop.set()
        ended = True
        if self._thread is not None:
            self._thread.join(timeout)
            ended = not self._thread.is_alive()
        if ended and self._server is not None:
            self._server.close()
        return ended

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------ requests
    def admit(self, internal_id: str, main_block_ids: Iterable[int],
              indexer_block_ids: Iterable[int]) -> str:
        with self._lock:
            return self._book.admit(
                internal_id, list(main_block_ids), list(indexer_block_ids), self._clock.now()
            )

    def step(
        self,
        exchange: TpGroupExchange,
        finished_by_vllm: Iterable[str] = (),
        timeout: float = 30.0,
    ) -> StepOutcome:
        """One worker step: expire late requests, exchange terminal sets, resolve."""
        self.expire()
        with self._lock:
            report = self._book.local_report()
        reports = exchange.all_gather(report, timeout)
        with self._lock:
            return self._book.finish_step(reports, finished_by_vllm, now=self._clock.now())

    def expire(self) -> list[str]:
        """Fail admitted requests past the request deadline and drop stale state of
        requests never admitted here; ``step`` does this first. Callable between steps
        (e.g. when the TP group is gone); returns the requests that just failed."""
        with self._lock:
            late = self._book.expire(self._clock.now(), self._request_timeout)
        if late:
            self._progress.set()
            self._log.warning("requests timed out waiting for KV", requests=late)
        return late

    def abandon(self, internal_ids: Iterable[str]) -> None:
        """Drop the state of requests given up on outside a step (e.g. the TP exchange
        failed, so no step can resolve them any more)."""
        with self._lock:
            self._book.drop(internal_ids)

    def wait_for_progress(self, timeout: float) -> bool:
        """Block until a request reached a terminal state on this rank since the last
        call (or ``timeout`` passed); lets a worker loop step when there is news."""
        happened = self._progress.wait(timeout)
        self._progress.clear()
        return happened

    def counters(self) -> dict[str, int]:
        with self._lock:
            out = self._book.counters()
        out["peers"] = len(self._peers)
        return out

    # ------------------------------------------------------------ loop
    def _run(self) -> None:
        assert self._server is not None
        self._started.set()
        while not self._stop.is_set():
            try:
                item = self._server.recv(self._poll)
                self._check_peers()
            except Exception as exc:  # socket closed under us or a zmq error
                if self._stop.is_set():
                    break
                self._log.error("control socket receive failed", error=repr(exc))
                time.sleep(self._poll)
                continue
            if item is None:
                continue
            identity, payload = item
            t0 = time.perf_counter()
            try:
                self._handle(identity, payload)
            except Exception as exc:  # never let one message kill the loop
                self.stats.malformed += 1
                self._log.error("message handling failed", error=repr(exc))
            self.stats.handle_seconds += time.perf_counter() - t0

    def _check_peers(self) -> set[bytes]:
        """Apply connection losses the control server saw: forget the peer's metadata and
        fail the unfinished requests it was contributing to. Returns the lost peers."""
        assert self._server is not None
        lost = set(self._server.disconnected())
        for identity in lost:
            peer = self._peers.pop(identity, None)
            session = peer.session if peer is not None else "?"
            with self._lock:
                failed = self._book.fail_peer(
                    identity,
                    f"prefill peer {session} disconnected before announcing the final layer",
                    self._clock.now(),
                )
            if failed:
                self._progress.set()
                self._log.warning("prefill peer lost; failing its requests", session=session,
                                  requests=failed)
            else:
                self._log.info("prefill peer disconnected", session=session)
        return lost

    def _reply(self, identity: bytes, message: ReadDone | ReadFailed) -> None:
        if not self._server or not self._server.send(identity, self._codec.encode(message)):
            self._log.warning("reply not delivered", layer=message.layer_idx)

    def _handle(self, identity: bytes, payload: bytes) -> None:
        try:
            message = self._codec.decode(payload)
        except UnknownMessageType as exc:
            self._log.warning("ignoring unknown message type", tag=clip(repr(exc.tag), 80))
            return
        except AuthenticationError as exc:
            # Refused before anything in it is used: no metadata stored, no ACK, no read,
            # no request failed. A ready message still gets its READ_FAILED.
            self.stats.auth_refused += 1
            self._log.error("refusing unauthenticated control message", layer=exc.layer_idx,
                            error=exc.detail)
            if exc.layer_idx is not None:
                self._reply(identity, ReadFailed(exc.layer_idx, f"authentication failed: "
                                                 f"{exc.detail}"))
            return
        except ProtocolError as exc:
            self.stats.malformed += 1
            detail = clip(exc.detail)
            if exc.layer_idx is None:
                self._log.warning("dropping malformed message", error=detail)
                return
            self._log.warning("malformed ready message", layer=exc.layer_idx, error=detail)
            self._reply(identity, ReadFailed(exc.layer_idx, f"malformed message: {detail}"))
            return
        if isinstance(message, MfMeta):
            self._on_meta(identity, message)
        elif isinstance(message, ReadReadyBatch):
            self._on_ready(identity, message)
        else:
            self._log.warning("ignoring unexpected message", kind=type(message).__name__)

    def _on_meta(self, identity: bytes, meta: MfMeta) -> None:
        layers: dict[str, SourceLayout | LayoutMismatch] = {}
        for name, lm in meta.layers.items():
            if name not in self._destinations:  # never read: not kept (bounds peer state)
                continue
            try:
                layers[name] = SourceLayout.from_metadata(name, lm)
            except LayoutMismatch as exc:
                layers[name] = exc
        self._peers[identity] = _Peer(meta.p_session, layers)
        self._server.send(identity, self._codec.encode_ack())  # type: ignore[union-attr]
        self._log.info("peer metadata stored", session=meta.p_session, layers=len(layers))

    def _fail(self, identity: bytes, batch: ReadReadyBatch, reason: str) -> None:
        reason = clip(reason)  # names and ids in it come from the peer
        with self._lock:
            self._book.record_failed(batch.named_ext_ids, reason, self._clock.now())
        self.stats.layers_failed += 1
        self._progress.set()
        self._log.warning("layer read failed", layer=batch.layer_idx, error=reason)
        self._reply(identity, ReadFailed(batch.layer_idx, reason))

    def _on_ready(self, identity: bytes, batch: ReadReadyBatch) -> None:
        if self.stats.first_ready_at is None:
            self.stats.first_ready_at = self._clock.now()
        peer = self._peers.get(identity)
        if peer is None:
            self._fail(identity, batch, "READ_READY_BATCH before MF_META on this connection")
            return
        src = peer.layers.get(batch.layer_name)
        dst = self._destinations.get(batch.layer_name)
        if src is None or dst is None:
            side = "decode destinations" if dst is None else "prefill metadata"
            self._fail(identity, batch, f"layer {batch.layer_name!r} is unknown to {side}")
            return
        if isinstance(src, LayoutMismatch):
            self._fail(identity, batch, str(src))
            return
        with self._lock:
            dests = {
                r.ext_req_id: d
                for r in batch.read_reqs
                if (d := self._book.destination(r.ext_req_id)) is not None
            }
        try:
            plan = plan_reads(
                batch, src, dst, dests, d_rank=self.d_rank, d_tp=self.d_tp,
                main_shared=self.main_shared,
            )
        except (LayoutMismatch, PlanningError) as exc:
            self._fail(identity, batch, str(exc))
            return
        except Exception as exc:  # a planner bug must still answer, or P waits it out
            self._log.error("read planning failed unexpectedly", layer=batch.layer_idx,
                            error=repr(exc))
            self._fail(identity, batch, f"cannot plan the layer: {type(exc).__name__}: {exc}")
            return
        with self._lock:  # these requests now depend on this peer until its final layer
            self._book.note_contribution(identity, (r.ext_req_id for r in batch.read_reqs))
        if plan.num_descriptors:
            if identity in self._check_peers():
                self._fail(identity, batch, "prefill peer disconnected before the read")
                return
            t0 = time.perf_counter()
            try:
                self._transfer.batch_read(
                    peer.session, plan.local_addrs, plan.remote_addrs, plan.lengths
                )
            except TransferError as exc:
                self.stats.reads_failed += 1
                self._fail(identity, batch, f"read failed: {exc}")
                return
            # A peer that vanished (or reset the connection after its acknowledgement
            # deadline) during the read may have reused the source: do not trust it.
            if identity in self._check_peers():
                self._fail(identity, batch, "prefill peer disconnected during the read")
                return
            dt = time.perf_counter() - t0
            self.stats.last_read_end_at = self._clock.now()
            self.stats.read_seconds += dt
            self.stats.read_latencies_ms.append(dt * 1e3)
            self.stats.bytes_read += plan.total_bytes
            self.stats.descriptors += plan.num_descriptors
            if self._on_read is not None:
                self._on_read(peer.session, plan)
        try:
            with self._lock:
                completed = self._book.record_done(
                    batch.done_ext_ids, batch.group_member_idx, batch.tp_ratio, peer=identity
                )
        except ProtocolError as exc:
            self._fail(identity, batch, exc.detail)
            return
        self.stats.layers_done += 1
        self._reply(identity, ReadDone(batch.layer_idx))
        if completed:
            self._progress.set()
            self._log.debug("requests complete on this rank", layer=batch.layer_idx,
                            requests=completed)
