"""Decode's side of ``POST /v1/metaserver/watch``: learn which posted requests will get
no KV because the proxy could not dispatch them to Prefill.

One long-poll thread per (watch URL, engine) runs while that pair has delivered posts
whose requests are still open; it asks for failures newer than the last sequence
number seen and files those of its requests for ``take_failed``. A failure that arrives
before its post's answer was handled is kept briefly (bounded) and claimed by the post.
A proxy without the endpoint (404/405: an older one) is not asked again: its requests
end at their KV deadline, as before. Every wait is bounded: one poll by ``wait_s`` plus
``timeout_s``, a retry after ``retry_delay_s``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

import httpx

from rd2h.ports.runtime import Logger

_UNCLAIMED_MAX = 1024  # failures seen before their post was answered, kept briefly
_UNCLAIMED_TTL_S = 60.0


def watch_url(metaserver_url: str) -> str:
    return metaserver_url.rstrip("/") + "/watch"


class Watcher:
    """Shares the metaserver client's condition (its lock guards this state too)."""

    def __init__(self, cond: threading.Condition, log: Logger, *, retry_delay_s: float,
                 wait_s: float, timeout_s: float,
                 transport: httpx.BaseTransport | None = None) -> None:
        if not wait_s > 0:
            raise ValueError(f"watch_wait_s must be > 0, not {wait_s!r}")
        self._cond = cond
        self._log = log
        self._retry_delay_s = retry_delay_s
        self._wait_s = wait_s
        self._client = httpx.Client(timeout=httpx.Timeout(wait_s + timeout_s),
                                    transport=transport)
        self._ids: dict[tuple[str, str], set[str]] = {}
        self._key_of: dict[str, tuple[str, str]] = {}
        self._threads: dict[tuple[str, str], threading.Thread] = {}
        self._unsupported: set[str] = set()
        self._failed: dict[str, str] = {}
        self._unclaimed: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self._closed = False
        self.polls = 0

    # -- called with the condition's lock held ----------------------------------------
    def watch(self, request_id: str, metaserver_url: str, engine: str) -> None:
        url = watch_url(metaserver_url)
        if self._closed or url in self._unsupported or request_id in self._failed:
            return
        early = self._unclaimed.pop(request_id, None)
        if early is not None:
            self._failed[request_id] = early[1]
            return
        key = (url, engine)
        self._ids.setdefault(key, set()).add(request_id)
        self._key_of[request_id] = key
        if key not in self._threads:
            t = threading.Thread(target=self._run, args=(key,), daemon=True,
                                 name=f"rd2h-metaserver-watch-{len(self._threads)}")
            self._threads[key] = t
            t.start()

    def forget(self, request_id: str) -> None:
        """The request finished: nothing more to learn about it."""
        key = self._key_of.pop(request_id, None)
        if key is not None:
            self._ids.get(key, set()).discard(request_id)
        self._failed.pop(request_id, None)

    def take_failed(self) -> dict[str, str]:
        out, self._failed = self._failed, {}
        return out

    def close(self) -> None:
        self._closed = True

    @property
    def watched(self) -> int:
        return len(self._key_of)

    # -- the poll thread --------------------------------------------------------------
    def _run(self, key: tuple[str, str]) -> None:
        url, engine = key
        cursor, errors = 0, 0
        try:
            while True:
                with self._cond:
                    if self._closed or not self._ids.get(key):
                        self._ids.pop(key, None)
                        self._threads.pop(key, None)
                        return
                body = {"engine_id": engine, "cursor": cursor, "wait_s": self._wait_s}
                try:
                    r = self._client.post(url, json=body)
                    self.polls += 1
                    if r.status_code in (404, 405):
                        self._unsupported_url(key)
                        return
                    r.raise_for_status()
                    new_cursor, failed = _parse(r.json())
                except Exception as exc:  # transport, HTTP or body: retry later
                    errors += 1
                    if errors == 1 or errors % 30 == 0:
                        self._log.warning("metaserver watch failed; retrying", url=url,
                                          error=f"{type(exc).__name__}: {exc}", errors=errors)
                    until = time.monotonic() + self._retry_delay_s
                    with self._cond:
                        while not self._closed and (left := until - time.monotonic()) > 0:
                            self._cond.wait(left)
                    continue
                errors = 0
                # A cursor that went back: the proxy restarted; ask for all it holds.
                cursor = 0 if new_cursor < cursor else new_cursor
                if failed:
                    self._file(key, failed)
        finally:
            with self._cond:
                if self._threads.get(key) is threading.current_thread():
                    self._threads.pop(key, None)

    def _file(self, key: tuple[str, str], failed: list[tuple[str, str]]) -> None:
        now = time.monotonic()
        with self._cond:
            ids = self._ids.get(key, set())
            for request_id, reason in failed:
                if self._key_of.get(request_id) == key:
                    del self._key_of[request_id]
                    ids.discard(request_id)
                    self._failed[request_id] = reason
                elif request_id not in self._failed:
                    self._unclaimed[request_id] = (now, reason)
                    self._unclaimed.move_to_end(request_id)
            while self._unclaimed and (len(self._unclaimed) > _UNCLAIMED_MAX or next(
                    iter(self._unclaimed.values()))[0] < now - _UNCLAIMED_TTL_S):
                self._unclaimed.popitem(last=False)
            self._cond.notify_all()

    def _unsupported_url(self, key: tuple[str, str]) -> None:
        with self._cond:
            self._unsupported.add(key[0])
            for request_id in self._ids.pop(key, set()):
                self._key_of.pop(request_id, None)
            self._threads.pop(key, None)
        self._log.info("the metaserver has no watch endpoint (an older proxy): requests "
                       "whose Prefill dispatch fails end at their KV deadline", url=key[0])


def _parse(data: Any) -> tuple[int, list[tuple[str, str]]]:
    if not isinstance(data, dict):
        raise ValueError("watch answer is not a JSON object")
    cursor, failed = data.get("cursor"), data.get("failed")
    if isinstance(cursor, bool) or not isinstance(cursor, int) or not isinstance(failed, list):
        raise ValueError("watch answer needs an int 'cursor' and a list 'failed'")
    out = []
    for item in failed[:65536]:
        if (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], str)):
            out.append((item[0], item[1][:512]))
    return cursor, out
