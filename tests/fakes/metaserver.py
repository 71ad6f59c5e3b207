"""A metaserver poster (``rd2h.ports.metaserver.MetaserverPoster``) that records."""

from __future__ import annotations

from typing import Any, ClassVar

from rd2h.ports.metaserver import MetaserverStats


class RecordingMetaserver:
    """Records posts, cancels and shutdowns. ``fail_with`` makes ``post`` raise it.
    Takes the real client's keyword arguments too, so it can stand in for
    ``MetaserverClient`` (``made`` lists every instance built that way)."""

    made: ClassVar[list[RecordingMetaserver]] = []

    def __init__(self, fail_with: Exception | None = None, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.fail_with = fail_with
        self.posts: list[tuple[str, str, dict[str, Any]]] = []
        self.cancels: list[str] = []
        self.shutdowns: list[float] = []
        self.failed: dict[str, str] = {}  # what take_failed reports next
        RecordingMetaserver.made.append(self)

    def post(self, request_id: str, url: str, payload: dict[str, Any]) -> None:
        if self.fail_with is not None:
            raise self.fail_with
        self.posts.append((request_id, url, dict(payload)))

    def cancel(self, request_id: str) -> int:
        self.cancels.append(request_id)
        return 0

    def pending(self) -> int:
        return 0

    def take_failed(self) -> dict[str, str]:
        out, self.failed = self.failed, {}
        return out

    def stats(self) -> MetaserverStats:
        return MetaserverStats(delivered=len(self.posts), cancelled=len(self.cancels))

    def shutdown(self, timeout: float) -> bool:
        self.shutdowns.append(timeout)
        return True
