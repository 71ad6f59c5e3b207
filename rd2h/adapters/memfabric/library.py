"""The slice of ``memfabric_hybrid`` rd2h uses, how it is loaded, and how its failures
are explained.

Facts about memfabric-hybrid 1.3.0 this module relies on (read off the installed
package and observed on a machine without an Ascend driver):

* Every call returns 0 on success and non-zero on failure; nothing raises, except
  pybind's ``TypeError`` for arguments of the wrong type.
* ``get_last_err_msg()`` is sticky and only set by some layers (a failed
  ``batch_transfer_sync_read`` sets it; a failed ``initialize`` does not).
  ``get_and_clear_last_err_msg()`` reads and clears it.
* The library logs to stdout unless ``set_extern_logger(fn)`` installs a callback
  ``fn(level, message)`` (level 0 debug, 1 info, 2 warn, 3 error, higher: trace), called
  from the library's own threads too. A failed ``initialize`` explains itself only there
  (e.g. "the current version of ascend driver does not support mf!").

The module is imported lazily, and callers may pass any object with the same surface
(tests pass a recording fake).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import re
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from rd2h.domain.errors import TransferError, TransportLibraryError

ERROR_LEVEL = 3
"""The library's log level for errors (0 debug, 1 info, 2 warn, 3 error)."""

_LOG = logging.getLogger("rd2h.memfabric")
_PY_LEVELS = {0: logging.DEBUG, 1: logging.INFO, 2: logging.WARNING, 3: logging.ERROR}
_PREFIX = re.compile(r"^\s*\[[^\]]*\]\s*")  # "[HYBM hybm_entry.cpp:97 hybm_init] "
_KEEP_ERRORS = 32
_MAX_REASONS = 4


class MemFabricLibrary(Protocol):
    """What ``import memfabric_hybrid`` provides that rd2h calls."""

    TransferEngine: Callable[[], Any]
    TransDataOpType: Any

    def create_config_store(self, store_url: str) -> int: ...

    def get_last_err_msg(self) -> str: ...

    def get_and_clear_last_err_msg(self) -> str: ...

    def set_extern_logger(self, log_fn: Callable[[int, str], None]) -> int: ...


def load_library() -> MemFabricLibrary:
    """Import ``memfabric_hybrid`` now (it loads native libraries); ``TransferError`` if
    it is not installed or cannot load."""
    try:
        import memfabric_hybrid
    except ImportError as exc:
        raise TransferError(
            f"cannot import memfabric_hybrid ({exc}); install the 'memfabric' extra "
            "(memfabric-hybrid 1.3.0) or choose another transport"
        ) from exc
    except OSError as exc:  # a native library it preloads is missing or broken
        raise TransferError(f"memfabric_hybrid failed to load its native libraries: {exc}") from exc
    return memfabric_hybrid  # type: ignore[return-value]


class _ErrorTap:
    """The library's log callback: forwards every line to Python logging
    (``rd2h.memfabric``) and keeps the last error lines to explain failures."""

    def __init__(self) -> None:
        self.errors: collections.deque[tuple[int, str]] = collections.deque(maxlen=_KEEP_ERRORS)
        self._seq = 0
        self._lock = threading.Lock()

    def __call__(self, level: int, message: str) -> None:
        # Runs on library threads too: never raise into the library.
        with contextlib.suppress(Exception):
            text = _PREFIX.sub("", str(message)).strip()
            _LOG.log(_PY_LEVELS.get(int(level), logging.DEBUG), "%s", text)
            if int(level) == ERROR_LEVEL and text:
                with self._lock:
                    self._seq += 1
                    self.errors.append((self._seq, text))

    def mark(self) -> int:
        with self._lock:
            return self._seq

    def since(self, mark: int) -> list[str]:
        with self._lock:
            return [text for seq, text in self.errors if seq > mark]


_taps_lock = threading.Lock()
_taps: weakref.WeakKeyDictionary[Any, _ErrorTap] = weakref.WeakKeyDictionary()


def error_tap(library: MemFabricLibrary) -> _ErrorTap | None:
    """Install (once per library) the log callback; ``None`` if the library has none."""
    with _taps_lock:
        tap = _taps.get(library)
        if tap is None and callable(getattr(library, "set_extern_logger", None)):
            tap = _ErrorTap()
            try:
                if library.set_extern_logger(tap) != 0:
                    return None
            except Exception:
                return None
            _taps[library] = tap
        return tap


def _reason(library: MemFabricLibrary, tap: _ErrorTap | None, mark: int) -> str:
    """The library's explanation of a failure: its last error message, then the error
    lines it logged since ``mark`` ('' if it gave none)."""
    reasons: list[str] = []
    with contextlib.suppress(Exception):
        last = str(library.get_and_clear_last_err_msg() or "").strip()
        if last:
            reasons.append(last)
    if tap is not None:
        logged = list(dict.fromkeys(tap.since(mark)))
        reasons.extend(r for r in logged[-_MAX_REASONS:] if r not in reasons)
    return "; ".join(reasons[-_MAX_REASONS:])


def call_checked(
    library: MemFabricLibrary,
    operation: str,
    fn: Callable[..., Any],
    *args: Any,
    detail: str = "",
    hint: str = "",
) -> None:
    """Call ``fn(*args)``, a library call that returns 0 on success.

    The sticky last-error message is cleared first so a failure is explained by its own
    cause. A non-zero result raises ``TransportLibraryError`` carrying the library's
    words; an exception (pybind's ``TypeError`` for wrong argument types) becomes a
    ``TransferError``.
    """
    tap = error_tap(library)
    mark = tap.mark() if tap is not None else 0
    with contextlib.suppress(Exception):
        library.get_and_clear_last_err_msg()
    try:
        rc = fn(*args)
    except Exception as exc:
        raise TransferError(f"MemFabric {operation} raised {exc!r}") from exc
    if rc == 0:
        return
    reason = _reason(library, tap, mark)
    said = f"library says: {reason}" if reason else "the library gave no reason"
    where = f" {detail}" if detail else ""
    advice = f"; {hint}" if hint else ""
    raise TransportLibraryError(
        f"MemFabric {operation}{where} returned {rc} ({said}){advice}",
        operation=operation,
        rc=rc,
        library_message=reason,
    )
