"""The thread both drivers run their loop on: a bounded start and a bounded stop."""

from __future__ import annotations

import threading


class LoopThread:
    """Runs ``self._loop()`` on a named daemon thread. ``_launch`` waits at most
    ``start_timeout_s`` for the thread to run; ``stop`` sets ``_stop``, calls
    ``_interrupt`` (wake a blocking wait) and joins for at most its timeout."""

    def __init__(self, name: str, start_timeout_s: float, stop_timeout_s: float) -> None:
        self._name = name
        self._start_timeout = start_timeout_s
        self._stop_timeout = stop_timeout_s
        self._stop = threading.Event()
        self._running = threading.Event()
        self._thread: threading.Thread | None = None

    def _launch(self) -> None:
        if self._thread is not None:
            raise RuntimeError(f"{self._name} already started")
        self._thread = threading.Thread(target=self._main, name=self._name, daemon=True)
        self._thread.start()
        if not self._running.wait(self._start_timeout):
            self._stop.set()
            raise TimeoutError(f"{self._name} did not start within {self._start_timeout:g} s")

    def _main(self) -> None:
        self._running.set()
        self._loop()

    def _loop(self) -> None:
        raise NotImplementedError

    def _interrupt(self) -> None:
        """Wake the loop from a blocking wait (``stop`` calls it)."""

    def wake(self) -> None:
        """Make the loop look at the time now: it sleeps until its next deadline or
        input, so a clock that jumps (a test's manual clock) needs this."""
        self._interrupt()

    def stop(self, timeout: float | None = None) -> bool:
        """Stop the loop; True if it ended within ``timeout`` (default: the configured
        stop deadline)."""
        self._stop.set()
        if self._thread is None:
            return True
        self._interrupt()
        self._thread.join(self._stop_timeout if timeout is None else timeout)
        return not self._thread.is_alive()

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
