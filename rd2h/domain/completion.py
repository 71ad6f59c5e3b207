"""Completion rules (spec 7): Prefill storage-slot gates, Decode request completion.

Both are plain state machines. Time is passed in as ``now`` (seconds, any
monotonic origin); nothing here reads a clock, sleeps or blocks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from rd2h.domain.chunks import external_request_id
from rd2h.domain.errors import CompletionError, ProtocolError
from rd2h.domain.planning import Destination

SlotKey = tuple[str, tuple[int, ...]]


# ====================================================================== Prefill


@dataclass(frozen=True)
class GateState:
    """Whether a layer's storage may be reused, and why not if it may not."""

    open: bool
    error: str | None = None
    waiting_on: tuple[Hashable, ...] = ()


@dataclass(frozen=True)
class ExpiredLayer:
    layer_idx: int
    endpoints: tuple[Hashable, ...]


class StorageSlotGates:
    """One gate per physical storage slot, keyed by storage addresses (spec 7.1).

    Main and indexer slots are independent. Announcing a layer to at least one
    endpoint closes its slots; they open when every endpoint sent to has replied
    (or the layer failed). ``state(layer)`` is open only when every slot of the
    layer is open, whichever logical layer closed it.
    """

    def __init__(self) -> None:
        self._slots_of_layer: dict[int, tuple[SlotKey, ...]] = {}
        self._closers: dict[SlotKey, set[int]] = {}
        self._pending: dict[int, Counter[Hashable]] = {}
        self._deadline: dict[int, float] = {}
        self._errors: dict[int, str] = {}
        # Bumped whenever a layer's gates are released: an announcement queued before the
        # release (e.g. before its deadline expired) is stale and must not be sent.
        self._epoch: dict[int, int] = {}

    # -- set-up
    def register_layer(
        self,
        layer_idx: int,
        main_key: Sequence[int],
        indexer_key: Sequence[int] | None = None,
    ) -> None:
        slots: list[SlotKey] = []
        if main_key:
            slots.append(("main", tuple(main_key)))
        if indexer_key:
            slots.append(("indexer", tuple(indexer_key)))
        if not slots:
            raise CompletionError(f"layer {layer_idx} has no storage to gate")
        self._slots_of_layer[layer_idx] = tuple(slots)

    def slots_of(self, layer_idx: int) -> tuple[SlotKey, ...]:
        try:
            return self._slots_of_layer[layer_idx]
        except KeyError:
            raise CompletionError(f"layer {layer_idx} has no storage slot mapping") from None

    # -- transitions
    def announce(
        self, layer_idx: int, endpoints: Iterable[Hashable], *, deadline: float | None = None
    ) -> bool:
        """Record that the layer was announced to ``endpoints``; True if its gates closed."""
        slots = self.slots_of(layer_idx)
        self._errors.pop(layer_idx, None)
        targets = Counter(endpoints)
        if not targets:
            return False
        self._pending.setdefault(layer_idx, Counter()).update(targets)
        for slot in slots:
            self._closers.setdefault(slot, set()).add(layer_idx)
        if deadline is not None:
            self._deadline[layer_idx] = min(deadline, self._deadline.get(layer_idx, deadline))
        return True

    def acknowledge(self, layer_idx: int, endpoint: Hashable, error: str | None = None) -> bool:
        """Count one reply; True when it completed the layer. Stray replies are ignored."""
        pending = self._pending.get(layer_idx)
        if not pending or pending[endpoint] <= 0:
            return False
        if error is not None:
            self._errors[layer_idx] = error
        pending[endpoint] -= 1
        if pending[endpoint] <= 0:
            del pending[endpoint]
        if pending:
            return False
        self._release(layer_idx)
        return True

    def fail_layer(self, layer_idx: int, error: str) -> None:
        """Fail the layer and open its gates so compute raises instead of deadlocking."""
        self._errors[layer_idx] = error
        self._release(layer_idx)

    def fail_all(self, error: str) -> list[int]:
        """Fail every pending layer (the sender is gone); return the layers failed."""
        layers = sorted(self._pending)
        for layer_idx in layers:
            self.fail_layer(layer_idx, error)
        return layers

    def fail_endpoint(self, endpoint: Hashable, error: str) -> list[int]:
        """The connection to ``endpoint`` is gone: no reply from it will come. Fail every
        layer still waiting on it (with ``error``); return those layers. A layer still
        waiting on other endpoints as well keeps its gates closed for them."""
        layers = sorted(lyr for lyr, pending in self._pending.items() if pending[endpoint] > 0)
        for layer_idx in layers:
            pending = self._pending[layer_idx]
            del pending[endpoint]
            self._errors[layer_idx] = error
            if not pending:
                self._release(layer_idx)
        return layers

    def expire(self, now: float) -> list[ExpiredLayer]:
        """Fail layers whose acknowledgement deadline has passed."""
        expired = []
        for layer_idx, deadline in sorted(self._deadline.items()):
            if deadline <= now:
                waiting = tuple(sorted(self._pending.get(layer_idx, ()), key=str))
                expired.append(ExpiredLayer(layer_idx, waiting))
                names = ", ".join(str(e) for e in waiting) or "?"
                self.fail_layer(
                    layer_idx, f"layer {layer_idx}: no acknowledgement from {names} in time"
                )
        return expired

    def _release(self, layer_idx: int) -> None:
        self._epoch[layer_idx] = self._epoch.get(layer_idx, 0) + 1
        self._pending.pop(layer_idx, None)
        self._deadline.pop(layer_idx, None)
        for slot in self._slots_of_layer.get(layer_idx, ()):
            closers = self._closers.get(slot)
            if closers is not None:
                closers.discard(layer_idx)
                if not closers:
                    del self._closers[slot]

    # -- queries
    def state(self, layer_idx: int) -> GateState:
        slots = self.slots_of(layer_idx)
        error = self._errors.get(layer_idx)
        blockers = sorted({lyr for s in slots for lyr in self._closers.get(s, ())})
        waiting = tuple(
            ep for lyr in blockers for ep in sorted(self._pending.get(lyr, ()), key=str)
        )
        return GateState(open=not blockers, error=error, waiting_on=waiting)

    def next_deadline(self) -> float | None:
        return min(self._deadline.values(), default=None)

    def epoch(self, layer_idx: int) -> int:
        """How many times the layer's gates were released; see ``_epoch``."""
        return self._epoch.get(layer_idx, 0)

    def is_pending(self, layer_idx: int, endpoint: Hashable) -> bool:
        pending = self._pending.get(layer_idx)
        return bool(pending) and pending[endpoint] > 0

    @property
    def pending_layers(self) -> tuple[int, ...]:
        return tuple(sorted(self._pending))

    @property
    def closed_slots(self) -> int:
        return len(self._closers)


# ====================================================================== Decode


class ContributorTracker:
    """Which contributor members reported a request's final layer (spec 7.2)."""

    def __init__(self) -> None:
        self._members: dict[str, set[int]] = {}
        self._ratio: dict[str, int] = {}

    def report(self, ext_id: str, member: int, ratio: int) -> bool:
        """Record member's final-layer report; True exactly once, when the set is full."""
        ratio = max(1, ratio)
        if not 0 <= member < ratio:
            raise ProtocolError(f"member {member} is outside a group of ratio {ratio}")
        expected = self._ratio.setdefault(ext_id, ratio)
        if expected != ratio:
            raise ProtocolError(
                f"request {ext_id!r}: contributor ratio changed from {expected} to {ratio}"
            )
        members = self._members.setdefault(ext_id, set())
        if member in members:
            return False
        members.add(member)
        return len(members) == expected

    def is_complete(self, ext_id: str) -> bool:
        return len(self._members.get(ext_id, ())) >= self._ratio.get(ext_id, 1 << 30)

    def discard(self, ext_id: str) -> None:
        self._members.pop(ext_id, None)
        self._ratio.pop(ext_id, None)

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, ext_id: object) -> bool:
        return ext_id in self._members


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


class PeerContributions:
    """Which unfinished requests each Prefill connection ("peer") has announced blocks
    of and not yet reported final, so that a peer that disappears fails exactly the
    requests it was still contributing to (liveness). Pure bookkeeping."""

    def __init__(self) -> None:
        self._by_peer: dict[Hashable, set[str]] = {}
        self._by_request: dict[str, set[Hashable]] = {}

    def note(self, peer: Hashable, ext_ids: Iterable[str]) -> None:
        for ext in ext_ids:
            self._by_peer.setdefault(peer, set()).add(ext)
            self._by_request.setdefault(ext, set()).add(peer)

    def done(self, peer: Hashable, ext_ids: Iterable[str]) -> None:
        """``peer`` announced the final layer of ``ext_ids``: its part is complete."""
        mine = self._by_peer.get(peer)
        if not mine:
            return
        for ext in ext_ids:
            if ext in mine:
                mine.discard(ext)
                self._drop_link(ext, peer)
        if not mine:
            del self._by_peer[peer]

    def take_peer(self, peer: Hashable) -> set[str]:
        """Forget ``peer``; the requests it was still contributing to."""
        mine = self._by_peer.pop(peer, set())
        for ext in mine:
            self._drop_link(ext, peer)
        return mine

    def discard_request(self, ext: str) -> None:
        for peer in self._by_request.pop(ext, ()):
            mine = self._by_peer.get(peer)
            if mine is not None:
                mine.discard(ext)
                if not mine:
                    del self._by_peer[peer]

    def _drop_link(self, ext: str, peer: Hashable) -> None:
        peers = self._by_request.get(ext)
        if peers is not None:
            peers.discard(peer)
            if not peers:
                del self._by_request[ext]

    @property
    def peers(self) -> int:
        return len(self._by_peer)

    def __len__(self) -> int:
        """(peer, request) pairs held."""
        return sum(len(v) for v in self._by_peer.values())


@dataclass
class _Admitted:
    internal_id: str
    destination: Destination
    admitted_at: float


class DecodeRequestBook:
    """One Decode rank's request state from admission to reporting (spec 7.2).

    Flow per worker step: ``local_report()`` -> exchange among TP ranks ->
    ``finish_step(all_reports, finished_by_vllm)``, which resolves this step's
    completions first and cleans up the requests vLLM finished afterwards.
    """

    def __init__(self) -> None:
        self._admitted: dict[str, _Admitted] = {}
        self._int_to_ext: dict[str, str] = {}
        self.contributors = ContributorTracker()
        self._terminal: set[str] = set()
        self._failed: dict[str, str] = {}
        self._invalid_reported: set[str] = set()
        self._pending_finished: set[str] = set()
        self._orphan_since: dict[str, float] = {}
        self.peer_contributions = PeerContributions()

    # -- admission
    def admit(
        self,
        internal_id: str,
        main_block_ids: Sequence[int],
        indexer_block_ids: Sequence[int],
        now: float,
    ) -> str:
        ext = external_request_id(internal_id)
        self._admitted[ext] = _Admitted(
            internal_id, Destination(tuple(main_block_ids), tuple(indexer_block_ids)), now
        )
        self._int_to_ext[internal_id] = ext
        return ext

    def destination(self, ext_id: str) -> Destination | None:
        entry = self._admitted.get(ext_id)
        return None if entry is None else entry.destination

    @property
    def destinations(self) -> Mapping[str, Destination]:
        return _DestinationView(self._admitted)

    # -- layer outcomes
    def record_done(
        self, ext_ids: Iterable[str], member: int, ratio: int, peer: Hashable | None = None
    ) -> list[str]:
        """Final-layer reports of one contributor (connection ``peer``, when known);
        returns requests now complete."""
        ext_ids = list(ext_ids)
        if peer is not None:
            self.peer_contributions.done(peer, ext_ids)
        completed = []
        for ext in ext_ids:
            if ext in self._terminal:
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
        self, ext_ids: Iterable[str], reason: str, now: float | None = None
    ) -> None:
        """Mark requests failed. Ids not admitted here are kept (the admission may still
        come) and, when ``now`` is given, dropped by ``expire`` once they are stale."""
        for ext in ext_ids:
            self._failed.setdefault(ext, reason)
            self._terminal.add(ext)
            self.contributors.discard(ext)
            self.peer_contributions.discard_request(ext)
            if now is not None and ext not in self._admitted:
                self._orphan_since.setdefault(ext, now)

    def expire(self, now: float, timeout: float) -> list[str]:
        """Fail admitted requests still waiting for their KV ``timeout`` after admission."""
        late = [
            ext
            for ext, entry in self._admitted.items()
            if ext not in self._terminal and now - entry.admitted_at >= timeout
        ]
        self.record_failed(late, f"no KV arrived within {timeout:g} s of admission")
        # State for ids never admitted here (e.g. a message for a request Decode already
        # aborted) must not live forever.
        for ext, since in list(self._orphan_since.items()):
            if ext in self._admitted:
                del self._orphan_since[ext]
            elif now - since >= timeout:
                self._forget(ext)
        return late

    # -- step
    def local_report(self) -> RankReport:
        # Requests waiting only for their admission here (``_pending_finished``) were
        # already finished on every rank: re-announcing their failure would make the
        # ranks that forgot them fail them again, and they would never be cleaned.
        failed = self._failed.keys() - self._pending_finished
        return RankReport(frozenset(self._terminal), frozenset(failed))

    def finish_step(
        self,
        reports: Collection[RankReport],
        finished_by_vllm: Iterable[str] = (),
        now: float | None = None,
    ) -> StepOutcome:
        """Resolve this step. With ``now``, state about ids never admitted here (learned
        from other ranks) expires like any orphan instead of waiting for an admission
        that may never come."""
        merged = merge_tp_reports(reports)
        # Another rank's failure fails the request here too.
        for ext in merged.failed - self._failed.keys():
            self._failed[ext] = "failed on another decode rank"
            self._terminal.add(ext)
            self.contributors.discard(ext)
            self.peer_contributions.discard_request(ext)
            if now is not None and ext not in self._admitted:
                self._orphan_since.setdefault(ext, now)
        invalid: set[int] = set()
        failed_internal: set[str] = set()
        reasons: dict[str, str] = {}
        for ext in self._failed:
            entry = self._admitted.get(ext)
            if entry is None or ext in self._invalid_reported:
                continue
            # Destination ids are int64 arrays; vLLM gets plain ints.
            invalid.update(entry.destination.main_block_ids.tolist())
            invalid.update(entry.destination.indexer_block_ids.tolist())
            self._invalid_reported.add(ext)
        finished: set[str] = set()
        for ext in merged.finished | self._pending_finished:
            entry = self._admitted.get(ext)
            if entry is None:
                self._pending_finished.add(ext)
                self._terminal.discard(ext)
                if now is not None:
                    self._orphan_since.setdefault(ext, now)
                continue
            finished.add(entry.internal_id)
            if ext in self._failed:
                failed_internal.add(entry.internal_id)
                reasons[entry.internal_id] = self._failed[ext]
            self._forget(ext)
        for internal_id in finished_by_vllm:
            ext = self._int_to_ext.get(internal_id, external_request_id(internal_id))
            self._forget(ext)
        return StepOutcome(
            frozenset(finished), frozenset(failed_internal), frozenset(invalid), reasons
        )

    def drop(self, internal_ids: Iterable[str]) -> None:
        """Forget requests the engine gave up on outside a step (aborted, or the TP group
        that would resolve them is gone)."""
        for internal_id in internal_ids:
            self._forget(self._int_to_ext.get(internal_id, external_request_id(internal_id)))

    def _forget(self, ext: str) -> None:
        entry = self._admitted.pop(ext, None)
        if entry is not None:
            self._int_to_ext.pop(entry.internal_id, None)
        self._terminal.discard(ext)
        self._failed.pop(ext, None)
        self._invalid_reported.discard(ext)
        self._pending_finished.discard(ext)
        self._orphan_since.pop(ext, None)
        self.contributors.discard(ext)
        self.peer_contributions.discard_request(ext)

    # -- leak accounting
    def counters(self) -> dict[str, int]:
        return {
            "admitted": len(self._admitted),
            "terminal": len(self._terminal),
            "failed": len(self._failed),
            "pending_finished": len(self._pending_finished),
            "contributors": len(self.contributors),
            "orphans": len(self._orphan_since),
            "peer_contributions": len(self.peer_contributions),
        }


class _DestinationView(Mapping[str, Destination]):
    def __init__(self, admitted: Mapping[str, _Admitted]) -> None:
        self._admitted = admitted

    def __getitem__(self, key: str) -> Destination:
        return self._admitted[key].destination

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._admitted)

    def __len__(self) -> int:
        return len(self._admitted)
