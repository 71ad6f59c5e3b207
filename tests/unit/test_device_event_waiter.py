"""The Prefill sender's device-event waiter: a layer whose work is complete at record
time (CPU tensors: ``CpuDeviceEvents.record()`` is None) is announced without waking
the waiting thread; a real event still goes through it, in announcement order."""

from __future__ import annotations

import threading
import time

from fakes.threads import voluntary_switches

from rd2h.adapters.torch.events import CpuDeviceEvents
from rd2h.app.clock import MonotonicClock
from rd2h.app.prefill_device import DeviceEventWaiter


class _CountingCondition(threading.Condition):
    def __init__(self) -> None:
        super().__init__()
        self.notified = 0

    def notify_all(self) -> None:
        self.notified += 1
        super().notify_all()


class _SlowEvent:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def wait(self, timeout: float) -> bool:
        time.sleep(min(self.seconds, timeout))
        return self.seconds <= timeout


def test_cpu_layers_are_done_at_once_without_waking_the_thread() -> None:
    cond = _CountingCondition()
    wakes: list[int] = []
    waiter = DeviceEventWaiter(cond, MonotonicClock(), lambda aid: time.monotonic() + 5,
                               lambda: wakes.append(1))
    events = CpuDeviceEvents()
    with cond:
        for aid in range(4):
            waiter.add(aid, events.record())
        assert waiter.has_done and waiter.pending == 4
        assert waiter.take_done() == [0, 1, 2, 3]
    assert cond.notified == 0 and wakes == []  # no thread was started or woken


def test_a_real_event_keeps_order_and_a_later_cpu_layer_waits_behind_it() -> None:
    cond = _CountingCondition()
    woke = threading.Event()
    waiter = DeviceEventWaiter(cond, MonotonicClock(), lambda aid: time.monotonic() + 5,
                               woke.set)
    waiter.start("test-events")
    with cond:
        waiter.add(0, _SlowEvent(0.05))
        waiter.add(1, CpuDeviceEvents().record())  # complete, but announced after 0
        assert waiter.take_done() == []
    assert woke.wait(5)
    deadline = time.monotonic() + 5
    done: list[int] = []
    while len(done) < 2 and time.monotonic() < deadline:
        with cond:
            done += waiter.take_done()
        time.sleep(0.01)
    assert done == [0, 1]
    with cond:
        waiter.close()


def _helper(name: str) -> threading.Thread:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        for t in threading.enumerate():
            if t.name == name:
                return t
        time.sleep(0.005)
    raise AssertionError(f"no thread {name}")


def test_the_senders_own_notifications_do_not_wake_the_helper() -> None:
    """The helper sleeps on a condition of its own (the sender's lock): the sender's
    loop notifies ``cond`` once per pass, and that must not wake an idle helper."""
    lock = threading.RLock()
    cond = threading.Condition(lock)
    woke = threading.Event()
    waiter = DeviceEventWaiter(cond, MonotonicClock(), lambda aid: time.monotonic() + 5,
                               woke.set, work=threading.Condition(lock))
    waiter.start("test-events-own")
    tid = _helper("test-events-own").native_id
    time.sleep(0.05)  # asleep
    before = voluntary_switches(tid)
    for _ in range(50):
        with cond:
            cond.notify_all()
        time.sleep(0.002)
    assert voluntary_switches(tid) - before <= 2  # 50 with one condition for both
    with cond:
        waiter.add(0, _SlowEvent(0.01))  # real work still wakes it at once
    assert woke.wait(2)
    with cond:
        assert waiter.take_done() == [0]
        waiter.close()
