"""Prefill storage-slot gates (spec 7.1): may a layer's physical storage be reused?

One gate per physical storage slot, keyed by storage addresses, not layer
names. Main and indexer slots are independent. Announcing a layer to at least
one endpoint closes its slots; they open when every endpoint sent to has
replied (or the layer failed). ``state(layer)`` is open only when every slot of
the layer is open, whichever logical layer closed it.

Pure bookkeeping: no deadlines here. The Prefill session
(``rd2h.domain.prefill.prefill_session``) owns every deadline and tells the gates when
an endpoint's announcement is answered or given up.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from rd2h.domain.errors import CompletionError

SlotKey = tuple[str, tuple[int, ...]]


@dataclass(frozen=True)
class GateState:
    """Whether a layer's storage may be reused, and why not if it may not."""

    open: bool
    error: str | None = None
    waiting_on: tuple[Hashable, ...] = ()


class StorageSlotGates:
    def __init__(self) -> None:
        self._slots_of_layer: dict[int, tuple[SlotKey, ...]] = {}
        self._closers: dict[SlotKey, set[int]] = {}
        self._pending: dict[int, Counter[Hashable]] = {}
        self._errors: dict[int, str] = {}

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

    def knows(self, layer_idx: int) -> bool:
        return layer_idx in self._slots_of_layer

    # -- transitions
    def announce(self, layer_idx: int, endpoints: Iterable[Hashable]) -> bool:
        """Record that the layer was announced to ``endpoints``; True if its gates closed.
        A new announcement starts afresh: the layer's old error is cleared."""
        slots = self.slots_of(layer_idx)
        self._errors.pop(layer_idx, None)
        targets = list(endpoints)
        if not targets:
            return False
        pending = self._pending.get(layer_idx)
        if pending is None:
            pending = self._pending[layer_idx] = Counter()
        for endpoint in targets:  # Counter.update's generic path costs more per layer
            pending[endpoint] += 1
        for slot in slots:
            self._closers.setdefault(slot, set()).add(layer_idx)
        return True

    def acknowledge(self, layer_idx: int, endpoint: Hashable, error: str | None = None) -> bool:
        """Count one reply (or one given-up send, with ``error``); True when it completed
        the layer. Stray replies are ignored."""
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

    def _release(self, layer_idx: int) -> None:
        self._pending.pop(layer_idx, None)
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

    @property
    def pending_layers(self) -> tuple[int, ...]:
        return tuple(sorted(self._pending))

    @property
    def closed_slots(self) -> int:
        return len(self._closers)
