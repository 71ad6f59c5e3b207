"""Checks of plain decoded values shared by the control messages and MF_META's layer
map (``protocol``, ``layer_meta``): ints, strings, arrays, and error-text clipping."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rd2h.domain.errors import ProtocolError

# Block ids, start offsets and group positions feed int64 arrays on Decode: a value
# above this is malformed (the planner never sees a number numpy cannot hold).
MAX_WIRE_INT = (1 << 63) - 1
# Longest error text Decode puts in a READ_FAILED or a log line about a hostile value.
MAX_ERROR_CHARS = 1024


def clip(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` cut to ``limit`` characters: hostile values must not become huge replies."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


# Most request ids one log line quotes; the rest are counted (a peer chooses them).
MAX_LOGGED_IDS = 8


def few(ids: Sequence[str], limit: int = MAX_LOGGED_IDS) -> dict[str, Any]:
    """Fields for a log line naming ``ids``: the first ``limit``, each clipped to 128
    characters, and how many there were (one message may name 100,000)."""
    shown = [clip(str(i), 128) for i in ids[:limit]]
    return {"requests": shown, "count": len(ids)}


def as_int(
    value: Any,
    what: str,
    layer_idx: int | None = None,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{what} must be an int, got {type(value).__name__}", layer_idx)
    if minimum is not None and value < minimum:
        raise ProtocolError(f"{what} must be >= {minimum}, got {value}", layer_idx)
    if maximum is not None and value > maximum:
        raise ProtocolError(f"{what} must be <= {maximum}, got {value}", layer_idx)
    return value


def as_str(value: Any, what: str, layer_idx: int | None = None) -> str:
    if not isinstance(value, str):
        raise ProtocolError(f"{what} must be a str, got {type(value).__name__}", layer_idx)
    return value


def as_seq(value: Any, what: str, layer_idx: int | None = None) -> Sequence[Any]:
    if not isinstance(value, (list, tuple)):
        raise ProtocolError(f"{what} must be an array, got {type(value).__name__}", layer_idx)
    return value
