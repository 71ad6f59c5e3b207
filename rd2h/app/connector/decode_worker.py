"""Decode worker role: admit this step's loads into the receiver, then resolve
finished / failed requests with the TP group and report them to vLLM."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from rd2h.app.connector.plans import DecodeLoad
from rd2h.app.decode import DecodeReceiver, DecodeStats
from rd2h.ports.runtime import Logger, TpGroupExchange


@dataclass(frozen=True)
class DecodeResults:
    finished: frozenset[str]
    failed: frozenset[str]
    invalid_block_ids: frozenset[int]


class DecodeWorker:
    def __init__(
        self,
        *,
        receiver: DecodeReceiver,
        exchange: TpGroupExchange,
        log: Logger,
        exchange_timeout_s: float = 60.0,
        stop_timeout_s: float = 5.0,
    ) -> None:
        self._receiver = receiver
        self._exchange = exchange
        self._log = log
        self._exchange_timeout = exchange_timeout_s
        self._stop_timeout = stop_timeout_s
        self._admitted: list[str] = []
        self._invalid: set[int] = set()
        self.requests_done = 0
        self.requests_failed = 0

    def start(self) -> str:
        return self._receiver.start()

    def start_step(self, loads: Iterable[DecodeLoad]) -> None:
        for load in loads:
            self._receiver.admit(load.internal_id, load.main_block_ids, load.indexer_block_ids)
            self._admitted.append(load.internal_id)

    def take_admitted(self) -> list[str]:
        """Requests admitted since the last call (reported to the scheduler)."""
        out, self._admitted = self._admitted, []
        return out

    def get_finished(self, finished_by_vllm: Iterable[str]) -> DecodeResults:
        outcome = self._receiver.step(self._exchange, finished_by_vllm, self._exchange_timeout)
        for rid in outcome.failed:
            self._log.warning("request failed to receive its KV", request=rid,
                              reason=outcome.reasons.get(rid, "?"))
        self.requests_failed += len(outcome.failed)
        self.requests_done += len(outcome.finished) - len(outcome.failed)
        return DecodeResults(outcome.finished, outcome.failed, outcome.invalid_block_ids)

    @property
    def stats(self) -> DecodeStats:
        return self._receiver.stats

    def counters(self) -> dict[str, int]:
        return self._receiver.counters()

    def shutdown(self) -> None:
        self._receiver.stop(self._stop_timeout)
