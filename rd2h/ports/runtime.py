"""Ports for time, device completion and the Decode TP group."""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds."""
        ...


class Digest(Protocol):
    def __call__(self, addrs: Sequence[int] | np.ndarray, sizes: Sequence[int] | np.ndarray
                 ) -> np.ndarray:
        """``verify_kv``: the digests (int64 array) of ``sizes[i]`` bytes at ``addrs[i]``
        of this process (``rd2h.domain.planning.digests``)."""
        ...


class DeviceEvent(Protocol):
    def wait(self, timeout: float) -> bool:
        """Block until the recorded work is complete; False if ``timeout`` ran out."""
        ...


class DeviceEvents(Protocol):
    def record(self) -> DeviceEvent | None:
        """Record an event after the work queued so far (e.g. a layer's KV scatter);
        None where that work is complete when this is called (CPU tensors): the sender
        then announces the layer without handing it to its event-waiting thread."""
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


class HopName(StrEnum):
    """Every hop a request's timeline stamps (``rd2h.app.timeline`` orders and owns
    them); one name per point on the serving path, defined here once."""

    PROXY_RECEIVED = "proxy.received"
    DECODE_MATCHED = "decode.matched"
    DECODE_ALLOCATED = "decode.allocated"
    DECODE_WORKER_ADMITTED = "decode.worker_admitted"
    DECODE_ADMITTED_ALL = "decode.admitted_all"
    PROXY_POST = "proxy.post"
    PROXY_PREFILL_SENT = "proxy.prefill_sent"
    PREFILL_TRACKED = "prefill.tracked"
    PREFILL_FIRST_LAYER = "prefill.first_layer"
    PREFILL_ANNOUNCED_ALL = "prefill.announced_all"
    DECODE_KV_COMPLETE = "decode.kv_complete"
    DECODE_REPORTED = "decode.reported"
    DECODE_KV_READY = "decode.kv_ready"
    DECODE_SCHEDULED = "decode.scheduled"
    PROXY_FIRST_BYTE = "proxy.first_byte"
    PROXY_DONE = "proxy.done"
    PROXY_DECODE_HEADERS = "proxy.decode_headers"
    PREFILL_RELEASED = "prefill.released"
    PROXY_PREFILL_ANSWERED = "proxy.prefill_answered"
    DECODE_FAILED = "decode.failed"
    DECODE_LAYER_READ = "decode.layer_read"


class Timeline(Protocol):
    """Per-request hop stamps (``rd2h timeline`` merges them across processes)."""

    def stamp(self, request_id: str, hop: HopName, trace: str | None = None) -> None:
        """Record that ``request_id`` passed ``hop`` now (``trace``: the W3C
        ``traceparent`` the proxy relayed for it, stamped with its first hop on
        each process)."""

    def stamp_bytes(self, request_id: str, hop: HopName, nbytes: int) -> None:
        """Record that ``nbytes`` of ``request_id`` passed ``hop`` now (a hop that a
        request passes many times, each with its bytes: one layer's read)."""


class SilentLogger:
    """A logger that drops everything (a service built without the composition root)."""

    def bind(self, **context: Any) -> SilentLogger:
        return self

    def debug(self, event: str, **kw: Any) -> None:
        return None

    info = warning = error = debug


SILENT_LOGGER = SilentLogger()


class NoTimeline:
    """The timeline when none is configured: stamps nothing."""

    def stamp(self, request_id: str, hop: HopName, trace: str | None = None) -> None:
        return None

    def stamp_bytes(self, request_id: str, hop: HopName, nbytes: int) -> None:
        return None


NO_TIMELINE = NoTimeline()
