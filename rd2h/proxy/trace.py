"""W3C Trace Context for ``rd2h proxy``: the ``traceparent`` a client sent, or a new
one, relayed on both legs (as the header and in ``kv_transfer_params``, where the rd2h
connector on each engine logs it and stamps it on the request's timeline)."""

from __future__ import annotations

import re
import secrets

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def valid_traceparent(value: str | None) -> bool:
    """Version 00 form (other versions: the first four fields), ids not all zero."""
    if not value:
        return False
    m = _TRACEPARENT.match(value.strip().lower())
    if m is None or m.group(1) == "ff":
        return False
    return m.group(2) != "0" * 32 and m.group(3) != "0" * 16


def new_traceparent() -> str:
    """A new trace, not sampled (flags 00): the engines log it at debug level only; a
    client that samples its traces sends its own with flags 01."""
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-00"


def traceparent_for(header: str | None) -> str:
    """The client's ``traceparent`` when valid (lower-cased), else a new one."""
    if header is not None and valid_traceparent(header):
        return header.strip().lower()
    return new_traceparent()

