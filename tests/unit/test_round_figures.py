"""The figures of ``rd2h demo --rounds``: ratios per round, medians, skipped replays,
and the tail from the last layer ready to complete on every Decode rank."""

from __future__ import annotations

import pytest

from rd2h.demo.config import DemoConfig, chunk_ranges, internal_id, round_order
from rd2h.demo.rounds import summarize
from rd2h.demo.synthetic import allocate

CFG = DemoConfig(prefill_tp=2, decode_tp=2, layers=2, requests=2, prompt_tokens=512,
                 block_size=64, chunks=2, rounds=3)
ALLOC = allocate(CFG.requests, CFG.prompt_tokens, CFG.block_size, CFG.seed)


def _decode(k: int, t_end: float, nbytes: int, ends: dict[int, float],
            failed: frozenset[int] = frozenset()) -> dict:
    ids = {r: internal_id(r, k) for r in range(CFG.requests)}
    return {"t_end": t_end, "bytes": nbytes,
            "ended_at": {ids[r]: t for r, t in ends.items()},
            "outcomes": {ids[r]: ("read failed" if r in failed else None) for r in ends}}


def _msgs() -> tuple[dict, dict[int, float]]:
    msgs: dict = {}
    t0 = {0: 10.0, 1: 20.0, 2: 30.0}
    # round k: each Decode rank pulls 500 MB; the slower one ends at t0 + 0.5 s
    for k, t in t0.items():
        msgs[f"decode_done/{k}"] = {
            "decode 0": _decode(k, t + 0.4, 500_000_000, {0: t + 0.40, 1: t + 0.40}),
            "decode 1": _decode(k, t + 0.5, 500_000_000, {0: t + 0.45, 1: t + 0.50},
                                failed=frozenset({1}) if k == 2 else frozenset()),
        }
        msgs[f"prefill_done/{k}"] = {"prefill 0": {"ready_at": t + 0.30},
                                     "prefill 1": {"ready_at": t + 0.35}}
        # the bare replay: ranks start 0.1 s apart, the span is 0.4 s for 1e9 bytes
        msgs[f"bare/{k}"] = {"decode 0": {"t0": t + 1.0, "t1": t + 1.3, "bytes": 500_000_000},
                             "decode 1": {"t0": t + 1.1, "t1": t + 1.4, "bytes": 500_000_000}}
    return msgs, t0


def test_ratios_medians_and_the_tail() -> None:
    msgs, t0 = _msgs()
    fig = summarize(CFG, ALLOC, msgs, t0)
    assert [r["order"] for r in fig.rounds] == ["pipeline first", "bare first", "pipeline first"]
    for row in fig.rounds:
        assert row["seconds"] == pytest.approx(0.5)
        assert row["gbps"] == pytest.approx(2.0)
        assert row["bare_gbps"] == pytest.approx(2.5)  # span from first start to last end
        assert row["ratio"] == pytest.approx(0.8)
    assert fig.gbps == pytest.approx(2.0) and fig.raw_gbps == pytest.approx(2.5)
    assert fig.ratio_median == pytest.approx(0.8) and fig.bytes == 1_000_000_000
    # tail = latest end over the Decode ranks - latest ready over the Prefill ranks;
    # a request that failed anywhere has no tail (round 2, request 1).
    assert sorted(round(t, 6) for t in fig.tail_ms) == sorted(
        [100.0, 150.0] * 2 + [100.0])
    start, end, _ = chunk_ranges(CFG, ALLOC)[-1]
    share = (end - start) / ALLOC.blocks_per_request / CFG.layers
    assert fig.bare_layer_ms == pytest.approx(0.4 * share * 1e3)


def test_a_skipped_or_missing_replay_gives_no_ratio() -> None:
    msgs, t0 = _msgs()
    msgs["bare/1"]["decode 1"] = {"skipped": "TP exchange failed"}
    del msgs["bare/2"]["decode 0"]
    fig = summarize(CFG, ALLOC, msgs, t0)
    assert "ratio" in fig.rounds[0]
    assert "ratio" not in fig.rounds[1] and "ratio" not in fig.rounds[2]
    assert fig.ratio_min == fig.ratio_max == pytest.approx(0.8)


def test_no_tail_without_every_prefill_ready_time() -> None:
    msgs, t0 = _msgs()
    for k in range(3):
        msgs[f"prefill_done/{k}"]["prefill 1"]["ready_at"] = 0.0
    assert summarize(CFG, ALLOC, msgs, t0).tail_ms == []


def test_round_order_alternates_after_round_zero_pulls_first() -> None:
    assert [round_order(k)[0] for k in range(4)] == ["pipeline", "bare", "pipeline", "bare"]
    assert internal_id(3, 0) != internal_id(3, 1)
    assert internal_id(3, 1).endswith(internal_id(3, 0)[-9:])  # vLLM's 9-char suffix


def test_cpu_per_byte_counts_the_same_processes_on_both_sides() -> None:
    msgs, t0 = _msgs()
    for k in range(3):
        for d, name in enumerate(("decode 0", "decode 1")):
            msgs[f"decode_done/{k}"][name]["cpu"] = {"user": 0.02, "sys": 0.08 + 0.01 * d}
            msgs[f"bare/{k}"][name]["cpu"] = {"user": 0.001, "sys": 0.079}
        for name in ("prefill 0", "prefill 1"):
            msgs[f"prefill_done/{k}"][name]["cpu"] = {"user": 0.01, "sys": 0.005}
        # Prefill idles during the replay; the parent measured its CPU there
        msgs[f"bare_prefill_cpu/{k}"] = {"prefill 0": 0.001, "prefill 1": 0.003}
    fig = summarize(CFG, ALLOC, msgs, t0)
    pipeline = 0.02 * 2 + 0.08 + 0.09 + 0.015 * 2  # 0.24 s for 1e9 bytes
    bare = 0.08 * 2 + 0.004  # 0.164 s for 1e9 bytes
    for row in fig.rounds:
        assert row["cpu"]["bare_prefill"] == pytest.approx(0.004)
        per = row["cpu_per_byte"]
        assert per["pipeline"] == pytest.approx(pipeline)  # ns per byte
        assert per["bare"] == pytest.approx(bare)
        assert per["ratio"] == pytest.approx(pipeline / bare)
    assert fig.cpu_per_byte["ratio"] == pytest.approx(pipeline / bare)
    assert fig.cpu["bare"] == pytest.approx(bare)


def test_no_cpu_per_byte_without_both_sides() -> None:
    msgs, t0 = _msgs()
    for name in ("decode 0", "decode 1"):
        msgs["decode_done/0"][name]["cpu"] = {"user": 0.02, "sys": 0.08}
    for name in ("prefill 0", "prefill 1"):
        msgs["prefill_done/0"][name]["cpu"] = {"user": 0.01, "sys": 0.005}
    fig = summarize(CFG, ALLOC, msgs, t0)  # no replay reported its CPU
    assert "cpu_per_byte" not in fig.rounds[0] and fig.cpu_per_byte == {}


def test_threads_cpu_reads_this_process() -> None:
    import os
    import time

    from rd2h.demo.memory import threads_cpu

    before = threads_cpu(os.getpid())
    assert before is not None
    end = time.thread_time() + 0.02
    while time.thread_time() < end:
        pass
    after = threads_cpu(os.getpid())
    assert after is not None and after - before >= 0.015
    assert threads_cpu(2**22 + 12345) is None  # beyond pid_max: no such process
