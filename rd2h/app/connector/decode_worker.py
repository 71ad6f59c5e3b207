"""Decode worker role: admit this step's loads into the receiver, then resolve
finished / failed requests with the TP group and report them to vLLM."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rd2h.app.connector.plans import StepPlan
from rd2h.app.connector.roles import ConnectorRole, TransferResults
from rd2h.app.decode import DecodeReceiver, DecodeStats
from rd2h.ports.runtime import NO_TIMELINE, HopName, Logger, Timeline, TpGroupExchange


class DecodeWorker(ConnectorRole):
    def __init__(
        self,
        *,
        receiver: DecodeReceiver,
        exchange: TpGroupExchange,
        log: Logger,
        exchange_timeout_s: float = 60.0,
        stop_timeout_s: float = 5.0,
        report_invalid_blocks: bool = True,
        timeline: Timeline = NO_TIMELINE,
        idle_wait_s: float = 0.0,
    ) -> None:
        self._timeline = timeline
        self._idle_wait_s = idle_wait_s
        self._idle = False
        # Block ids are unique only within one cache group: with several groups vLLM
        # cannot take block-level load errors (failed requests still fail).
        self._report_invalid = report_invalid_blocks
        self._receiver = receiver
        self._exchange = exchange
        self._log = log
        self._exchange_timeout = exchange_timeout_s
        self._stop_timeout = stop_timeout_s
        self._admitted: list[str] = []
        self._invalid: set[int] = set()
        self.requests_done = 0
        self.requests_failed = 0
        self.requests_aborted = 0

    # -- the connector role's hooks
    def bind_connector_metadata(self, plan: StepPlan) -> None:
        # Before the forward: Prefill may announce as soon as it learns the contact
        # info, and this rank must know the destinations by then.
        for load in plan.loads:
            self._receiver.admit(load.internal_id, load.main_block_ids, load.indexer_block_ids,
                                 load.group_block_ids)
            self._admitted.append(load.internal_id)
            self._timeline.stamp(load.internal_id, HopName.DECODE_WORKER_ADMITTED)
        if plan.failed_loads:
            self._receiver.fail_loads(dict(plan.failed_loads))
        self._idle = plan.idle

    def get_transfer_results(self, finished_req_ids: Iterable[str]) -> TransferResults:
        """Resolve finished / failed requests with the TP group (every rank calls it in
        the same step); a failed request's blocks go to ``get_block_ids_with_load_errors``.
        Requests vLLM finished (aborted) are released and reported received."""
        if self._idle:
            self._idle = False
            self._wait_when_idle()
        outcome = self._receiver.step(self._exchange, finished_req_ids, self._exchange_timeout)
        for rid in outcome.finished:
            self._timeline.stamp(rid, HopName.DECODE_FAILED if rid in outcome.failed
                                 else HopName.DECODE_REPORTED)
        for rid in outcome.failed:
            self._log.warning("request failed to receive its KV", request=rid,
                              reason=outcome.reasons.get(rid, "?"))
        if outcome.aborted:
            self._log.info("aborted requests released (no read can land in their blocks)",
                           requests=sorted(outcome.aborted))
        self.requests_failed += len(outcome.failed)
        self.requests_aborted += len(outcome.aborted)
        self.requests_done += len(outcome.finished) - len(outcome.failed) - len(outcome.aborted)
        if self._report_invalid:
            self._invalid |= outcome.invalid_block_ids
        return TransferResults(finished_recving=outcome.finished, failed_recving=outcome.failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def kv_connector_stats(self) -> dict[str, Any]:
        s = self._receiver.stats
        # Hand over this interval's latencies and empty the receiver's list, which
        # would otherwise grow for as long as Decode runs.
        latencies, s.read_latencies_ms = s.read_latencies_ms, []
        return {"bytes_pulled": s.bytes_read, "layers_done": s.layers_done,
                "layers_failed": s.layers_failed, "read_seconds": s.read_seconds,
                "reads_failed": s.reads_failed, "requests_done": self.requests_done,
                "requests_failed": self.requests_failed, "read_latency_ms": latencies,
                "requests_aborted": self.requests_aborted, "requests_skipped": s.skipped,
                "failed_dispatch": s.failed_fast, "failed_prefill_lost": s.peer_lost_failed,
                "failed_deadline": s.expired, "failed_incomplete": s.incomplete,
                "refused_incompatible": s.refused_incompatible,
                "refused_unauthenticated": s.refused_unauthenticated,
                "refused_peer_cap": s.refused_capped, "reads_past_hold": s.reads_past_hold,
                "kv_digest_mismatches": s.digest_mismatches,
                "kv_blocks_verified": s.blocks_verified, "control_frames_shed": s.shed,
                "announcements_parked": s.parked,
                "announcements_parked_expired": s.parked_expired}

    def start(self) -> str:
        return self._receiver.start()

    def _wait_when_idle(self) -> bool:
        """A step that computes nothing: wait up to ``idle_wait_s`` for a request to
        complete or fail on this rank, if any is in flight (True: one did). vLLM's
        engine loop would otherwise step again after 1 ms, and every step crosses to the
        worker and back: on a CPU host that spinning takes the cores Prefill computes on.
        A request that arrives meanwhile waits at most ``idle_wait_s`` to be admitted."""
        if self._idle_wait_s <= 0 or not self._receiver.in_flight():
            return False
        return self._receiver.wait_for_progress(self._idle_wait_s)

    def take_admitted(self) -> list[str]:
        """Requests admitted since the last call (reported to the scheduler)."""
        out, self._admitted = self._admitted, []
        return out

    @property
    def stats(self) -> DecodeStats:
        return self._receiver.stats

    def counters(self) -> dict[str, int]:
        return self._receiver.counters()

    def shutdown(self) -> None:
        self._receiver.stop(self._stop_timeout)
