"""One Decode rank's request state from admission to reporting (spec 7.2).

Flow per worker step: ``local_report()`` -> exchange among TP ranks ->
``finish_step(all_reports, finished_by_vllm)``, which resolves this step's
completions first and cleans up the requests vLLM finished afterwards. Time is
an argument (``now``); nothing here reads a clock.

A request's lifecycle here is one ``RequestPhase``, changed only through
``REQUEST_TRANSITIONS`` (``DecodeRequestBook._move``): admitted and waiting for its KV,
ended here (complete, or failed: its reason is kept), ended on every rank while not
admitted here yet, held (ended everywhere; reported once no read in flight can write
into its blocks), and forgotten. What is not a phase is data the phases use: the
admission (internal id, destination, time), a failure's reason, whether its blocks
were reported invalid, the contributors still to report, the orphan ledger's caps
and dates, and the internal ids of requests vLLM finished early (``aborting``: the
request is over, only vLLM's release of its blocks waits).
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

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


class RequestPhase(StrEnum):
    """Where a request stands in one Decode rank's book."""

    NEW = "new"  # nothing held for it (never seen, or forgotten)
    WAITING = "waiting"  # admitted here; its KV is still coming
    ENDED_HERE = "ended_here"  # complete or failed on this rank; not yet on every rank
    # Ended on every rank before its admission here (an orphan): reported once admitted.
    AWAITING_ADMISSION = "awaiting_admission"
    # Ended on every rank and admitted: reported once no read in flight can still write
    # into its blocks (a failure must not hand them to vLLM before that).
    HELD = "held"
    GONE = "gone"  # reported to vLLM, dropped, or an expired orphan: forgotten (final)


class RequestEvent(StrEnum):
    """What moves a request from one ``RequestPhase`` to another."""

    ADMIT = "admit"  # vLLM admitted it on this rank
    END = "end"  # its last contributor reported its final layer, or it failed
    ENDED_EVERYWHERE = "ended_everywhere"  # every rank ended it; not admitted here
    HOLD = "hold"  # every rank ended it, admitted here, a read in flight may still write
    FORGET = "forget"  # reported, dropped or expired


_RP, _RE = RequestPhase, RequestEvent
_EVERYWHERE = (_RP.AWAITING_ADMISSION, _RP.HELD)  # ended on every rank
_LIVE = (_RP.WAITING, _RP.ENDED_HERE, _RP.AWAITING_ADMISSION, _RP.HELD)
# The phases in which the request is over here: nothing more is read into it.
TERMINAL_PHASES = frozenset({_RP.ENDED_HERE, _RP.AWAITING_ADMISSION, _RP.HELD})
REQUEST_TRANSITIONS: Mapping[tuple[RequestPhase, RequestEvent], RequestPhase] = {
    (_RP.NEW, _RE.ADMIT): _RP.WAITING,
    # Admitted again, or after it ended: the admission is recorded, the phase stays.
    **{(phase, _RE.ADMIT): phase for phase in _LIVE},
    (_RP.NEW, _RE.END): _RP.ENDED_HERE,  # an orphan: ended before its admission here
    (_RP.WAITING, _RE.END): _RP.ENDED_HERE,
    # A failure learned after it ended (e.g. on another rank): its reason is kept.
    **{(phase, _RE.END): phase for phase in TERMINAL_PHASES},
    **{(phase, _RE.ENDED_EVERYWHERE): _RP.AWAITING_ADMISSION
       for phase in (_RP.NEW, _RP.ENDED_HERE, _RP.AWAITING_ADMISSION)},
    **{(phase, _RE.HOLD): _RP.HELD for phase in _LIVE},
    **{(phase, _RE.FORGET): _RP.GONE for phase in _LIVE},
}


class RequestTransitionError(ValueError):
    """A move ``REQUEST_TRANSITIONS`` does not allow (a bug in the book)."""


def next_phase(phase: RequestPhase, event: RequestEvent, ext_id: str = "") -> RequestPhase:
    """The phase ``event`` moves ``phase`` to; ``RequestTransitionError`` when the table
    has no such move."""
    new = REQUEST_TRANSITIONS.get((phase, event))
    if new is None:
        raise RequestTransitionError(f"request {ext_id!r} {phase.value}: no transition on "
                                     f"{event.value}")
    return new


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
        # ext id -> its phase (absent: ``NEW``); changed only by ``_move``.
        self._phase: dict[str, RequestPhase] = {}
        self._admitted: dict[str, _Admitted] = {}
        self._int_to_ext: dict[str, str] = {}
        self.contributors = ContributorTracker()
        self._failed: dict[str, str] = {}  # ext id -> why it failed (first reason)
        self._invalid_reported: set[str] = set()  # failed, its blocks reported invalid
        # ext id -> internal id: vLLM finished (aborted) the request before its KV was
        # reported. vLLM 0.32 keeps such a request's blocks until the connector names it
        # in ``finished_recving``; it is reported once no read can still land in them.
        self._aborting: dict[str, str] = {}
        self.orphans = OrphanLedger(max_orphans_per_peer, max_orphans)
        self.peer_contributions = PeerContributions()
        self._now = 0.0  # the latest time seen: orphans learned without one get it

    # -- the lifecycle
    def phase(self, ext_id: str) -> RequestPhase:
        return self._phase.get(ext_id, RequestPhase.NEW)

    def _move(self, ext: str, event: RequestEvent) -> RequestPhase:
        """The one way a request's phase changes: by ``REQUEST_TRANSITIONS``."""
        new = next_phase(self._phase.get(ext, RequestPhase.NEW), event, ext)
        if new is RequestPhase.GONE:
            del self._phase[ext]
        else:
            self._phase[ext] = new
        return new

    def _in(self, *phases: RequestPhase) -> list[str]:
        return [ext for ext, phase in self._phase.items() if phase in phases]

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
        self._move(ext, RequestEvent.ADMIT)
        return ext

    def destination(self, ext_id: str) -> Destination | None:
        entry = self._admitted.get(ext_id)
        return None if entry is None else entry.destination

    @property
    def destinations(self) -> Mapping[str, Destination]:
        return _DestinationView(self._admitted)

    def is_terminal(self, ext_id: str) -> bool:
        """Over here (ended, on this rank or every rank): nothing more is read into it."""
        return self._phase.get(ext_id) in TERMINAL_PHASES

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
            if self.is_terminal(ext) or not self._holds(ext, peer):
                continue
            if self.contributors.report(ext, member, ratio):
                self._move(ext, RequestEvent.END)
                self.contributors.discard(ext)
                self.peer_contributions.discard_request(ext)
                completed.append(ext)
        return completed

    def note_contribution(self, peer: Hashable, ext_ids: Iterable[str]) -> None:
        """``peer`` announced blocks of ``ext_ids``; admitted, unfinished ones now depend
        on it until it reports their final layer (see ``fail_peer``)."""
        self.peer_contributions.note(
            peer, (e for e in ext_ids if self._phase.get(e) is RequestPhase.WAITING)
        )

    def fail_peer(self, peer: Hashable, reason: str, now: float | None = None) -> list[str]:
        """The connection ``peer`` is gone: fail the unfinished requests it was still
        contributing to (requests that never heard from it end at their deadline)."""
        live = sorted(e for e in self.peer_contributions.take_peer(peer)
                      if not self.is_terminal(e))
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
        failed = [e for e in exts if self._phase.get(e) is RequestPhase.WAITING]
        for ext in failed:
            self._mark_failed(ext, reason, None)
        return failed

    def _mark_failed(self, ext: str, reason: str, owner: Hashable | None) -> None:
        """The one way a request becomes failed, whoever learned it first."""
        if not self._holds(ext, owner):
            return
        self._failed.setdefault(ext, reason)
        self._move(ext, RequestEvent.END)
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
            if self._phase.get(ext) is RequestPhase.WAITING
            and entry.admitted_at + timeout <= now
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
                      if self._phase.get(ext) is RequestPhase.WAITING), None)
        times = [t for t in (first, self.orphans.oldest()) if t is not None]
        return min(times) + timeout if times else None

    # -- step
    def local_report(self) -> RankReport:
        # Requests ended on every rank already (awaiting their admission here, or held):
        # re-announcing their failure would make the ranks that forgot them fail them
        # again, and they would never be cleaned.
        terminal = self._in(RequestPhase.ENDED_HERE, RequestPhase.HELD)
        failed = [e for e in self._failed if self._phase.get(e) not in _EVERYWHERE]
        return RankReport(frozenset(terminal), frozenset(failed))

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
        for ext in merged.finished.union(self._in(*_EVERYWHERE)):
            entry = self._admitted.get(ext)
            if entry is None:  # kept (capped, dated) until its admission comes
                if self.orphans.add(ext, None, self._now):
                    self._move(ext, RequestEvent.ENDED_EVERYWHERE)
                elif ext in self._phase:
                    self._forget(ext)
                continue
            if ext in busy:  # reported once the read in flight has ended
                self._move(ext, RequestEvent.HOLD)
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
        if ext in self._phase:
            self._move(ext, RequestEvent.FORGET)
        self._failed.pop(ext, None)
        self._invalid_reported.discard(ext)
        self.orphans.discard(ext)
        self.contributors.discard(ext)
        self.peer_contributions.discard_request(ext)

    # -- leak accounting
    @property
    def admitted_count(self) -> int:
        return len(self._admitted)

    def counters(self) -> dict[str, int]:
        phases = list(self._phase.values())
        return {
            "admitted": len(self._admitted),
            "terminal": phases.count(RequestPhase.ENDED_HERE) + phases.count(RequestPhase.HELD),
            "failed": len(self._failed),
            "pending_finished": phases.count(RequestPhase.AWAITING_ADMISSION),
            "aborting": len(self._aborting),
            "deferred": phases.count(RequestPhase.HELD),
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
