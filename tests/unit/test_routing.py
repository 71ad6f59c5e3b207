"""Instance pools (health, ejection, back-off, drain, picking) and prefix affinity."""

from __future__ import annotations

import random

import pytest

from rd2h.proxy.affinity import PrefixAffinity, prompt_text
from rd2h.proxy.routing import Failure, HealthRules, InstancePool, Policy

URLS = ["http://a:1", "http://b:1", "http://c:1"]


def pool(policy: Policy = Policy.LEAST_OUTSTANDING, **rules: float) -> InstancePool:
    return InstancePool.of("decode", URLS, policy=policy, rules=HealthRules(**rules),
                           rng=random.Random(0))


def test_least_outstanding_picks_the_least_loaded_and_rotates_ties() -> None:
    p = pool()
    picks = [p.pick().url for _ in range(3)]
    assert sorted(picks) == URLS  # equal loads: each in turn
    a = p.get(URLS[0])
    for _ in range(2):
        p.started(a)
    p.started(p.get(URLS[1]))
    assert {p.pick().url for _ in range(4)} == {URLS[2]}
    p.ended(a)
    p.ended(a)
    assert p.get(URLS[0]).in_flight == 0


def test_round_robin_ignores_load_and_power_of_two_prefers_the_lighter() -> None:
    rr = pool(Policy.ROUND_ROBIN)
    rr.started(rr.get(URLS[0]))
    assert [rr.pick().url for _ in range(3)] == URLS
    p2 = pool(Policy.POWER_OF_TWO)
    for _ in range(10):
        p2.started(p2.get(URLS[0]))
    picks = [p2.pick().url for _ in range(200)]
    # The loaded one can never win a pair; the other two split the picks.
    assert URLS[0] not in picks and {URLS[1], URLS[2]} == set(picks)


def test_refused_connection_ejects_at_once_errors_after_a_run() -> None:
    p = pool(eject_after=3)
    a, b = p.get(URLS[0]), p.get(URLS[1])
    assert p.failed(a, Failure.CONNECT, "refused", now=0.0) is not None
    assert not a.pickable and a.state == "ejected"
    for _ in range(2):
        assert p.failed(b, Failure.ERROR, "HTTP 500", now=0.0) is None
    p.succeeded(b)  # a good answer starts the count again
    for _ in range(2):
        assert p.failed(b, Failure.ERROR, "HTTP 500", now=0.0) is None
    ejection = p.failed(b, Failure.ERROR, "HTTP 500", now=0.0)
    assert ejection is not None and ejection.cause is Failure.ERROR
    assert [i.url for i in p.pickable()] == [URLS[2]]
    assert all(p.pick().url == URLS[2] for _ in range(3))


def test_late_probes_eject_after_a_run_of_their_own() -> None:
    p = pool(eject_after=3, probe_timeouts=2)
    a = p.get(URLS[0])
    # A late probe, then a good one: the count starts again; never ejected.
    for _ in range(5):
        assert p.failed(a, Failure.PROBE_TIMEOUT, "late", now=0.0) is None
        assert not p.probed(a, 0.0) and a.pickable  # healthy: nothing to readmit
    # A request served well starts it again too.
    assert p.failed(a, Failure.PROBE_TIMEOUT, "late", now=0.0) is None
    p.succeeded(a)
    assert p.failed(a, Failure.PROBE_TIMEOUT, "late", now=0.0) is None
    # Request failures are a run of their own: two 5xx and a late probe eject nothing.
    for _ in range(2):
        assert p.failed(a, Failure.ERROR, "HTTP 500", now=0.0) is None
    assert a.pickable and (a.failures_in_row, a.probe_timeouts_in_row) == (2, 1)
    ejection = p.failed(a, Failure.PROBE_TIMEOUT, "late again", now=0.0)
    assert ejection is not None and ejection.cause is Failure.PROBE_TIMEOUT
    assert not a.pickable and a.last_error == "probe_timeout: late again"
    # Late while out pushes readmission back; a good probe after it readmits.
    p.failed(a, Failure.PROBE_TIMEOUT, "late", now=0.5)
    assert not p.probed(a, 1.2) and p.probed(a, 1.6)
    assert (a.failures_in_row, a.probe_timeouts_in_row) == (0, 0)
    # A failed probe (not a late one) still ejects at once.
    assert p.failed(p.get(URLS[1]), Failure.PROBE, "HTTP 500", now=0.0) is not None
    with pytest.raises(ValueError, match="probe_timeouts"):
        HealthRules(probe_timeouts=0)


def test_backoff_doubles_while_failing_and_a_probe_readmits_after_it() -> None:
    p = pool(eject_base_s=1.0, eject_max_s=3.0)
    a = p.get(URLS[0])
    backoffs = []
    now = 0.0
    for _ in range(4):
        ejection = p.failed(a, Failure.PROBE, "down", now)
        backoffs.append(ejection.backoff_s)
        assert not p.probed(a, now + ejection.backoff_s - 0.01)  # too early
        now += ejection.backoff_s
        assert p.probed(a, now) and a.pickable  # readmitted, still on probation
    assert backoffs == [1.0, 2.0, 3.0, 3.0]
    p.succeeded(a)  # served well: the next ejection starts from the base again
    assert p.failed(a, Failure.CONNECT, "refused", now).backoff_s == 1.0
    # Failing while out pushes readmission back.
    p.failed(a, Failure.PROBE, "still down", now + 0.5)
    assert not p.probed(a, now + 1.0)


def test_with_nothing_to_route_to_the_first_good_probe_readmits_at_once() -> None:
    p = pool(eject_base_s=1.0, eject_max_s=30.0)
    a, b, c = (p.get(u) for u in URLS)
    for inst in (b, c):
        p.failed(inst, Failure.CONNECT, "refused", 0.0)
    now = 0.0
    for _ in range(6):  # a down for a while: each failed probe pushes its back-off
        p.failed(a, Failure.PROBE, "down", now)
        now += 2.0
    now -= 1.5  # its first good probe comes within its back-off
    assert a.ejected_until > now and not p.ready()
    # Nothing pickable: the back-off does not hold the first instance that answers.
    assert p.probed(a, now) and a.pickable
    # Now a serves: b's back-off holds again.
    assert not p.probed(b, 0.5) and not b.pickable
    assert p.probed(b, 1.0)
    # A draining instance does not count as one to route to.
    p.drain(URLS[0])
    p.drain(URLS[1])
    p.failed(c, Failure.PROBE, "down", now)
    assert not p.ready() and p.probed(c, now) and c.pickable


def test_drain_and_remove_take_new_requests_away_but_not_running_ones() -> None:
    p = pool()
    a = p.get(URLS[0])
    p.started(a)
    p.drain(URLS[0])
    assert a.state == "draining" and URLS[0] not in {p.pick().url for _ in range(6)}
    p.ended(a)
    assert a.state == "drained"
    p.add(URLS[0])  # taken back
    assert a.pickable
    b = p.get(URLS[1])
    p.started(b)
    p.remove(URLS[1])
    assert p.find(URLS[1]) is b and not b.pickable  # still counted until it ends
    p.ended(b)
    assert p.find(URLS[1]) is None
    with pytest.raises(KeyError, match="no decode instance"):
        p.drain("http://nope:1")


def test_no_pickable_instance_and_readiness() -> None:
    p = pool()
    for url in URLS:
        p.failed(p.get(url), Failure.CONNECT, "refused", 0.0)
    assert p.pick() is None and not p.ready()


def test_health_rules_are_validated() -> None:
    with pytest.raises(ValueError, match="eject_after"):
        HealthRules(eject_after=0)
    with pytest.raises(ValueError, match="eject_base_s"):
        HealthRules(eject_base_s=5.0, eject_max_s=1.0)


def test_prompt_text_of_each_request_form() -> None:
    assert prompt_text({"prompt": "abc"}) == "abc"
    assert prompt_text({"prompt": [1, 2]}) == "1,2,"
    assert prompt_text({"prompt": ["a", "b"]}) is None  # a list: no single key
    chat = prompt_text({"messages": [{"role": "user", "content": "hi"}]})
    longer = prompt_text({"messages": [{"role": "user", "content": "hi"},
                                       {"role": "assistant", "content": "yo"}]})
    assert chat is not None and longer is not None and longer.startswith(chat)


def test_affinity_finds_the_longest_known_prefix() -> None:
    aff = PrefixAffinity(chunk_chars=4, max_entries=100)
    aff.record("aaaabbbbcccc", "http://d0:1")
    aff.record("aaaaxxxx", "http://d1:1")
    assert aff.lookup("aaaabbbbccccdddd") == ("http://d0:1", 12)  # a second turn
    assert aff.lookup("aaaaxxxxyy") == ("http://d1:1", 8)
    assert aff.lookup("aaaazzzz") == ("http://d1:1", 4)  # the last to serve "aaaa"
    assert aff.lookup("zzzz") is None and aff.lookup("aaa") is None  # under one chunk
    assert aff.forget("http://d1:1") == 2
    assert aff.lookup("aaaaxxxx") is None


def test_affinity_table_is_bounded() -> None:
    aff = PrefixAffinity(chunk_chars=2, max_chunks=3, max_entries=5)
    for i in range(50):
        aff.record(f"{i:02d}" * 10, f"http://d{i}:1")
    assert len(aff) <= 5
    assert aff.lookup("49" * 10) == ("http://d49:1", 6)  # max_chunks bounds the depth
