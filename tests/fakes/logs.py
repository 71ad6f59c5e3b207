"""A structlog-like logger that keeps every line (thread-safe appends)."""

from __future__ import annotations

from typing import Any

Record = tuple[str, str, dict[str, Any]]


class RecordingLogger:
    def __init__(self, records: list[Record] | None = None, **context: Any) -> None:
        self.records: list[Record] = [] if records is None else records
        self._context = context

    def bind(self, **context: Any) -> RecordingLogger:
        return RecordingLogger(self.records, **{**self._context, **context})

    def _log(self, level: str, event: str, **kw: Any) -> None:
        self.records.append((level, event, {**self._context, **kw}))

    def debug(self, event: str, **kw: Any) -> None:
        self._log("debug", event, **kw)

    def info(self, event: str, **kw: Any) -> None:
        self._log("info", event, **kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._log("warning", event, **kw)

    def error(self, event: str, **kw: Any) -> None:
        self._log("error", event, **kw)

    def events(self, level: str | None = None) -> list[str]:
        return [e for lv, e, _ in list(self.records) if level is None or lv == level]

    def lines(self, level: str | None = None) -> list[str]:
        return [f"{e} {kw}" for lv, e, kw in list(self.records) if level is None or lv == level]

    def at(self, level: str) -> list[tuple[str, dict[str, Any]]]:
        return [(e, kw) for lv, e, kw in list(self.records) if lv == level]
