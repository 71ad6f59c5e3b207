"""Prefill's request book alone, sans IO: tickets, withheld sends, skips, releases,
the settle's open tickets and the held gauges. Every scenario ends with the book
empty: ``PrefillRequestBook.counters()`` all zero.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rd2h.domain.prefill.prefill_book import (
    Announced,
    PrefillRequestBook,
    RequestFailed,
    RequestSkipped,
    RequestWithheld,
    StepSends,
)

D1, D2 = "tcp://d1:7000", "tcp://d2:7000"


def _empty(book: PrefillRequestBook) -> None:
    assert book.counters() == {"requests": 0, "tickets": 0}
    assert book.held() == {"held_requests": 0, "held_blocks": 0}


def test_tickets_resolve_in_order_and_release_waits_for_the_last() -> None:
    book = PrefillRequestBook()
    assert book.start_step([("a", 2)]) == StepSends(frozenset({"a"}))
    assert book.announce(0, {D1: [("a", "A")]}) == Announced(first=("a",))
    assert book.announce(1, {D1: [("a", "A")]}, final=["a"]) == Announced(final=("a",))
    assert book.counters() == {"requests": 1, "tickets": 2}
    assert book.open_tickets(["a"]) == {"a": 2}
    assert book.record_answers([(0, D1, None)], {}) == []
    assert book.open_tickets(["a"]) == {"a": 1}
    assert book.release(["a"]) == ()  # vLLM finished it, one announcement still open
    assert book.record_answers([(1, D1, None)], {}) == []
    assert book.release([]) == ("a",)  # the finish is remembered
    assert book.requests_failed == 0 and book.requests_skipped == 0
    _empty(book)


def test_release_waits_for_vllm_to_finish_the_request() -> None:
    book = PrefillRequestBook()
    book.start_step([("a", 1), ("b", 1)])
    book.announce(0, {D1: [("a", "A"), ("b", "B")]})
    book.resolve((0, D1), None)
    assert book.release([]) == ()  # every ticket answered, vLLM still computes
    assert book.release(["b", "never-seen"]) == ("b",)
    assert book.release(["a"]) == ("a",)
    assert book.release(["a"]) == ()  # released once
    _empty(book)


def test_a_slow_endpoint_holds_back_only_the_requests_it_reads() -> None:
    book = PrefillRequestBook()
    book.start_step([("a", 1), ("b", 1)])
    news = book.announce(0, {D1: [("a", "A")], D2: [("b", "B")]}, final=["a", "b"])
    assert news == Announced(first=("a", "b"), final=("a", "b"))
    assert book.counters()["tickets"] == 2
    book.resolve((0, D2), None)
    assert book.release(["a", "b"]) == ("b",)
    assert book.open_tickets(["a", "b"]) == {"a": 1}
    book.resolve((0, D1), None)
    assert book.release([]) == ("a",)
    _empty(book)


def test_a_request_named_twice_for_one_endpoint_holds_one_ticket() -> None:
    book = PrefillRequestBook()
    book.start_step([("a", 1)])
    assert book.announce(0, {D1: [("a", "A"), ("a", "A")]}).first == ("a",)
    assert book.open_tickets(["a"]) == {"a": 1}
    assert book.resolve((0, D1), "boom") == [RequestFailed("a", "boom")]
    assert book.release(["a"]) == ("a",)
    _empty(book)


def test_a_failed_announcement_withholds_later_sends() -> None:
    book = PrefillRequestBook()
    assert book.start_step([("a", 2), ("b", 2)]).kept == {"a", "b"}
    book.announce(0, {D1: [("a", "A"), ("b", "B")]})
    book.announce(1, {D1: [("a", "A")]})
    events = book.record_answers([(0, D1, None), (1, D1, "read failed")], {})
    assert events == [RequestFailed("a", "read failed")]
    assert book.errors(["a", "b", "c"]) == {"a": "read failed"}
    step = book.start_step([("a", 4), ("b", 4)])
    assert step == StepSends(frozenset({"b"}), (RequestWithheld("a", "read failed"),))
    # Withheld once: the next step keeps it out without a new event.
    assert book.start_step([("a", 6), ("b", 6)]) == StepSends(frozenset({"b"}))
    # Withheld sends add nothing to the held gauge.
    assert book.held() == {"held_requests": 2, "held_blocks": 2 + 6}
    # A request fails (and is counted) once, however many of its tickets fail.
    book.announce(2, {D1: [("a", "A"), ("b", "B")]})
    assert book.resolve((2, D1), "endpoint lost") == [RequestFailed("b", "endpoint lost")]
    assert book.requests_failed == 2
    assert book.errors(["a"]) == {"a": "read failed"}
    assert book.release(["a", "b"]) == ("a", "b")
    _empty(book)


def test_a_send_that_failed_to_go_fails_every_endpoint_of_its_ticket() -> None:
    book = PrefillRequestBook()
    book.start_step([("a", 1), ("b", 1)])
    book.announce(7, {D1: [("a", "A")], D2: [("b", "B")]})
    failed = [e for ep in (D1, D2) for e in book.resolve((7, ep), "send failed")]
    assert failed == [RequestFailed("a", "send failed"), RequestFailed("b", "send failed")]
    assert book.resolve((7, D1), None) == []  # a ticket resolves once
    assert book.start_step([("a", 2), ("b", 2)]).kept == frozenset()
    assert book.release(["a", "b"]) == ("a", "b")
    _empty(book)


def test_decode_skipped_requests_get_no_more_sends() -> None:
    book = PrefillRequestBook()
    book.start_step([("a", 1), ("b", 1)])
    book.announce(0, {D1: [("a", "A"), ("b", "B")]})
    events = book.record_answers([(0, D1, None)], {(0, D1): ("B", "unknown-ext")})
    assert events == [RequestSkipped("b", D1)]
    assert book.requests_skipped == 1 and book.requests_failed == 0
    assert "no longer reads" in book.errors(["b"])["b"]
    step = book.start_step([("a", 2), ("b", 2)])
    assert step.kept == {"a"} and [w.request for w in step.withheld] == ["b"]
    book.announce(1, {D1: [("a", "A")]}, final=["a"])
    # A skip on a ticket already resolved, or of a request that already failed, is news
    # to nobody.
    assert book.skip((0, D1), ("A",)) == []
    assert book.record_answers([(1, D1, "late failure")], {(1, D1): ("A",)}) == [
        RequestSkipped("a", D1)]
    assert book.requests_skipped == 2 and book.requests_failed == 0
    assert book.release(["a", "b"]) == ("a", "b")
    _empty(book)


def test_answers_report_in_the_order_they_came() -> None:
    book = PrefillRequestBook()
    book.start_step([("a", 1), ("b", 1), ("c", 1)])
    book.announce(0, {D1: [("a", "A")], D2: [("b", "B"), ("c", "C")]})
    events = book.record_answers([(0, D2, "gone"), (0, D1, "boom")], {(0, D2): ("C",)})
    assert events == [RequestSkipped("c", D2), RequestFailed("b", "gone"),
                      RequestFailed("a", "boom")]
    assert book.release(["a", "b", "c"]) == ("a", "b", "c")
    _empty(book)


def test_settle_open_tickets_count_only_the_requests_asked() -> None:
    book = PrefillRequestBook()
    book.start_step([("a", 1), ("b", 1), ("c", 1)])
    book.announce(0, {D1: [("a", "A"), ("b", "B")], D2: [("a", "A")]})
    book.announce(1, {D1: [("a", "A")]})
    assert book.open_tickets(["a", "b", "c", "x"]) == {"a": 3, "b": 1}
    assert book.open_tickets(["b"]) == {"b": 1}
    book.resolve((0, D1), None)
    assert book.open_tickets(["a", "b"]) == {"a": 2}
    book.resolve((0, D2), None)
    book.resolve((1, D1), "failed")
    assert book.open_tickets(["a", "b", "c"]) == {}
    assert book.errors(["a", "b", "c"]) == {"a": "failed"}
    assert book.release(["a", "b", "c"]) == ("a", "b", "c")
    _empty(book)


def test_held_gauges_follow_the_announced_blocks() -> None:
    book = PrefillRequestBook()
    _empty(book)
    book.start_step([("a", 3), ("b", 1)])
    assert book.held() == {"held_requests": 2, "held_blocks": 4}
    book.start_step([("a", 2)])  # a smaller send never lowers the gauge
    book.start_step([("a", 5), ("b", 4)])
    assert book.held() == {"held_requests": 2, "held_blocks": 9}
    assert book.release(["b"]) == ("b",)
    assert book.held() == {"held_requests": 1, "held_blocks": 5}
    assert book.release(["a"]) == ("a",)
    _empty(book)


@settings(deadline=None, max_examples=150)
@given(
    layers=st.lists(st.sets(st.sampled_from("abc"), min_size=1), min_size=1, max_size=5),
    errors=st.lists(st.booleans(), min_size=5, max_size=5),
    order=st.permutations(range(5)),
    early=st.sets(st.sampled_from("abc")),
)
def test_any_answer_order_releases_everything_exactly_once(
    layers: list[set[str]], errors: list[bool], order: list[int], early: set[str]
) -> None:
    book = PrefillRequestBook()
    rids = sorted(set().union(*layers))
    book.start_step([(rid, 1) for rid in rids])
    for ticket, rs in enumerate(layers):
        book.announce(ticket, {D1: [(rid, rid.upper()) for rid in sorted(rs)]})
    released = list(book.release(early))  # vLLM finished some before any answer
    assert all(not any(rid in rs for rs in layers) for rid in released)
    failed: set[str] = set()
    for ticket in (t for t in order if t < len(layers)):
        error = "boom" if errors[ticket] else None
        for e in book.resolve((ticket, D1), error):
            failed.add(e.request)
        released += book.release([])
        open_now = book.open_tickets(rids)
        for rid in released:
            assert rid in early and rid not in open_now
    released += book.release(rids)
    assert sorted(released) == rids
    assert book.requests_failed == len(failed)
    _empty(book)
