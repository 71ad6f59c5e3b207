"""Per-request timeline stamps as JSON lines, one file per process.

Every process that stamps (the proxy, each engine's scheduler and workers) appends
``{"id": <request id>, "hop": <hop>, "t": <unix time>, "pid": <pid>}`` lines to
``<dir>/stamps-<host>-<pid>.jsonl``; a stamp with bytes (``stamp_bytes``: one layer's
read of a request on Decode) adds ``"bytes": <n>``; a request's first stamp on each
process adds ``"trace": <traceparent>`` when the proxy relayed one. Lines are
written whole (line-buffered, one ``write`` each, under a lock), so a process killed
at any moment leaves only whole lines. ``rd2h timeline <dir>`` merges the files into
a per-hop breakdown. Wall-clock time is used so that processes on different hosts
compare (keep their clocks synced).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from rd2h.ports.runtime import NO_TIMELINE

ENV_DIR = "RD2H_TIMELINE_DIR"

_writers: dict[str, JsonlTimeline] = {}
_writers_lock = threading.Lock()


class JsonlTimeline:
    """Appends stamps to this process's file under ``directory`` (created if needed)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._pid = os.getpid()
        self.path = self.directory / f"stamps-{socket.gethostname()}-{self._pid}.jsonl"
        self._lock = threading.Lock()
        self._fh: Any = None

    def stamp(self, request_id: str, hop: str, trace: str | None = None) -> None:
        rec = {"id": request_id, "hop": hop, "t": time.time(), "pid": self._pid}
        if trace:
            rec["trace"] = trace
        self._write(rec)

    def stamp_bytes(self, request_id: str, hop: str, nbytes: int) -> None:
        self._write({"id": request_id, "hop": hop, "t": time.time(), "pid": self._pid,
                     "bytes": int(nbytes)})

    def _write(self, rec: dict[str, Any]) -> None:
        with self._lock:
            if self._fh is None or self._pid != os.getpid():  # opened lazily, anew after fork
                self._pid = os.getpid()
                self.path = self.directory / f"stamps-{socket.gethostname()}-{self._pid}.jsonl"
                self._fh = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
            rec["pid"] = self._pid
            self._fh.write(json.dumps(rec) + "\n")

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None


def timeline(directory: str | None = None) -> Any:
    """The process's timeline for ``directory`` (default: ``$RD2H_TIMELINE_DIR``); the
    no-op timeline when neither is set. One writer per folder per process."""
    directory = directory or os.environ.get(ENV_DIR) or None
    if directory is None:
        return NO_TIMELINE
    key = str(Path(directory).resolve())
    with _writers_lock:
        writer = _writers.get(key)
        if writer is None:
            writer = _writers[key] = JsonlTimeline(key)
        return writer
