"""Prefill worker role: announce each layer of this step's completed blocks,
gate buffer reuse, tell vLLM when a finished request's blocks may be freed, and
hold a step whose preempted requests Decode may still be reading (``settle``)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rd2h.app.connector.plans import PrefillSend, StepPlan
from rd2h.app.connector.roles import ConnectorRole, TransferResults
from rd2h.app.prefill import LayerTarget, PrefillSender
from rd2h.domain.chunks import layer_index
from rd2h.domain.errors import CompletionError, LayerSendError
from rd2h.domain.protocol import ReadRequest
from rd2h.domain.topology import compute_mapping, remote_port, tcp_endpoint
from rd2h.ports.runtime import NO_TIMELINE, Clock, DeviceEvents, HopName, Logger, Timeline
from rd2h.ports.transfer import TransferEngine

Ticket = tuple[int, str]  # (announcement ticket, Decode endpoint)


@dataclass
class _Request:
    open_tickets: set[Ticket]
    final_sent: bool = False
    finished: bool = False
    error: str | None = None
    withheld: bool = False  # a later send was not announced because of ``error``
    announced: bool = False  # a layer of it was announced (timeline)
    ext: str = ""  # the id announcements carry (Decode's replies name it)
    blocks: int = 0  # main blocks of it announced so far (the held-blocks gauge)


class PrefillWorker(ConnectorRole):
    def __init__(
        self,
        *,
        sender: PrefillSender,
        events: DeviceEvents,
        p_rank: int,
        p_tp: int,
        layer_names: Mapping[int, str],
        clock: Clock,
        log: Logger,
        buffer_reuse: bool = False,
        reuse_timeout_s: float | None = None,
        settle_timeout_s: float | None = None,
        stop_timeout_s: float = 5.0,
        transport: TransferEngine | None = None,
        timeline: Timeline = NO_TIMELINE,
    ) -> None:
        self._timeline = timeline
        self._sender = sender
        # The engine exposing this rank's caches: Decode reads through it for as long
        # as this worker runs, so the worker owns it (closed at shutdown).
        self._transport = transport
        self._events = events
        self._p_rank = p_rank
        self._p_tp = p_tp
        self._layers = dict(layer_names)
        self._last_layer = max(self._layers) if self._layers else -1
        self._clock = clock
        self._log = log
        self.buffer_reuse = buffer_reuse
        self._reuse_timeout = reuse_timeout_s
        self._settle_timeout_s = settle_timeout_s
        self._stop_timeout = stop_timeout_s
        self._sends: tuple[PrefillSend, ...] = ()
        self._dispatched: set[int] = set()
        self._ticket_ids = itertools.count()
        # Per (layer announcement, endpoint): a slow Decode instance holds back only
        # the requests it reads, not those of other instances in the same layer.
        self._ticket_reqs: dict[Ticket, tuple[str, ...]] = {}
        self._requests: dict[str, _Request] = {}
        self._lock = threading.Lock()
        self.layers_announced = 0
        self.requests_failed = 0
        self.requests_skipped = 0  # Decode no longer knew them (aborted there)
        self.requests_settled = 0

    # -- the connector role's hooks
    def handle_preemptions(self, plan: StepPlan) -> None:
        if plan.preempted:
            self.settle(plan.preempted)

    def bind_connector_metadata(self, plan: StepPlan) -> None:
        self.start_step(plan.sends)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.before_layer(layer_name)

    def save_kv_layer(self, layer_name: str) -> None:
        self.layer_written(layer_name)  # also Ascend's on_kv_cache_written

    def get_transfer_results(self, finished_req_ids: Iterable[str]) -> TransferResults:
        return TransferResults(finished_sending=frozenset(self.get_finished(finished_req_ids)))

    def kv_connector_stats(self) -> dict[str, Any]:
        return {"layers_announced": self.layers_announced,
                "requests_failed": self.requests_failed,
                "requests_aborted": self.requests_skipped,
                "refused_incompatible": self._sender.stats.handshakes_refused, **self.held()}

    def held(self) -> dict[str, int]:
        """Requests (and their main blocks) this rank still holds for Decode."""
        with self._lock:
            return {"held_requests": len(self._requests),
                    "held_blocks": sum(r.blocks for r in self._requests.values())}

    @property
    def sender(self) -> PrefillSender:
        return self._sender

    # -- the rules
    def start(self) -> None:
        self._sender.start()

    # -- per step
    def start_step(self, sends: Iterable[PrefillSend]) -> None:
        """This step's sends. A request with a failed announcement gets no more: Decode
        failed it, or never read the failed part and must not complete it without that
        (it fails at its own deadline instead)."""
        self._collect_resolved()
        kept = []
        with self._lock:
            for s in sends:
                r = self._requests.setdefault(s.internal_id, _Request(set()))
                if r.error is None:
                    kept.append(s)
                    r.blocks = max(r.blocks, s.main_start + len(s.main_block_ids))
                elif not r.withheld:
                    r.withheld = True
                    self._log.warning("not announcing more of a request with a failed "
                                      "announcement", request=s.internal_id, error=r.error)
        self._sends = tuple(kept)
        self._dispatched.clear()

    def wait_for_layer_reuse(self, layer_idx: int) -> None:
        """Block until layer ``layer_idx``'s buffer may be written again (spec 11)."""
        self._sender.wait_for_layer_send(layer_idx, self.reuse_timeout_s)

    def before_layer(self, layer_name: str) -> None:
        """``wait_for_layer_load`` on Prefill: with shared buffers, the reuse gate."""
        if self.buffer_reuse:
            self.wait_for_layer_reuse(layer_index(layer_name))

    def layer_written(self, layer_name: str) -> bool:
        """The layer's KV scatter was queued: announce it (once per layer per step)."""
        idx = layer_index(layer_name)
        if idx in self._dispatched or idx not in self._layers:
            return False
        self._dispatched.add(idx)
        if not self._sends:
            return False
        targets = []
        names: dict[str, list[str]] = {}
        exts: dict[str, str] = {}
        for s in self._sends:
            m = compute_mapping(self._p_tp, s.decode.tp_size, self._p_rank)
            endpoint = tcp_endpoint(s.decode.host, remote_port(s.decode.base_port, m.d_rank))
            req = None
            if s.main_block_ids or s.indexer_block_ids:
                req = ReadRequest(s.ext_id, s.main_block_ids, s.indexer_block_ids,
                                  s.main_start, s.indexer_start)
            done = s.final and idx == self._last_layer
            if req is None and not done:
                continue
            targets.append(LayerTarget(endpoint, req, done, m.member, m.ratio, s.ext_id))
            names.setdefault(endpoint, []).append(s.internal_id)
            exts[s.internal_id] = s.ext_id
        if not targets:
            return False
        ticket = next(self._ticket_ids)
        with self._lock:
            for endpoint, rids in names.items():
                self._ticket_reqs[(ticket, endpoint)] = tuple(dict.fromkeys(rids))
                for rid in rids:
                    self._requests[rid].open_tickets.add((ticket, endpoint))
                    self._requests[rid].ext = exts[rid]
            for rids in names.values() if self._timeline is not NO_TIMELINE else ():
                for rid in rids:
                    r = self._requests[rid]
                    if not r.announced:
                        r.announced = True
                        self._timeline.stamp(rid, HopName.PREFILL_FIRST_LAYER)
            if idx == self._last_layer:
                for s in self._sends:
                    if s.final:
                        self._requests[s.internal_id].final_sent = True
                        self._timeline.stamp(s.internal_id, HopName.PREFILL_ANNOUNCED_ALL)
        try:
            self._sender.submit(idx, self._events.record(), targets, ticket=ticket)
        except LayerSendError as exc:
            for endpoint in names:
                self._resolve((ticket, endpoint), str(exc))
            raise
        self.layers_announced += 1
        return True

    # -- preemption
    def settle(self, request_ids: Iterable[str]) -> None:
        """vLLM preempted these requests and freed their blocks; this step's forward may
        write them. Return once every announcement of them was answered or failed, so
        Decode is no longer reading them (a failed one: Decode failed the request, or
        never read that part and gets no more of it, see ``start_step``). Raises
        ``CompletionError`` if the sender keeps one open past every deadline."""
        rids = tuple(dict.fromkeys(request_ids))
        timeout = self.settle_timeout_s
        started = self._clock.now()
        deadline = started + timeout
        self._collect_resolved()
        waited_on = still = self._open_tickets(rids)
        while still:
            remaining = deadline - self._clock.now()
            if remaining <= 0:
                raise CompletionError(
                    f"preempted request(s) {sorted(still)}: Decode has not answered "
                    f"{sum(still.values())} announcement(s) of their blocks within "
                    f"{timeout:g} s; vLLM freed those blocks and would "
                    f"overwrite them while Decode may still read them"
                )
            self._sender.wait_resolved(min(remaining, 1.0))
            self._collect_resolved()
            still = self._open_tickets(rids)
        with self._lock:
            failed = {rid: r.error for rid in rids
                      if (r := self._requests.get(rid)) is not None and r.error is not None}
        self.requests_settled += len(rids)
        self._log.info("preempted requests settled before their blocks are reused",
                       requests=list(rids), open_announcements=sum(waited_on.values()),
                       waited_ms=round((self._clock.now() - started) * 1000, 1),
                       failed=failed)

    @property
    def reuse_timeout_s(self) -> float:
        """How long ``wait_for_layer_reuse`` waits: the sender's gate budget (a slow but
        healthy Decode answering inside the session's deadlines never makes it raise)."""
        if self._reuse_timeout is not None:
            return self._reuse_timeout
        return self._sender.timeouts.gate_budget_s

    @property
    def settle_timeout_s(self) -> float:
        """Every announcement ends (answered or failed) within the sender's own deadlines;
        this bound (the gate budget) only catches a sender that stopped keeping them."""
        if self._settle_timeout_s is not None:
            return self._settle_timeout_s
        return self._sender.timeouts.gate_budget_s

    def _open_tickets(self, rids: Iterable[str]) -> dict[str, int]:
        with self._lock:
            return {rid: len(r.open_tickets) for rid in rids
                    if (r := self._requests.get(rid)) is not None and r.open_tickets}

    # -- completion
    def _collect_resolved(self) -> None:
        resolved, skipped = self._sender.take_outcomes()
        for ticket, endpoint, error in resolved:  # in the order the answers came
            key: Ticket = (ticket, endpoint)  # type: ignore[assignment]
            if key in skipped:
                self._skip(key, skipped.pop(key))
            self._resolve(key, error)

    def _skip(self, ticket: Ticket, exts: tuple[str, ...]) -> None:
        """Decode answered this announcement without reading these requests: it no
        longer knows them (the client went away, Decode aborted them). No more of them
        is announced; their blocks are released once vLLM finished them here."""
        gone = set(exts)
        with self._lock:
            for rid in self._ticket_reqs.get(ticket, ()):
                r = self._requests.get(rid)
                if r is None or r.ext not in gone or r.error is not None:
                    continue
                r.error = (f"decode endpoint {ticket[1]} no longer reads the request "
                           f"(aborted, or failed there)")
                self.requests_skipped += 1
                self._log.info("decode skipped an aborted request; no more of it is "
                               "announced", request=rid, endpoint=ticket[1])

    def get_finished(self, finished_req_ids: Iterable[str]) -> set[str]:
        """Requests vLLM finished whose announcements have all been answered."""
        self._collect_resolved()
        done = set()
        with self._lock:
            for rid in finished_req_ids:
                r = self._requests.get(rid)
                if r is not None:
                    r.finished = True
            for rid, r in list(self._requests.items()):
                if r.finished and not r.open_tickets:
                    done.add(rid)
                    del self._requests[rid]
                    self._timeline.stamp(rid, HopName.PREFILL_RELEASED)
        return done

    def _resolve(self, ticket: Ticket, error: str | None) -> None:
        with self._lock:
            for rid in self._ticket_reqs.pop(ticket, ()):
                r = self._requests.get(rid)
                if r is None:
                    continue
                r.open_tickets.discard(ticket)
                if error is not None and r.error is None:
                    r.error = error
                    self.requests_failed += 1
                    self._log.warning("decode did not read a request's layer",
                                      request=rid, error=error)

    def counters(self) -> dict[str, int]:
        with self._lock:
            out = {"requests": len(self._requests), "tickets": len(self._ticket_reqs)}
        out.update(self._sender.counters())
        return out

    def shutdown(self) -> None:
        self._sender.stop(self._stop_timeout)
        if self._transport is not None:
            self._transport.close()
