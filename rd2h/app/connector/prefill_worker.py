"""Prefill worker role: announce each layer of this step's completed blocks,
gate buffer reuse, and tell vLLM when a finished request's blocks may be freed."""

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
from rd2h.domain.errors import LayerSendError
from rd2h.domain.protocol import ReadRequest
from rd2h.domain.topology import compute_mapping, remote_port, tcp_endpoint
from rd2h.ports.runtime import Clock, DeviceEvents, Logger
from rd2h.ports.transfer import TransferEngine

Ticket = tuple[int, str]  # (announcement ticket, Decode endpoint)


@dataclass
class _Request:
    open_tickets: set[Ticket]
    final_sent: bool = False
    finished: bool = False
    error: str | None = None


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
        reuse_timeout_s: float = 60.0,
        stop_timeout_s: float = 5.0,
        transport: TransferEngine | None = None,
    ) -> None:
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

    # -- the connector role's hooks
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
                "requests_failed": self.requests_failed}

    @property
    def sender(self) -> PrefillSender:
        return self._sender

    # -- the rules
    def start(self) -> None:
        self._sender.start()

    # -- per step
    def start_step(self, sends: Iterable[PrefillSend]) -> None:
        self._sends = tuple(sends)
        self._dispatched.clear()
        with self._lock:
            for s in self._sends:
                self._requests.setdefault(s.internal_id, _Request(set()))

    def wait_for_layer_reuse(self, layer_idx: int) -> None:
        """Block until layer ``layer_idx``'s buffer may be written again (spec 11)."""
        self._sender.wait_for_layer_send(layer_idx, self._reuse_timeout)

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
        if not targets:
            return False
        ticket = next(self._ticket_ids)
        with self._lock:
            for endpoint, rids in names.items():
                self._ticket_reqs[(ticket, endpoint)] = tuple(dict.fromkeys(rids))
                for rid in rids:
                    self._requests[rid].open_tickets.add((ticket, endpoint))
            if idx == self._last_layer:
                for s in self._sends:
                    if s.final:
                        self._requests[s.internal_id].final_sent = True
        try:
            self._sender.submit(idx, self._events.record(), targets, ticket=ticket)
        except LayerSendError as exc:
            for endpoint in names:
                self._resolve((ticket, endpoint), str(exc))
            raise
        self.layers_announced += 1
        return True

    # -- completion
    def get_finished(self, finished_req_ids: Iterable[str]) -> set[str]:
        """Requests vLLM finished whose announcements have all been answered."""
        for ticket, endpoint, error in self._sender.take_resolved():
            self._resolve((ticket, endpoint), error)  # type: ignore[arg-type]
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
