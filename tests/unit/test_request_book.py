"""Decode request completion (spec 7.2): contributor groups, the TP merge and the
request book. Every scenario ends with a leak check: all ``DecodeRequestBook.counters()``
back at zero.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rd2h.domain.decode.contributors import ContributorTracker
from rd2h.domain.decode.request_book import (
    DecodeRequestBook,
    MergedReport,
    RankReport,
    StepOutcome,
    merge_tp_reports,
)
from rd2h.domain.errors import ProtocolError
from rd2h.domain.planning.layout import DestinationLayout, DestTensor, SourceLayout, TensorComponent
from rd2h.domain.planning.planning import plan_reads
from rd2h.domain.wire.protocol import ReadReadyBatch, ReadRequest

HSETTINGS = settings(deadline=None, max_examples=150)
SUFFIX = "-abcdefgh"  # vLLM's 9-character engine suffix
assert len(SUFFIX) == 9


# ====================================================================== contributors


def test_contributor_done_when_every_member_reported() -> None:
    tracker = ContributorTracker()
    assert tracker.report("x", 0, 3) is False
    assert tracker.report("x", 0, 3) is False  # duplicate does not advance
    assert tracker.report("x", 2, 3) is False
    assert not tracker.is_complete("x")
    assert "x" in tracker and len(tracker) == 1
    assert tracker.report("x", 1, 3) is True
    assert tracker.is_complete("x")
    assert tracker.report("x", 1, 3) is False  # True exactly once
    assert tracker.report("y", 0, 1) is True
    assert len(tracker) == 2
    tracker.discard("x")
    tracker.discard("y")
    tracker.discard("never-seen")
    assert len(tracker) == 0 and "x" not in tracker
    assert not tracker.is_complete("x")


@pytest.mark.parametrize("ratio", [0, -1, 1])
def test_contributor_ratio_below_one_counts_as_one(ratio: int) -> None:
    tracker = ContributorTracker()
    assert tracker.report("x", 0, ratio) is True
    with pytest.raises(ProtocolError):
        tracker.report("z", 1, ratio)
    tracker.discard("x")
    assert len(tracker) == 0


@pytest.mark.parametrize(("member", "ratio"), [(2, 2), (-1, 2), (5, 1), (1, 0)])
def test_contributor_member_out_of_range(member: int, ratio: int) -> None:
    tracker = ContributorTracker()
    with pytest.raises(ProtocolError):
        tracker.report("x", member, ratio)
    assert len(tracker) == 0


def test_contributor_ratio_change_is_a_protocol_error() -> None:
    tracker = ContributorTracker()
    tracker.report("x", 0, 2)
    with pytest.raises(ProtocolError, match="ratio"):
        tracker.report("x", 1, 3)
    assert not tracker.is_complete("x")
    assert tracker.report("x", 1, 2) is True
    tracker.discard("x")
    assert len(tracker) == 0


@HSETTINGS
@given(st.integers(1, 4), st.lists(st.integers(0, 3), max_size=12))
def test_contributor_completes_exactly_when_the_set_fills(ratio: int, members) -> None:
    tracker = ContributorTracker()
    seen: set[int] = set()
    trues = 0
    for m in members:
        m %= ratio
        fresh = m not in seen
        seen.add(m)
        got = tracker.report("x", m, ratio)
        assert got == (fresh and len(seen) == ratio)
        trues += got
        assert tracker.is_complete("x") == (len(seen) == ratio)
    assert trues == (1 if len(seen) == ratio else 0)
    tracker.discard("x")
    assert len(tracker) == 0


# ====================================================================== merge


def test_merge_tp_reports_table() -> None:
    a = RankReport(frozenset({"x", "y", "z"}), frozenset({"z"}))
    b = RankReport(frozenset({"x", "z"}), frozenset())
    c = RankReport(frozenset({"x", "z", "w"}), frozenset({"w", "x"}))
    assert merge_tp_reports([a, b, c]) == MergedReport(
        frozenset({"x", "z"}), frozenset({"w", "x", "z"})
    )
    assert merge_tp_reports([a]) == MergedReport(a.terminal, a.failed)
    assert merge_tp_reports([]) == MergedReport(frozenset(), frozenset())


@HSETTINGS
@given(
    st.lists(
        st.builds(
            RankReport,
            st.frozensets(st.sampled_from("abcdef")),
            st.frozensets(st.sampled_from("abcdef")),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_merge_is_intersection_of_terminal_and_union_of_failed(reports) -> None:
    merged = merge_tp_reports(reports)
    for x in "abcdef":
        assert (x in merged.finished) == all(x in r.terminal for r in reports)
        assert (x in merged.failed) == any(x in r.failed for r in reports)


# ====================================================================== request book


def step(books: Sequence[DecodeRequestBook], finished_by_vllm=()) -> list[StepOutcome]:
    """One worker step on every Decode rank: exchange reports, then resolve."""
    reports = [b.local_report() for b in books]
    return [b.finish_step(reports, finished_by_vllm) for b in books]


def assert_book_clean(*books: DecodeRequestBook) -> None:
    for book in books:
        assert book.counters() == {
            "admitted": 0, "terminal": 0, "failed": 0, "pending_finished": 0, "aborting": 0,
            "deferred": 0, "contributors": 0, "orphans": 0, "peer_contributions": 0,
        }
        assert len(book.destinations) == 0


EMPTY = StepOutcome(frozenset(), frozenset(), frozenset())


@pytest.mark.parametrize(
    ("internal", "external"),
    [
        ("chatcmpl-42" + SUFFIX, "chatcmpl-42"),
        ("0123456789", "0"),
        ("123456789", "123456789"),  # exactly 9 characters: unchanged
        ("short", "short"),
    ],
)
def test_admit_maps_internal_to_external_id(internal: str, external: str) -> None:
    book = DecodeRequestBook()
    assert book.admit(internal, [1, 2], [3], now=0.0) == external
    dest = book.destination(external)
    assert dest is not None
    assert (dest.main_block_ids.tolist(), dest.indexer_block_ids.tolist()) == ([1, 2], [3])
    assert book.destination(internal) is None or internal == external
    assert list(book.destinations) == [external]
    assert book.destinations[external] is dest
    assert book.record_done([external], 0, 1) == [external]
    assert step([book]) == [StepOutcome(frozenset({internal}), frozenset(), frozenset())]
    assert_book_clean(book)


def test_book_destinations_feed_the_planner() -> None:
    book = DecodeRequestBook()
    ext = book.admit("r1" + SUFFIX, [4, 5], [6, 7], now=0.0)
    src = SourceLayout("L", (TensorComponent(1000, 8),), TensorComponent(5000, 2))
    dst = DestinationLayout("L", (DestTensor(0, 8, 16),), DestTensor(900, 2, 16))
    batch = ReadReadyBatch(0, "L", (ReadRequest(ext, (0, 1), (2, 3)),))
    plan = plan_reads(batch, src, dst, book.destinations, d_rank=0, d_tp=1)
    assert plan.local_addrs.tolist() == [4 * 8, 900 + 6 * 2]
    assert plan.remote_addrs.tolist() == [1000, 5000 + 2 * 2]
    book.record_done([ext], 0, 1)
    step([book])
    assert_book_clean(book)


def test_record_done_with_ratio_two_needs_both_members() -> None:
    book = DecodeRequestBook()
    ext = book.admit("req" + SUFFIX, [1], [2], now=0.0)
    assert book.record_done([ext], 0, 2) == []
    assert book.record_done([ext], 0, 2) == []  # duplicate
    assert step([book]) == [EMPTY]
    assert book.counters()["contributors"] == 1
    assert book.record_done([ext], 1, 2) == [ext]
    assert book.record_done([ext], 1, 2) == []  # already terminal
    assert step([book])[0].finished == {"req" + SUFFIX}
    assert_book_clean(book)


def test_finish_needs_every_rank_terminal() -> None:
    books = [DecodeRequestBook(), DecodeRequestBook()]
    for b in books:
        b.admit("a" + SUFFIX, [1, 2], [3], now=0.0)
        b.admit("b" + SUFFIX, [4], [5], now=0.0)
    books[0].record_done(["a", "b"], 0, 1)
    books[1].record_done(["b"], 0, 1)
    assert [o.finished for o in step(books)] == [{"b" + SUFFIX}] * 2
    assert [o.finished for o in step(books)] == [frozenset()] * 2
    books[1].record_done(["a"], 0, 1)
    outcomes = step(books)
    assert outcomes == [StepOutcome(frozenset({"a" + SUFFIX}), frozenset(), frozenset())] * 2
    assert_book_clean(*books)


def test_failure_on_one_rank_fails_everywhere_and_invalidates_blocks() -> None:
    books = [DecodeRequestBook(), DecodeRequestBook()]
    internal = "req" + SUFFIX
    for b in books:
        b.admit(internal, [10, 11], [20, 21, 22], now=0.0)
    books[1].record_failed(["req"], "read failed: -5")
    first = step(books)
    for o in first:
        # Rank 0 was not terminal yet: not finished, but the blocks are already invalid.
        assert o.finished == frozenset()
        assert o.invalid_block_ids == {10, 11, 20, 21, 22}
        assert all(type(b) is int for b in o.invalid_block_ids)  # plain ints for vLLM
    second = step(books)
    for rank, o in enumerate(second):
        assert o.finished == {internal} and o.failed == {internal}
        assert o.invalid_block_ids == frozenset()  # reported once only
        want = "read failed: -5" if rank == 1 else "failed on another decode rank"
        assert o.reasons == {internal: want}
    assert_book_clean(*books)


def test_failure_and_success_in_the_same_step() -> None:
    books = [DecodeRequestBook(), DecodeRequestBook()]
    for b in books:
        b.admit("r" + SUFFIX, [1], [2], now=0.0)
    books[0].record_done(["r"], 0, 1)
    books[1].record_failed(["r"], "boom")
    for o in step(books):
        assert o.finished == {"r" + SUFFIX} and o.failed == {"r" + SUFFIX}
        assert o.invalid_block_ids == {1, 2}
    assert_book_clean(*books)


def test_finished_before_admission_stays_pending_until_admitted() -> None:
    books = [DecodeRequestBook(), DecodeRequestBook()]
    internal = "late" + SUFFIX
    books[0].admit(internal, [1], [2], now=0.0)
    books[0].record_done(["late"], 0, 1)
    books[1].record_done(["late"], 0, 1)  # rank 1 heard P before its admission
    out = step(books)
    assert out[0].finished == {internal}
    assert out[1].finished == frozenset()
    assert books[1].counters()["pending_finished"] == 1
    assert step(books)[1].finished == frozenset()
    books[1].admit(internal, [1], [2], now=1.0)
    out = step(books)
    assert out[0] == EMPTY
    assert out[1] == StepOutcome(frozenset({internal}), frozenset(), frozenset())
    assert_book_clean(*books)


def test_failed_before_admission_on_another_rank_is_reported_once_admitted() -> None:
    """A failure on rank 0 while rank 1 has not admitted the request yet."""
    books = [DecodeRequestBook(), DecodeRequestBook()]
    internal = "late" + SUFFIX
    books[0].admit(internal, [1, 2], [3], now=0.0)
    books[0].record_failed(["late"], "boom")
    out = step(books)
    assert out[0].invalid_block_ids == {1, 2, 3}
    out = step(books)
    assert out[0].finished == {internal} and out[0].failed == {internal}
    assert out[1] == EMPTY
    for _ in range(3):  # rank 1 is still waiting for its admission
        assert step(books) == [EMPTY, EMPTY]
    books[1].admit(internal, [1, 2], [3], now=1.0)
    out = step(books)
    assert out[0] == EMPTY
    assert out[1].finished == {internal} and out[1].failed == {internal}
    assert out[1].invalid_block_ids == {1, 2, 3}
    for _ in range(3):
        assert step(books) == [EMPTY, EMPTY]
    assert_book_clean(*books)


def test_finished_by_vllm_is_cleaned_after_this_steps_completions() -> None:
    books = [DecodeRequestBook(), DecodeRequestBook()]
    done, partial, failed = "done" + SUFFIX, "part" + SUFFIX, "fail" + SUFFIX
    for b in books:
        for internal in (done, partial, failed):
            b.admit(internal, [1], [2], now=0.0)
        b.record_done(["done"], 0, 1)
        b.record_done(["part"], 1, 2)  # partial contributor state
    books[0].record_failed(["fail"], "boom")
    out = step(books, finished_by_vllm=[done, partial, failed])
    for o in out:
        # 'done' completed this step: it is reported before the cleanup. vLLM aborted
        # 'part' and 'fail' before their KV was reported, and keeps their blocks until
        # the connector names them: with no read in flight, they are reported at once.
        assert o.finished == {done, partial, failed}
        assert o.aborted == {partial, failed}
        # 'fail' was failed on rank 0 only; its blocks are still reported invalid.
        assert o.invalid_block_ids == {1, 2}
    assert_book_clean(*books)
    assert step(books) == [EMPTY, EMPTY]


def test_finished_by_vllm_cleans_state_of_a_request_never_admitted() -> None:
    book = DecodeRequestBook()
    book.record_done(["ghost"], 0, 2)
    book.record_failed(["ghost2"], "no destination")
    assert book.counters()["contributors"] == 1
    step([book], finished_by_vllm=["ghost" + SUFFIX, "ghost2" + SUFFIX])
    assert_book_clean(book)


def test_expire_fails_late_requests() -> None:
    books = [DecodeRequestBook(), DecodeRequestBook()]
    a, b, c = "a" + SUFFIX, "b" + SUFFIX, "c" + SUFFIX
    for book in books:
        book.admit(a, [1], [2], now=0.0)
        book.admit(b, [3], [4], now=5.0)
        book.admit(c, [5], [6], now=0.0)
        book.record_done(["c"], 0, 1)
    assert books[0].expire(now=9.9, timeout=10.0) == []
    assert books[0].expire(now=10.0, timeout=10.0) == ["a"]
    assert books[0].expire(now=12.0, timeout=10.0) == []  # already terminal
    out = step(books)
    for o in out:
        assert o.finished == {c}
        assert o.invalid_block_ids == {1, 2}
    out = step(books)
    assert out[0].finished == {a} and out[0].failed == {a}
    assert "10 s" in out[0].reasons[a]
    assert out[1].failed == {a}
    assert books[1].expire(now=15.0, timeout=10.0) == ["b"]
    step(books)
    out = step(books)
    assert all(o.finished == {b} and o.failed == {b} for o in out)
    assert_book_clean(*books)


# A random interleaving over 1-3 Decode ranks, checked against the completion rules.


@st.composite
def book_scripts(draw):
    n_ranks = draw(st.integers(1, 3))
    n_reqs = draw(st.integers(1, 4))
    ratios = [draw(st.integers(0, 3)) for _ in range(n_reqs)]
    op = st.tuples(
        st.sampled_from(["admit", "done", "done", "fail", "step", "step"]),
        st.integers(0, n_reqs - 1),
        st.integers(0, n_ranks - 1),
        st.integers(0, 2),
    )
    return n_ranks, ratios, draw(st.lists(op, max_size=40))


@settings(deadline=None, max_examples=300)
@given(book_scripts())
def test_request_book_random_interleavings(script) -> None:
    n_ranks, ratios, ops = script
    books = [DecodeRequestBook() for _ in range(n_ranks)]
    internal = [f"req{i}" + SUFFIX for i in range(len(ratios))]
    ext = [f"req{i}" for i in range(len(ratios))]
    main_ids = [[100 + 10 * i, 101 + 10 * i] for i in range(len(ratios))]
    idx_ids = [[500 + 10 * i] for i in range(len(ratios))]
    block_owner = {b: i for i in range(len(ratios)) for b in main_ids[i] + idx_ids[i]}
    admitted = [[False] * len(ratios) for _ in range(n_ranks)]
    failed_anywhere = [False] * len(ratios)
    all_terminal_at: list[int | None] = [None] * len(ratios)  # step all ranks were terminal
    finished_at = [[None] * len(ratios) for _ in range(n_ranks)]
    invalid_at = [[None] * len(ratios) for _ in range(n_ranks)]
    step_no = 0

    def admit(rank: int, i: int) -> None:
        if not admitted[rank][i]:
            admitted[rank][i] = True
            books[rank].admit(internal[i], main_ids[i], idx_ids[i], now=0.0)

    def run_step() -> None:
        nonlocal step_no
        step_no += 1
        reports = [b.local_report() for b in books]
        merged = merge_tp_reports(reports)
        for i in range(len(ratios)):
            if all_terminal_at[i] is None and ext[i] in merged.finished:
                all_terminal_at[i] = step_no
        for rank, book in enumerate(books):
            out = book.finish_step(reports)
            assert out.failed <= out.finished
            for b in out.invalid_block_ids:
                i = block_owner[b]
                assert failed_anywhere[i], "blocks of a request that did not fail"
                assert invalid_at[rank][i] in (None, step_no)
                invalid_at[rank][i] = step_no
            for name in out.finished:
                i = internal.index(name)
                assert finished_at[rank][i] is None, "reported finished twice"
                assert all_terminal_at[i] is not None, "finished before every rank was terminal"
                assert admitted[rank][i]
                finished_at[rank][i] = step_no
                assert (name in out.failed) == failed_anywhere[i]
                if failed_anywhere[i]:
                    assert invalid_at[rank][i] is not None, "failed blocks never reported"
                    assert name in out.reasons

    for kind, i, rank, member in ops:
        if kind == "admit":
            admit(rank, i)
        elif kind == "step":
            run_step()
        elif all_terminal_at[i] is None:  # no records once the request resolved
            if kind == "done":
                books[rank].record_done([ext[i]], member % max(1, ratios[i]), ratios[i])
            else:
                books[rank].record_failed([ext[i]], "boom")
                failed_anywhere[i] = True

    # Everything arrives: every rank admits and hears every contributor.
    for rank in range(n_ranks):
        for i in range(len(ratios)):
            admit(rank, i)
            if all_terminal_at[i] is None:
                for m in range(max(1, ratios[i])):
                    books[rank].record_done([ext[i]], m, ratios[i])
    for _ in range(3):
        run_step()
    for rank in range(n_ranks):
        assert all(f is not None for f in finished_at[rank]), "a request never finished"
    assert_book_clean(*books)


def test_failures_for_never_admitted_requests_expire() -> None:
    """A READ_FAILED naming a request this rank never admitted (or already forgot)
    must not leave state behind forever."""
    book = DecodeRequestBook()
    book.record_failed(["ghost"], "no destination blocks", now=100.0)
    out = book.finish_step([book.local_report()])
    assert out.finished == frozenset()
    assert book.expire(now=110.0, timeout=30.0) == []
    assert book.counters()["orphans"] == 1
    book.expire(now=131.0, timeout=30.0)
    assert all(v == 0 for v in book.counters().values()), book.counters()


def test_late_admission_of_a_failed_request_is_still_reported() -> None:
    book = DecodeRequestBook()
    book.record_failed(["late"], "read failed", now=1.0)
    book.finish_step([book.local_report()])
    book.admit("late" + "s" * 9, [4, 5], [6], now=2.0)
    book.expire(now=3.0, timeout=30.0)
    out = book.finish_step([book.local_report()])
    assert out.finished == {"late" + "s" * 9} and out.failed == {"late" + "s" * 9}
    assert out.invalid_block_ids == {4, 5, 6}
    assert all(v == 0 for v in book.counters().values()), book.counters()
