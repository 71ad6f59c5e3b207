"""P/D tensor-parallel mapping, owned ranges with rotation, and port plans.

Spec sections 5, 8 and 9. Everything here is plain arithmetic on ints.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rd2h.domain.errors import TopologyError

MAX_PORT = 65535


def _check_size(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TopologyError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise TopologyError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class TpMapping:
    """Where one Prefill rank sends, and which contributor it is there (spec 8).

    Prefill TP = ratio x Decode TP: one Decode rank (``d_rank``), as member ``member``
    of a group of ``ratio``. Decode TP = fan-out x Prefill TP (an extension,
    docs/guide/vllm.md "Topologies"): ``d_ranks`` are the fan-out Decode ranks this
    rank alone serves, as member 0 of a group of 1 each."""

    p_tp: int
    d_tp: int
    p_rank: int
    ratio: int
    d_rank: int
    member: int
    d_ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.d_ranks:
            object.__setattr__(self, "d_ranks", (self.d_rank,))


def check_topology(p_tp: int, d_tp: int) -> int:
    """Validate a P/D TP pair and return ``ratio = p_tp // d_tp`` (1 when Decode TP is a
    multiple of Prefill TP: each Prefill rank then serves ``fanout`` Decode ranks)."""
    _check_size("p_tp", p_tp)
    _check_size("d_tp", d_tp)
    if p_tp % d_tp != 0 and d_tp % p_tp != 0:
        raise TopologyError(
            f"unsupported topology: prefill TP {p_tp} and decode TP {d_tp} (one must be a "
            "multiple of the other)"
        )
    return max(1, p_tp // d_tp)


def fanout(p_tp: int, d_tp: int) -> int:
    """How many Decode ranks each Prefill rank serves (1 unless Decode TP is larger)."""
    check_topology(p_tp, d_tp)
    return max(1, d_tp // p_tp)


def compute_mapping(p_tp: int, d_tp: int, p_rank: int) -> TpMapping:
    """Map Prefill rank ``p_rank`` to its Decode rank(s) and contributor member index."""
    ratio = check_topology(p_tp, d_tp)
    if isinstance(p_rank, bool) or not isinstance(p_rank, int):
        raise TopologyError(f"p_rank must be an int, got {type(p_rank).__name__}")
    if not 0 <= p_rank < p_tp:
        raise TopologyError(f"prefill rank {p_rank} is outside [0, {p_tp})")
    f = max(1, d_tp // p_tp)
    first = p_rank * f if f > 1 else p_rank // ratio
    return TpMapping(
        p_tp=p_tp,
        d_tp=d_tp,
        p_rank=p_rank,
        ratio=ratio,
        d_rank=first,
        member=p_rank % ratio,
        d_ranks=tuple(range(first, first + f)),
    )


def contributor_group(p_tp: int, d_tp: int, d_rank: int) -> tuple[int, ...]:
    """The Prefill ranks that contribute to Decode rank ``d_rank``, member order."""
    ratio = check_topology(p_tp, d_tp)
    if isinstance(d_rank, bool) or not isinstance(d_rank, int) or not 0 <= d_rank < d_tp:
        raise TopologyError(f"decode rank {d_rank!r} is outside [0, {d_tp})")
    f = max(1, d_tp // p_tp)
    if f > 1:
        return (d_rank // f,)
    return tuple(range(d_rank * ratio, (d_rank + 1) * ratio))


def owned_range(n: int, k: int, r: int, s: int) -> tuple[int, int]:
    """Half-open range ``[start, end)`` of ``n`` items that owner ``r`` of ``k`` keeps.

    The split is rotated by the global start block ``s`` so that consecutive
    small chunks do not all land on owner 0 (spec 5).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not 0 <= r < k:
        raise ValueError(f"owner {r} is outside [0, {k})")
    logical = (r - s % k) % k
    q, rem = divmod(n, k)
    start = logical * q + min(logical, rem)
    count = q + (1 if logical < rem else 0)
    return start, start + count


@dataclass(frozen=True)
class PortPlan:
    """Decode control ports of one engine (spec 9). Only Decode binds."""

    kv_port: int
    global_dp_rank: int
    d_tp: int

    @property
    def base_port(self) -> int:
        return self.kv_port + self.global_dp_rank * self.d_tp

    @property
    def highest_port(self) -> int:
        return self.base_port + self.d_tp - 1

    def rank_port(self, tp_rank: int) -> int:
        if not 0 <= tp_rank < self.d_tp:
            raise TopologyError(f"decode TP rank {tp_rank} is outside [0, {self.d_tp})")
        return self.base_port + tp_rank

    @property
    def rank_ports(self) -> tuple[int, ...]:
        return tuple(range(self.base_port, self.base_port + self.d_tp))


def plan_ports(kv_port: int, global_dp_rank: int, d_tp: int) -> PortPlan:
    """Build and validate the Decode port plan; every rank port lies in 1..65535."""
    _check_size("d_tp", d_tp)
    if isinstance(kv_port, bool) or not isinstance(kv_port, int) or kv_port < 1:
        raise TopologyError(f"kv_port must be an int >= 1, got {kv_port!r}")
    if isinstance(global_dp_rank, bool) or not isinstance(global_dp_rank, int):
        raise TopologyError(f"global_dp_rank must be an int, got {global_dp_rank!r}")
    if global_dp_rank < 0:
        raise TopologyError(f"global_dp_rank must be >= 0, got {global_dp_rank}")
    plan = PortPlan(kv_port=kv_port, global_dp_rank=global_dp_rank, d_tp=d_tp)
    if plan.highest_port > MAX_PORT:
        raise TopologyError(
            f"decode port plan overflows: kv_port {kv_port} + dp rank {global_dp_rank} x "
            f"TP {d_tp} needs ports {plan.base_port}..{plan.highest_port}, above {MAX_PORT}"
        )
    return plan


def remote_port(base_port: int, d_rank: int) -> int:
    """The Decode rank port a Prefill rank connects to; validated to lie in 1..65535."""
    for name, value in (("base_port", base_port), ("d_rank", d_rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TopologyError(f"{name} must be an int, got {value!r}")
    port = base_port + d_rank
    if d_rank < 0 or not 1 <= port <= MAX_PORT:
        raise TopologyError(
            f"remote port {port} (base {base_port} + decode rank {d_rank}) is outside 1..{MAX_PORT}"
        )
    return port



def tcp_endpoint(host: str, port: int) -> str:
    """The ZeroMQ address of a Decode rank port (IPv6 hosts in brackets)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def owned_ranges(
    n: np.ndarray, k: int, r: int, s: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised ``owned_range`` over int64 arrays ``n`` (sizes) and ``s`` (starts)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not 0 <= r < k:
        raise ValueError(f"owner {r} is outside [0, {k})")
    logical = (r - s % k) % k
    q, rem = np.divmod(n, k)
    start = logical * q + np.minimum(logical, rem)
    return start, start + q + (logical < rem)
