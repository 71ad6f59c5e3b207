"""Log lines that quote peer-chosen values are bounded (issue #29 part 5): one
READ_READY_BATCH naming 100,000 requests Decode does not know writes one record with
the first few ids and the count, never every id."""

from __future__ import annotations

from fakes.logs import RecordingLogger

from rd2h.app.telemetry import DecodeStats, report_decode
from rd2h.domain.decode import decode_events as d
from rd2h.domain.wire.wire_values import MAX_LOGGED_IDS, few


def test_skipped_ids_are_clipped_and_counted() -> None:
    ids = tuple(f"hostile-{i}-" + "x" * 500 for i in range(100_000))
    log, stats = RecordingLogger(), DecodeStats()
    report_decode([d.Skipped(3, ids)], stats, log)
    (record,) = log.records
    fields = record[2]
    assert fields["count"] == 100_000 and stats.skipped == 100_000
    assert len(fields["requests"]) == MAX_LOGGED_IDS
    assert all(len(r) <= 128 for r in fields["requests"])
    assert len(repr(fields)) < 2_000


def test_few_keeps_short_lists_whole() -> None:
    assert few(("a", "b")) == {"requests": ["a", "b"], "count": 2}
    assert few(()) == {"requests": [], "count": 0}


def test_requests_reported_final_too_early_are_counted_and_clipped() -> None:
    """A peer's early final report (``Incomplete``): counted per request, one warning
    naming a few of them and the first layers not read, every peer-given name clipped."""
    ids = tuple(f"hostile-{i}-" + "x" * 500 for i in range(1000))
    missing = tuple("model.layers.2." + "y" * 1000 + str(i) for i in range(10))
    log, stats = RecordingLogger(), DecodeStats()
    assert report_decode([d.Incomplete(5, tuple((e, missing) for e in ids))], stats, log)
    (record,) = log.records
    fields = record[2]
    assert stats.incomplete == 1000 and fields["count"] == 1000
    assert fields["not_read_count"] == 10 and len(fields["not_read"]) == 4
    assert all(len(n) <= 128 for n in fields["not_read"])
    assert len(fields["requests"]) == MAX_LOGGED_IDS
    assert len(repr(fields)) < 3_000
