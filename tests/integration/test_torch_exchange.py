"""``TorchDistExchange.all_gather`` between real processes over gloo: one fixed-slot
collective for small objects, every rank falling back together when one rank's
object does not fit its slot; results in rank order, as ``all_gather_object`` gives."""

from __future__ import annotations

import multiprocessing as mp
import traceback
from typing import Any

import pytest

from tests.fakes.net import free_port

pytestmark = pytest.mark.integration

BIG = "x" * 20_000  # more than a slot


def _rank(rank: int, world: int, port: int, rounds: list[list[Any]], out: Any) -> None:
    try:
        from rd2h.adapters.torch.exchange import TorchDistExchange

        ex = TorchDistExchange(rank=rank, world_size=world,
                               init_method=f"tcp://127.0.0.1:{port}", timeout_s=30)
        got = [list(ex.all_gather(objs[rank], 30)) for objs in rounds]
        ex.close()
        out.put((rank, got))
    except BaseException:
        out.put((rank, traceback.format_exc()))


def test_all_gather_small_large_and_mixed() -> None:
    world = 3
    rounds = [
        [frozenset({"a"}), frozenset(), frozenset({"c", "d"})],  # small: one collective
        [(1, "x"), None, {"k": [1, 2, 3]}],
        [BIG, "small", None],  # one rank overflows: everyone falls back
        [b"", 0, BIG + "y"],
        [frozenset({f"req-{i:05d}-e0000001" for i in range(100)}), 1, 2],  # still fits
    ]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, rounds, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in range(world))
    for p in procs:
        p.join(30)
    for rank in range(world):
        assert not isinstance(results[rank], str), results[rank]
        assert results[rank] == rounds, rank


def test_a_group_of_one_needs_no_collective() -> None:
    from rd2h.adapters.torch.exchange import TorchDistExchange

    class NoCollectives:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"a group of one called torch.distributed.{name}")

    ex = TorchDistExchange(rank=0, world_size=1, group=object())
    ex._dist = NoCollectives()  # type: ignore[assignment]
    assert ex.all_gather({"a": 1}, 1.0) == [{"a": 1}]


def test_decode_at_tp1_exchanges_nothing_and_tp2_needs_a_process_group() -> None:
    """At TP 1 (no process group) Decode's per-step exchange hands the report back
    untouched, with no barrier or lock on the way; several ranks without a group are a
    configuration error, not a hang."""
    from rd2h.adapters.torch.exchange import SoloExchange
    from rd2h.bootstrap.container import _exchange
    from rd2h.domain.errors import Rd2hError

    ex = _exchange(0, 1, 5.0)
    assert isinstance(ex, SoloExchange) and (ex.rank, ex.world_size) == (0, 1)
    report = frozenset({"req-1"})
    got = ex.all_gather(report, 0.0)  # no deadline to wait on: nothing waits
    assert got == [report] and got[0] is report
    with pytest.raises(Rd2hError, match="needs a process group"):
        _exchange(0, 2, 5.0)
