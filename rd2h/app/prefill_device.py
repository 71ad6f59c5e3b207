"""The Prefill sender's device-event waiter.

A ``DeviceEvent`` offers only a blocking ``wait(timeout)``, and nothing signals its
completion; so that the sender's loop never waits on one (nor wakes on a poll interval
to look), a helper thread waits on the pending layers' events, in the order they were
announced, each up to the session's deadline for it, and wakes the loop when one
completes. An event still incomplete at its deadline is given up: the session fails
its entries there (``PrefillSession.tick``), and the loop wakes for that deadline itself.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from rd2h.ports.runtime import Clock, DeviceEvent

_IDLE_WAIT_S = 1.0  # the helper's longest sleep without work (notified at once otherwise)


class DeviceEventWaiter:
    """Pending device events by announcement id. Every method but ``start`` is called
    with ``cond`` held (the sender's lock); the helper thread takes it itself.

    ``deadline(aid)``: when the session stops waiting for that announcement's event
    (None: it no longer does, e.g. its entries failed meanwhile). ``wake``: wakes the
    sender's loop (thread-safe)."""

    def __init__(self, cond: threading.Condition, clock: Clock,
                 deadline: Callable[[int], float | None], wake: Callable[[], None],
                 work: threading.Condition | None = None) -> None:
        self._cond = cond
        # What the helper sleeps on: a condition of its own on ``cond``'s lock, so that
        # the sender's other notifications (one per loop pass) do not wake it for
        # nothing; ``cond`` itself when not given.
        self._work = work or cond
        self._clock = clock
        self._deadline = deadline
        self._wake = wake
        self._queue: deque[tuple[int, DeviceEvent | None]] = deque()
        self._done: list[int] = []  # events complete, in announcement order
        self._closed = False
        self._crash: BaseException | None = None

    def start(self, name: str) -> None:
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def add(self, aid: int, event: DeviceEvent | None) -> None:
        """Wait for ``event`` (None: complete already) of announcement ``aid``."""
        if event is None and not self._queue:
            self._done.append(aid)
        else:
            self._queue.append((aid, event))
            self._work.notify_all()

    def take_done(self) -> list[int]:
        """The announcements whose event completed since the last call, in order;
        raises what a device event's ``wait`` raised (the sender then fails)."""
        if self._crash is not None:
            raise self._crash
        out, self._done = self._done, []
        return out

    @property
    def has_done(self) -> bool:
        return bool(self._done) or self._crash is not None

    @property
    def pending(self) -> int:
        """Events waited on or complete and not yet taken."""
        return len(self._queue) + len(self._done)

    def close(self) -> None:
        """Forget every event; the helper ends (after the ``wait`` it may be in)."""
        self._closed = True
        self._queue.clear()
        self._done.clear()
        self._cond.notify_all()
        if self._work is not self._cond:
            self._work.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._work.wait(_IDLE_WAIT_S)  # work and close() notify; bounded anyway
                if self._closed:
                    return
                aid, event = self._queue[0]
                deadline = self._deadline(aid)
                if deadline is None:  # failed or expired meanwhile
                    self._queue.popleft()
                    self._cond.notify_all()
                    continue
                left = max(0.0, deadline - self._clock.now())
            try:
                done = event is None or event.wait(left)
            except BaseException as exc:  # the loop fails the sender with it
                with self._cond:
                    self._crash = exc
                self._wake()
                return
            with self._cond:
                if self._closed:
                    return
                self._queue.popleft()
                if done:
                    self._done.append(aid)
                self._cond.notify_all()
            if done:
                self._wake()
