"""The demo's Decode ranks stop stepping after the same step (steps are collectives).

A request can end on one rank a step before another (held there while a read into it
is in flight); a rank that stopped on its own count left the others' next all-gather
waiting for it until the exchange deadline (CI saw a request end 10 s late).
"""

from __future__ import annotations

import threading

from rd2h.adapters.torch.exchange import InMemoryExchangeGroup
from rd2h.demo.decode_rank import _DoneFlags


def _run(done_after: list[int], timeout: float = 2.0) -> tuple[list[int], list[BaseException]]:
    """Each rank steps until the gathered flags say every rank is done; rank r has all
    its outcomes after step ``done_after[r]``. Returns the steps each rank took."""
    group = InMemoryExchangeGroup(len(done_after))
    steps = [0] * len(done_after)
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        flags = _DoneFlags(group.member(r))
        try:
            while not flags.all_done:
                reports = flags.all_gather(f"report {r}", timeout)
                assert reports == [f"report {i}" for i in range(len(done_after))]
                steps[r] += 1
                if steps[r] >= done_after[r]:
                    flags.done = True
        except BaseException as exc:  # handed to the test thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(done_after))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return steps, errors


def test_a_rank_done_early_keeps_stepping_until_every_rank_is_done() -> None:
    steps, errors = _run([1, 4])
    assert errors == []
    assert steps == [5, 5]  # the step after the last rank finished tells everyone


def test_every_rank_stops_after_the_same_step_whatever_the_order() -> None:
    for done_after in ([3, 1, 2], [2, 2, 2], [1, 1, 6]):
        steps, errors = _run(done_after)
        assert errors == [], done_after
        assert len(set(steps)) == 1 and steps[0] == max(done_after) + 1, (done_after, steps)


def test_the_wrapper_hands_the_reports_through_and_keeps_the_rank() -> None:
    group = InMemoryExchangeGroup(1)
    flags = _DoneFlags(group.member(0))
    assert (flags.rank, flags.world_size) == (0, 1)
    assert flags.all_gather({"x": 1}, 1.0) == [{"x": 1}]
    assert not flags.all_done
    flags.done = True
    flags.all_gather(None, 1.0)
    assert flags.all_done
