"""Descriptor-batch checks and registered-region tables shared by the transports.

Pure numpy: a batch is validated as a whole (shapes, positive lengths, no
overflow) and every range must lie inside one registered region, before the
first byte moves.
"""

from __future__ import annotations

import threading

import numpy as np

from rd2h.domain.errors import TransferError

_INT64_MAX = int(np.iinfo(np.int64).max)
_NONE = np.zeros(0, np.intp)
_NONE.setflags(write=False)
_I64 = np.dtype(np.int64)
# The ufuncs' reductions called directly (``a.min()`` adds a Python-level wrapper per call;
# a batch's checks are a handful of reductions over a few dozen values).
_min, _max, _all = np.minimum.reduce, np.maximum.reduce, np.logical_and.reduce


def _as_int64(name: str, values: np.ndarray) -> np.ndarray:
    if type(values) is np.ndarray and values.dtype == _I64 and values.ndim == 1:
        return values  # what the planner hands over: nothing to convert
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise TransferError(f"{name} must be a 1-D array, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise TransferError(f"{name} must be an integer array, got dtype {arr.dtype}")
    # uint64 values above the int64 range wrap to negative and are refused below.
    return arr.astype(np.int64, copy=False)


def validate_batch(
    local_addrs: np.ndarray, remote_addrs: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Check a batch's arrays and return them as 1-D int64 arrays.

    Refuses unequal shapes, non-positive lengths, negative addresses and ranges
    whose end would overflow. Raises ``TransferError`` naming the first bad
    descriptor.
    """
    local = _as_int64("local_addrs", local_addrs)
    remote = _as_int64("remote_addrs", remote_addrs)
    lens = _as_int64("lengths", lengths)
    if not local.shape == remote.shape == lens.shape:
        raise TransferError(
            "descriptor arrays differ in shape: "
            f"local_addrs {local.shape}, remote_addrs {remote.shape}, lengths {lens.shape}"
        )
    if lens.size == 0:
        return local, remote, lens
    # The common case, every descriptor valid, in a few whole-array reductions compared
    # in exact integers (no start is negative, and the highest start plus the longest
    # length fits: so does every range); the exact search below (which names the first
    # bad descriptor) runs otherwise.
    if int(_min(lens)) > 0:
        longest = int(_max(lens))
        if (int(_min(local)) >= 0 and int(_min(remote)) >= 0
                and int(_max(local)) <= _INT64_MAX - longest
                and int(_max(remote)) <= _INT64_MAX - longest):
            return local, remote, lens
    bad = np.flatnonzero(lens <= 0)
    if bad.size:
        i = int(bad[0])
        raise TransferError(
            f"descriptor {i} has non-positive length {int(lens[i])} ({bad.size} such descriptors)"
        )
    for side, addrs in (("local", local), ("remote", remote)):
        bad = np.flatnonzero((addrs < 0) | (addrs > _INT64_MAX - lens))
        if bad.size:
            i = int(bad[0])
            raise TransferError(
                f"descriptor {i} has an invalid {side} range "
                f"(address {int(addrs[i])}, length {int(lens[i])})"
            )
    return local, remote, lens


def as_region(addr: object, size: object) -> tuple[int, int]:
    """``(addr, size)`` as ints, refused with ``TransferError`` unless they name a
    non-empty region at a positive address whose end fits in int64."""
    try:
        a, s = int(addr), int(size)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise TransferError(f"cannot register region at {addr!r} of size {size!r}") from None
    if a <= 0 or s <= 0 or a > _INT64_MAX - s:
        raise TransferError(f"cannot register region at address {a} of size {s}")
    return a, s


class RegionTable:
    """A thread-safe set of registered ``[addr, addr + size)`` regions.

    Overlapping regions are allowed; a range is accepted when it lies inside one
    registered region. Lookups are vectorised: regions are kept sorted by start
    with a running maximum of their ends, so "some region starting at or before
    ``a`` ends at or after ``a + n``" is one ``searchsorted`` plus one gather.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: set[tuple[int, int]] = set()
        # (starts sorted ascending, running max of ends), replaced as a whole.
        self._snapshot: tuple[np.ndarray, np.ndarray] = (
            np.empty(0, np.int64),
            np.empty(0, np.int64),
        )

    def add(self, addr: int, size: int) -> bool:
        """Record a region; returns False when exactly this region was already there."""
        addr, size = as_region(addr, size)
        with self._lock:
            if (addr, size) in self._regions:
                return False
            self._regions.add((addr, size))
            ordered = sorted(self._regions)
            starts = np.fromiter((a for a, _ in ordered), np.int64, len(ordered))
            ends = np.fromiter((a + s for a, s in ordered), np.int64, len(ordered))
            self._snapshot = (starts, np.maximum.accumulate(ends))
            return True

    def clear(self) -> None:
        """Forget every region."""
        with self._lock:
            self._regions.clear()
            self._snapshot = (np.empty(0, np.int64), np.empty(0, np.int64))

    def __len__(self) -> int:
        return len(self._snapshot[0])

    def outside(self, addrs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Indices of the ranges ``[addrs[i], addrs[i] + lengths[i])`` not inside a region.

        Expects arrays already checked by ``validate_batch``.
        """
        starts, max_ends = self._snapshot
        if starts.size == 0:
            return np.arange(addrs.size)
        idx = starts.searchsorted(addrs, side="right")
        idx -= 1
        if idx.size and int(_min(idx)) >= 0 and _all(max_ends[idx] >= addrs + lengths):
            return _NONE  # every range inside a region (the common case)
        covered = (idx >= 0) & (max_ends[np.maximum(idx, 0)] >= addrs + lengths)
        return np.flatnonzero(~covered)

    def require_inside(self, addrs: np.ndarray, lengths: np.ndarray, what: str) -> None:
        """Raise ``TransferError`` naming the first range not inside a region."""
        bad = self.outside(addrs, lengths)
        if bad.size:
            i = int(bad[0])
            raise TransferError(
                f"descriptor {i}: {what} range [{int(addrs[i]):#x}, +{int(lengths[i])}) "
                f"is outside the registered memory ({bad.size} of {addrs.size} "
                "descriptors are)"
            )
