"""Dispatch outcomes for Decode (``POST /v1/metaserver/watch``): the proxy tells each
Decode engine which of the requests it posted will get no KV, so Decode fails them at
once (vLLM then applies ``kv_load_failure_policy``) instead of at its KV deadline.

Failures are kept per Decode engine (the ``remote_engine_id`` of its posts), each
with a sequence number; a watch names the engine and the last number it saw and is
answered as soon as a newer failure exists, or empty after ``wait_s``. Bounded: at
most ``per_engine`` failures per engine, ``engines`` engines, each kept ``ttl_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Mapping
from typing import Any

MAX_WAIT_S = 30.0
MAX_ID_CHARS = 512
MAX_REASON_CHARS = 512


class WatchError(ValueError):
    """A watch request that cannot be answered (400)."""


class DispatchFailures:
    def __init__(self, *, per_engine: int = 4096, engines: int = 256,
                 ttl_s: float = 120.0) -> None:
        self._per_engine = per_engine
        self._engines = engines
        self._ttl_s = ttl_s
        self._seq = itertools.count(1)
        self._last = 0
        self._by_engine: OrderedDict[str, deque[tuple[int, float, str, str]]] = OrderedDict()
        self._changed = asyncio.Event()
        self._closed = False
        self.recorded = 0

    def close(self) -> None:
        """The proxy is shutting down: every watch, waiting or new, is answered now."""
        self._closed = True
        self._changed.set()

    def record(self, posts: Mapping[str, Mapping[str, Any]], reason: str) -> int:
        """The requests of these metaserver posts (request id -> post) get no KV."""
        now = time.monotonic()
        n = 0
        for request_id, post in posts.items():
            engine = post.get("remote_engine_id")
            if not isinstance(engine, str):
                continue
            log = self._by_engine.get(engine)
            if log is None:
                log = self._by_engine[engine] = deque(maxlen=self._per_engine)
                while len(self._by_engine) > self._engines:
                    self._by_engine.popitem(last=False)
            self._by_engine.move_to_end(engine)
            self._last = next(self._seq)
            log.append((self._last, now, request_id[:MAX_ID_CHARS], reason[:MAX_REASON_CHARS]))
            n += 1
        if n:
            self.recorded += n
            self._changed.set()
            self._changed = asyncio.Event()
        return n

    def _since(self, engine: str, cursor: int) -> list[list[str]]:
        log = self._by_engine.get(engine)
        if not log:
            return []
        cutoff = time.monotonic() - self._ttl_s
        while log and log[0][1] < cutoff:
            log.popleft()
        return [[rid, reason] for seq, _, rid, reason in log if seq > cursor]

    async def watch(self, body: Any) -> dict[str, Any]:
        """``{"engine_id": str, "cursor": int, "wait_s": float}`` ->
        ``{"cursor": int, "failed": [[request_id, reason], ...]}``."""
        if not isinstance(body, Mapping):
            raise WatchError("watch body must be a JSON object")
        engine, cursor, wait_s = body.get("engine_id"), body.get("cursor", 0), body.get(
            "wait_s", 10.0)
        if not isinstance(engine, str) or not engine:
            raise WatchError("watch needs a non-empty string 'engine_id'")
        if isinstance(cursor, bool) or not isinstance(cursor, int) or cursor < 0:
            raise WatchError("watch 'cursor' must be an int >= 0")
        if isinstance(wait_s, bool) or not isinstance(wait_s, int | float) or wait_s < 0:
            raise WatchError("watch 'wait_s' must be a number >= 0")
        deadline = time.monotonic() + min(float(wait_s), MAX_WAIT_S)
        while True:
            failed = self._since(engine, cursor)
            left = deadline - time.monotonic()
            if failed or left <= 0 or self._closed:
                return {"cursor": self._last, "failed": failed}
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)
