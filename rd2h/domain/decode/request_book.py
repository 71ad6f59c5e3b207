"""One Decode rank's request state from admission to reporting (spec 7.2).

Flow per worker step: ``local_report()`` -> exchange among TP ranks ->
``finish_step(all_reports, finished_by_vllm)``, which resolves this step's
completions first and cleans up the requests vLLM finished afterwards. Time is
an argument (``now``); nothing here reads a clock.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from rd2h.domain.decode.contributors import ContributorTracker, PeerContributions
from rd2h.domain.decode.orphans import DEFAULT_ORPHANS_PER_PEER, DEFAULT_ORPHANS_TOTAL, OrphanLedger
from rd2h.domain.planning.chunks import external_request_id
from rd2h.domain.planning.planning import Destination


@dataclass(frozen=True)
class RankReport:
    """One Decode TP rank's terminal and failed external ids for a step."""

    terminal: frozenset[str] = frozenset()
    failed: frozenset[str] = frozenset()


@dataclass(frozen=True)
class MergedReport:
    finished: frozenset[str]
    failed: frozenset[str]


def merge_tp_reports(reports: Collection[RankReport]) -> MergedReport:
    """Finished = intersection of terminal sets; failed = union of failed sets."""
    if not reports:
        return MergedReport(frozenset(), frozenset())
    finished = frozenset.intersection(*(r.terminal for r in reports))
    failed = frozenset().union(*(r.failed for r in reports))
    return MergedReport(finished, failed)


@dataclass(frozen=True)
class StepOutcome:
    """What a Decode worker step reports to vLLM."""

    finished: frozenset[str]
    failed: frozenset[str]
    invalid_block_ids: frozenset[int]
    reasons: Mapping[str, str] = field(default_factory=dict)
    # Among ``finished``: requests vLLM aborted while their KV was still coming, now
    # reported so that vLLM frees their blocks (no read can land in them any more).
    aborted: frozenset[str] = frozenset()


@dataclass
class _Admitted:
    internal_id: str
    destination: Destination
    admitted_at: float


class DecodeRequestBook:
    """State per request id. Ids never admitted here are *orphans*: kept for their
    admission, capped per peer and in total, and dropped by ``expire`` once stale
    (``rd2h.domain.decode.orphans``); every entry keyed by such an id exists only while the
    id is admitted or a held orphan."""

    def __init__(self, max_orphans_per_peer: int = DEFAULT_ORPHANS_PER_PEER,
                 max_orphans: int = DEFAULT_ORPHANS_TOTAL) -> None:
        self._admitted: dict[str, _Admitted] = {}
        self._int_to_ext: dict[str, str] = {}
        self.contributors = ContributorTracker()
        self._terminal: set[str] = set()
        self._failed: dict[str, str] = {}
        self._invalid_reported: set[str] = set()
        self._pending_finished: set[str] = set()
        # ext id -> internal id: vLLM finished (aborted) the request before its KV was
        # reported. vLLM 0.32 keeps such a request's blocks until the connector names it
        # in ``finished_recving``; it is reported once no read can still land in them.
        self._aborting: dict[str, str] = {}
        # Terminal here and on every rank, held back while a read may still write into
        # the request's blocks (its failure must not hand them to vLLM before that).
        self._deferred: set[str] = set()
        self.orphans = OrphanLedger(max_orphans_per_peer, max_orphans)
        self.peer_contributions = PeerContributions()
        self._now = 0.0  # the latest time seen: orphans learned without one get it

    # -- admission
    def admit(
        self,
        internal_id: str,
        main_block_ids: Sequence[int],
        indexer_block_ids: Sequence[int],
        now: float,
        group_block_ids: Sequence[Sequence[int]] = (),
    ) -> str:
        ext = external_request_id(internal_id)
        self._seen(now)
        self.orphans.discard(ext)
        self._admitted.pop(ext, None)  # kept in admission order (``next_deadline``)
        self._admitted[ext] = _Admitted(
            internal_id,
            Destination(tuple(main_block_ids), tuple(indexer_block_ids),
                        tuple(map(tuple, group_block_ids))),
            now,
        )
        self._int_to_ext[internal_id] = ext
        return ext

    def destination(self, ext_id: str) -> Destination | None:
        entry = self._admitted.get(ext_id)
        return None if entry is None else entry.destination

    @property
    def destinations(self) -> Mapping[str, Destination]:
        return _DestinationView(self._admitted)

    def is_terminal(self, ext_id: str) -> bool:
        return ext_id in self._terminal

    # -- layer outcomes
    def record_done(
        self, ext_ids: Iterable[str], member: int, ratio: int, peer: Hashable | None = None,
        now: float | None = None,
    ) -> list[str]:
        """Final-layer reports of one contributor (connection ``peer``, when known);
        returns requests now complete. Raises ``ProtocolError`` for an impossible
        member / ratio (nothing is recorded for the ids before the bad one). Reports for
        requests not admitted here are kept as orphans of ``peer`` (the admission may
        still come) while its cap allows; ``expire`` drops them once stale."""
        ext_ids = list(ext_ids)
        self._seen(now)
        if peer is not None:
            self.peer_contributions.done(peer, ext_ids)
        completed = []
        for ext in ext_ids:
            if ext in self._terminal or not self._holds(ext, peer):
                continue
            if self.contributors.report(ext, member, ratio):
                self._terminal.add(ext)
                self.contributors.discard(ext)
                self.peer_contributions.discard_request(ext)
                completed.append(ext)
        return completed

    def note_contribution(self, peer: Hashable, ext_ids: Iterable[str]) -> None:
        """``peer`` announced blocks of ``ext_ids``; admitted, unfinished ones now depend
        on it until it reports their final layer (see ``fail_peer``)."""
        self.peer_contributions.note(
            peer, (e for e in ext_ids if e in self._admitted and e not in self._terminal)
        )

    def fail_peer(self, peer: Hashable, reason: str, now: float | None = None) -> list[str]:
        """The connection ``peer`` is gone: fail the unfinished requests it was still
        contributing to (requests that never heard from it end at their deadline)."""
        live = sorted(e for e in self.peer_contributions.take_peer(peer)
                      if e not in self._terminal)
        self.record_failed(live, reason, now)
        return live

    def record_failed(
        self, ext_ids: Iterable[str], reason: str, now: float | None = None,
        peer: Hashable | None = None, *, admitted_only: bool = False,
    ) -> None:
        """Mark requests failed. Ids not admitted here are kept as orphans of ``peer``
        (the admission may still come) while its cap allows, unless ``admitted_only``;
        ``expire`` drops them once stale."""
        self._seen(now)
        for ext in ext_ids:
            if admitted_only and ext not in self._admitted:
                continue
            self._mark_failed(ext, reason, peer)

    def fail_admitted(self, internal_ids: Iterable[str], reason: str) -> list[str]:
        """The deployment knows these requests' KV will not come (e.g. the proxy's
        Prefill dispatch failed): fail those admitted here and not yet terminal."""
        exts = (self._ext_of(i) for i in internal_ids)
        failed = [e for e in exts if e in self._admitted and e not in self._terminal]
        for ext in failed:
            self._mark_failed(ext, reason, None)
        return failed

    def _mark_failed(self, ext: str, reason: str, owner: Hashable | None) -> None:
        """The one way a request becomes failed, whoever learned it first."""
        if not self._holds(ext, owner):
            return
        self._failed.setdefault(ext, reason)
        self._terminal.add(ext)
        self.contributors.discard(ext)
        self.peer_contributions.discard_request(ext)

    def _holds(self, ext: str, owner: Hashable | None) -> bool:
        """Whether state may be kept for ``ext``: admitted, or an orphan within caps."""
        return ext in self._admitted or self.orphans.add(ext, owner, self._now)

    def _seen(self, now: float | None) -> None:
        if now is not None and now > self._now:
            self._now = now

    def expire(self, now: float, timeout: float) -> list[str]:
        """Fail admitted requests still waiting for their KV ``timeout`` after admission."""
        self._seen(now)
        late = [
            ext
            for ext, entry in self._admitted.items()
            if ext not in self._terminal and entry.admitted_at + timeout <= now
        ]
        self.record_failed(late, f"no KV arrived within {timeout:g} s of admission")
        # State for ids never admitted here (e.g. a message for a request Decode already
        # aborted, or an id a peer invented) must not live forever.
        for ext in self.orphans.stale(now, timeout):
            self._forget(ext)
        return late

    def next_deadline(self, timeout: float) -> float | None:
        """When ``expire(now, timeout)`` next has something to do (None: nothing held).
        Admissions come in time order (one monotonic clock), so the first admitted
        request not yet terminal is the one due first; so is the oldest orphan."""
        first = next((e.admitted_at for ext, e in self._admitted.items()
                      if ext not in self._terminal), None)
        times = [t for t in (first, self.orphans.oldest()) if t is not None]
        return min(times) + timeout if times else None

    # -- step
    def local_report(self) -> RankReport:
        # Requests waiting only for their admission here (``_pending_finished``) were
        # already finished on every rank: re-announcing their failure would make the
        # ranks that forgot them fail them again, and they would never be cleaned.
        failed = self._failed.keys() - self._pending_finished - self._deferred
        return RankReport(frozenset(self._terminal), frozenset(failed))

    def finish_step(
        self,
        reports: Collection[RankReport],
        finished_by_vllm: Iterable[str] = (),
        now: float | None = None,
        busy: Collection[str] = (),
    ) -> StepOutcome:
        """Resolve this step. With ``now``, state about ids never admitted here (learned
        from other ranks) expires like any orphan instead of waiting for an admission
        that may never come. A request vLLM finished while still waiting for its KV
        (an abort) is forgotten at once (later announcements skip it) and reported
        finished once it is not in ``busy`` (the ext ids a read in flight may still
        write), so that vLLM frees its blocks."""
        merged = merge_tp_reports(reports)
        self._seen(now)
        for ext in merged.failed - self._failed.keys():  # another rank's failure is ours
            self._mark_failed(ext, "failed on another decode rank", None)
        invalid: set[int] = set()
        failed_internal: set[str] = set()
        reasons: dict[str, str] = {}
        for ext in self._failed:
            entry = self._admitted.get(ext)
            if entry is None or ext in self._invalid_reported or ext in busy:
                continue
            # Destination ids are int64 arrays; vLLM gets plain ints.
            invalid.update(entry.destination.block_ids())
            self._invalid_reported.add(ext)
        finished: set[str] = set()
        for ext in merged.finished | self._pending_finished | self._deferred:
            entry = self._admitted.get(ext)
            if entry is None:
                self._terminal.discard(ext)
                if self.orphans.add(ext, None, self._now):
                    self._pending_finished.add(ext)
                continue
            if ext in busy:  # reported once the read in flight has ended
                self._deferred.add(ext)
                continue
            finished.add(entry.internal_id)
            if ext in self._failed:
                failed_internal.add(entry.internal_id)
                reasons[entry.internal_id] = self._failed[ext]
            self._forget(ext)
        for internal_id in finished_by_vllm:
            ext = self._ext_of(internal_id)
            entry = self._admitted.get(ext)
            if entry is not None and entry.internal_id == internal_id:
                self._aborting[ext] = internal_id  # never reported: vLLM holds its blocks
            self._forget(ext)
        aborted = {internal for ext, internal in self._aborting.items() if ext not in busy}
        if aborted:
            self._aborting = {e: i for e, i in self._aborting.items() if i not in aborted}
            finished |= aborted
        return StepOutcome(
            frozenset(finished), frozenset(failed_internal), frozenset(invalid), reasons,
            frozenset(aborted),
        )

    def drop(self, internal_ids: Iterable[str]) -> None:
        """Forget requests the engine gave up on outside a step (aborted, or the TP group
        that would resolve them is gone)."""
        for internal_id in internal_ids:
            self._forget(self._ext_of(internal_id))

    def _ext_of(self, internal_id: str) -> str:
        return self._int_to_ext.get(internal_id, external_request_id(internal_id))

    def _forget(self, ext: str) -> None:
        entry = self._admitted.pop(ext, None)
        if entry is not None:
            self._int_to_ext.pop(entry.internal_id, None)
        self._terminal.discard(ext)
        self._failed.pop(ext, None)
        self._invalid_reported.discard(ext)
        self._pending_finished.discard(ext)
        self._deferred.discard(ext)
        self.orphans.discard(ext)
        self.contributors.discard(ext)
        self.peer_contributions.discard_request(ext)

    # -- leak accounting
    @property
    def admitted_count(self) -> int:
        return len(self._admitted)

    def counters(self) -> dict[str, int]:
        return {
            "admitted": len(self._admitted),
            "terminal": len(self._terminal),
            "failed": len(self._failed),
            "pending_finished": len(self._pending_finished),
            "aborting": len(self._aborting),
            "deferred": len(self._deferred),
            "contributors": len(self.contributors),
            "orphans": len(self.orphans),
            "peer_contributions": len(self.peer_contributions),
        }


class _DestinationView(Mapping[str, Destination]):
    def __init__(self, admitted: Mapping[str, _Admitted]) -> None:
        self._admitted = admitted

    def __getitem__(self, key: str) -> Destination:
        return self._admitted[key].destination

    def __iter__(self) -> Iterator[str]:
        return iter(self._admitted)

    def __len__(self) -> int:
        return len(self._admitted)
