"""Which engine instance ``rd2h proxy`` sends a request to: health, ejection, drain and
picking, without sockets or clocks of its own (the HTTP adapter passes ``now``).

Every instance of one role (Prefill or Decode) is in an ``InstancePool``. An instance
is *pickable* while it is healthy, not draining and not removed. It stops being
healthy when it fails: a refused connection or a failed ``/health`` probe (refused,
unreachable, or not 200) ejects it at once; a probe that connected but got no answer in
time ejects it when ``probe_timeouts`` probes in a row did so (a busy API server can
answer one probe late; a hung one answers none); other failures (a 5xx answer, a
timeout, a broken stream) eject it after ``eject_after`` in a row. An ejected
instance stays out for a back-off that doubles with each ejection in a row
(``eject_base_s`` up to ``eject_max_s``) and is readmitted by the first successful
probe after that; a request it then serves well resets the back-off. The back-off holds
only while another instance of the role can serve: with none pickable, the first
successful probe readmits an ejected instance at once (a restarted engine serves again
within one probe interval of answering ``/health``; a hung one stays out, since its
probes time out).

Picking policies (per role): ``least_outstanding`` (the fewest requests the proxy has
in flight there; ties rotate), ``power_of_two`` (two pickable instances at random,
the less loaded one), ``round_robin``. With engine metrics (scraped by the adapter) a
load is the proxy's in-flight count plus the engine's waiting requests, and ties go
to the lower KV cache usage.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum


class Policy(str, Enum):
    LEAST_OUTSTANDING = "least_outstanding"
    POWER_OF_TWO = "power_of_two"
    ROUND_ROBIN = "round_robin"


class Failure(str, Enum):
    """Why a request or probe to an instance failed (the ejection cause)."""

    CONNECT = "connect"  # refused or unreachable: ejected at once
    PROBE = "probe"  # /health refused, unreachable or not 200: ejected at once
    PROBE_TIMEOUT = "probe_timeout"  # /health connected, no answer in time
    ERROR = "error"  # a 5xx answer
    TIMEOUT = "timeout"
    BROKEN = "broken"  # the answer's stream broke

    @property
    def ejects_at_once(self) -> bool:
        return self in (Failure.CONNECT, Failure.PROBE)


@dataclass(frozen=True)
class HealthRules:
    eject_after: int = 5
    eject_base_s: float = 1.0
    eject_max_s: float = 30.0
    probe_timeouts: int = 2

    def __post_init__(self) -> None:
        if self.eject_after < 1:
            raise ValueError(f"eject_after must be >= 1, not {self.eject_after}")
        if self.probe_timeouts < 1:
            raise ValueError(f"probe_timeouts must be >= 1, not {self.probe_timeouts}")
        if not 0 < self.eject_base_s <= self.eject_max_s:
            raise ValueError(f"need 0 < eject_base_s ({self.eject_base_s}) <= eject_max_s "
                             f"({self.eject_max_s})")


@dataclass
class Instance:
    url: str
    role: str
    healthy: bool = True
    draining: bool = False
    removed: bool = False
    in_flight: int = 0
    served: int = 0
    failures_in_row: int = 0
    probe_timeouts_in_row: int = 0
    ejections_in_row: int = 0
    ejected_until: float = 0.0
    ejections: int = 0
    last_error: str | None = None
    # From the engine's own /metrics when the adapter scrapes them (None: unknown).
    engine_waiting: float | None = None
    engine_kv_usage: float | None = None

    @property
    def pickable(self) -> bool:
        return self.healthy and not self.draining and not self.removed

    @property
    def state(self) -> str:
        if self.removed:
            return "removed"
        if self.draining:
            return "drained" if self.in_flight == 0 else "draining"
        return "admitted" if self.healthy else "ejected"

    def load(self) -> float:
        return self.in_flight + (self.engine_waiting or 0.0)

    def status(self, now: float) -> dict[str, object]:
        return {
            "url": self.url, "role": self.role, "state": self.state, "healthy": self.healthy,
            "draining": self.draining, "in_flight": self.in_flight, "served": self.served,
            "ejections": self.ejections, "last_error": self.last_error,
            "readmit_after_s": round(max(0.0, self.ejected_until - now), 3)
            if not self.healthy else 0.0,
            "engine_waiting": self.engine_waiting, "engine_kv_usage": self.engine_kv_usage,
        }


@dataclass
class Ejection:
    """An instance left the pickable set (for the log and the ejection counter)."""

    url: str
    cause: Failure
    backoff_s: float


@dataclass
class InstancePool:
    role: str
    policy: Policy = Policy.LEAST_OUTSTANDING
    rules: HealthRules = field(default_factory=HealthRules)
    rng: random.Random = field(default_factory=random.Random)
    _instances: dict[str, Instance] = field(default_factory=dict)
    _turn: int = 0

    @classmethod
    def of(cls, role: str, urls: Iterable[str], **kw: object) -> InstancePool:
        pool = cls(role, **kw)  # type: ignore[arg-type]
        for url in urls:
            pool.add(url)
        return pool

    # -- membership
    def add(self, url: str) -> Instance:
        """Add ``url`` (admitted); an instance being drained or removed is taken back."""
        inst = self._instances.get(url)
        if inst is None:
            inst = self._instances[url] = Instance(url, self.role)
        inst.draining = inst.removed = False
        return inst

    def remove(self, url: str) -> Instance:
        """Take ``url`` out at once: no new requests; requests in flight finish."""
        inst = self.get(url)
        inst.removed = True
        self._forget_if_idle(inst)
        return inst

    def drain(self, url: str) -> Instance:
        inst = self.get(url)
        inst.draining = True
        return inst

    def get(self, url: str) -> Instance:
        inst = self._instances.get(url)
        if inst is None:
            raise KeyError(f"no {self.role} instance {url!r} (known: {sorted(self._instances)})")
        return inst

    def find(self, url: str) -> Instance | None:
        return self._instances.get(url)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self._instances.values()))

    def __len__(self) -> int:
        return len(self._instances)

    def pickable(self) -> list[Instance]:
        return [i for i in self._instances.values() if i.pickable]

    def ready(self) -> bool:
        return any(i.pickable for i in self._instances.values())

    # -- picking
    def pick(self, exclude: Iterable[str] = ()) -> Instance | None:
        """An instance for the next request by the pool's policy; None when none is
        pickable (apart from ``exclude``)."""
        skip = set(exclude)
        ready = [i for i in self._instances.values() if i.pickable and i.url not in skip]
        if not ready:
            return None
        k = self._turn % len(ready)
        self._turn += 1
        rotated = ready[k:] + ready[:k]
        if self.policy is Policy.ROUND_ROBIN:
            return rotated[0]
        if self.policy is Policy.POWER_OF_TWO and len(ready) > 2:
            rotated = self.rng.sample(ready, 2)
        return min(rotated, key=_load_key)

    def not_overloaded(self, inst: Instance, slack: float) -> bool:
        """Pickable, and its load within ``slack`` of the least loaded pickable one."""
        if not inst.pickable:
            return False
        least = min(i.load() for i in self._instances.values() if i.pickable)
        return inst.load() <= least + slack

    # -- requests and probes
    def started(self, inst: Instance) -> None:
        inst.in_flight += 1

    def ended(self, inst: Instance) -> None:
        inst.in_flight = max(0, inst.in_flight - 1)
        self._forget_if_idle(inst)

    def succeeded(self, inst: Instance) -> None:
        """A request this instance served well: its failure counts start again."""
        inst.served += 1
        inst.failures_in_row = inst.probe_timeouts_in_row = 0
        if inst.healthy:
            inst.ejections_in_row = 0

    def failed(self, inst: Instance, cause: Failure, error: str, now: float) -> Ejection | None:
        """Record a failure; the ejection when this one ejects the instance."""
        inst.last_error = f"{cause.value}: {error}"[:500]
        if cause is Failure.PROBE_TIMEOUT:  # a run of its own: probes are not requests
            inst.probe_timeouts_in_row += 1
            too_many = inst.probe_timeouts_in_row >= self.rules.probe_timeouts
        else:
            inst.failures_in_row += 1
            too_many = cause.ejects_at_once or inst.failures_in_row >= self.rules.eject_after
        if not inst.healthy:
            # Still failing while out: start the back-off again from now.
            inst.ejected_until = max(inst.ejected_until, now + self._backoff(inst, grow=False))
            return None
        if not too_many:
            return None
        backoff = self._backoff(inst, grow=True)
        inst.healthy = False
        inst.ejected_until = now + backoff
        inst.ejections += 1
        return Ejection(inst.url, cause, backoff)

    def probed(self, inst: Instance, now: float) -> bool:
        """A successful probe; True when it readmitted the instance: after its back-off,
        or at once when no instance of the role is pickable (a role with nothing to
        route to takes back the first instance that answers)."""
        inst.probe_timeouts_in_row = 0
        if inst.healthy:
            return False
        if now < inst.ejected_until and self.ready():
            return False
        inst.healthy = True
        inst.failures_in_row = inst.probe_timeouts_in_row = 0
        return True

    def _backoff(self, inst: Instance, *, grow: bool) -> float:
        if grow:
            inst.ejections_in_row += 1
        exp = max(0, inst.ejections_in_row - 1)
        return min(self.rules.eject_max_s, self.rules.eject_base_s * (2 ** min(exp, 30)))

    def _forget_if_idle(self, inst: Instance) -> None:
        if inst.removed and inst.in_flight == 0:
            self._instances.pop(inst.url, None)


def _load_key(inst: Instance) -> tuple[float, float]:
    return inst.load(), inst.engine_kv_usage or 0.0
