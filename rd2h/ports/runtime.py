"""Ports for time, device completion and the Decode TP group."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds."""
        ...


class DeviceEvent(Protocol):
    def wait(self, timeout: float) -> bool:
        """Block until the recorded work is complete; False if ``timeout`` ran out."""
        ...


class DeviceEvents(Protocol):
    def record(self) -> DeviceEvent:
        """Record an event after the work queued so far (e.g. a layer's KV scatter)."""
        ...


class TpGroupExchange(Protocol):
    """All-gather of small picklable objects among the Decode TP ranks."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_gather(self, obj: Any, timeout: float) -> Sequence[Any]:
        """Every rank's ``obj`` in rank order; raises ``TimeoutError`` past ``timeout``."""
        ...


class Logger(Protocol):
    """A structured logger (structlog-like): ``bind`` returns a logger with context."""

    def bind(self, **context: Any) -> Logger: ...

    def debug(self, event: str, **kw: Any) -> Any: ...

    def info(self, event: str, **kw: Any) -> Any: ...

    def warning(self, event: str, **kw: Any) -> Any: ...

    def error(self, event: str, **kw: Any) -> Any: ...


class Timeline(Protocol):
    """Per-request hop stamps (``rd2h timeline`` merges them across processes)."""

    def stamp(self, request_id: str, hop: str) -> None:
        """Record that ``request_id`` passed ``hop`` now."""


class NoTimeline:
    """The timeline when none is configured: stamps nothing."""

    def stamp(self, request_id: str, hop: str) -> None:
        return None


NO_TIMELINE = NoTimeline()
