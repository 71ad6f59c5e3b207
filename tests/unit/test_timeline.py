"""The per-request timeline: stamps written as JSON lines, merged across processes into
p50/p99 per hop (``rd2h timeline``)."""

from __future__ import annotations

import json
import math

import pytest

from rd2h.adapters.logging.timeline import JsonlTimeline, timeline
from rd2h.app.timeline import (
    PATH,
    breakdown,
    load,
    load_reads,
    percentile,
    pull_overlap,
    render,
    render_overlap,
    request_key,
    select,
)
from rd2h.cli.main import main
from rd2h.ports.runtime import NO_TIMELINE

RID = "0123456789abcdef" * 2


def _write(path, records) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for rid, hop, t in records:
            fh.write(json.dumps({"id": rid, "hop": hop, "t": t, "pid": 1}) + "\n")


def test_the_proxy_id_is_found_inside_vllm_request_ids() -> None:
    assert request_key(f"cmpl-{RID}-0-1a2b3c4d") == RID
    assert request_key(RID) == RID
    assert request_key("chatcmpl-short-id") == "chatcmpl-short-id"


def test_stamps_from_several_processes_merge_by_request(tmp_path) -> None:
    writer = JsonlTimeline(tmp_path)
    writer.stamp(RID, "proxy.received")
    writer.stamp(f"cmpl-{RID}-0-1a2b3c4d", "decode.matched")
    writer.close()
    assert writer.path.name.startswith("stamps-") and writer.path.suffix == ".jsonl"
    other = tmp_path / "stamps-otherhost-7.jsonl"
    _write(other, [(f"cmpl-{RID}-0-99999999", "prefill.tracked", 2e9),
                   (f"cmpl-{RID}-0-99999999", "prefill.tracked", 1e9)])  # earliest kept
    with open(other, "a") as fh:
        fh.write('{"id": "cut off mid-li')  # a process killed while writing
    hops = load(tmp_path)[RID]
    assert set(hops) == {"proxy.received", "decode.matched", "prefill.tracked"}
    assert hops["prefill.tracked"] == 1e9
    assert hops["proxy.received"] <= hops["decode.matched"]


def test_the_process_timeline_comes_from_the_setting_or_the_environment(tmp_path,
                                                                         monkeypatch) -> None:
    monkeypatch.delenv("RD2H_TIMELINE_DIR", raising=False)
    assert timeline() is NO_TIMELINE
    monkeypatch.setenv("RD2H_TIMELINE_DIR", str(tmp_path / "env"))
    env = timeline()
    assert isinstance(env, JsonlTimeline) and env is timeline()  # one writer per folder
    assert timeline(str(tmp_path / "set")).directory == (tmp_path / "set").resolve()


def test_percentiles_interpolate_between_ranks() -> None:
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(map(float, range(101))), 99) == 99.0
    assert math.isnan(percentile([], 50))


def _request(rid: str, start: float, steps_ms: list[float]) -> list[tuple[str, str, float]]:
    t, out = start, []
    for hop, step in zip(PATH, steps_ms):
        t += step / 1e3
        out.append((rid, hop.name, t))
    return out


def test_breakdown_gives_each_hop_its_interval_from_the_previous_one(tmp_path) -> None:
    steps = [0, 10, 1, 2, 3, 4, 1, 5, 6, 7, 1, 2, 1, 3, 8, 20]
    assert len(steps) == len(PATH)
    records = []
    for i in range(10):
        scaled = [s * (1 + i / 10) for s in steps]
        records += _request(f"{i:032x}", 1000.0 + i, scaled)
    records = [r for r in records if not (r[0] == f"{3:032x}" and r[1] == "decode.reported")]
    _write(tmp_path / "a.jsonl", records)
    b = breakdown(load(tmp_path))
    assert (b.requests, b.complete, b.failed) == (10, 10, 0)
    by = {h.hop: h for h in b.hops}
    assert [h.hop for h in b.hops] == [h.name for h in PATH]
    matched = by["decode.matched"]
    assert matched.after == "proxy.received" and matched.n == 10
    assert matched.p50_ms == pytest.approx(10 * 1.45)
    assert matched.p99_ms == pytest.approx(18.91, rel=1e-6)  # rank 8.91 of 10..19
    # Request 3 skipped decode.reported: its next hop counts from the one before.
    assert by["decode.reported"].n == 9 and by["decode.kv_ready"].n == 10
    assert by["proxy.first_byte"].at_p50_ms == pytest.approx(sum(steps[:15]) * 1.45)
    text = render(b)
    assert "decode.matched" in text and "vLLM" in text and "10 requests" in text
    assert json.loads(json.dumps(b.to_json()))["hops"][1]["hop"] == "decode.matched"


def test_select_keeps_requests_that_started_in_the_window(tmp_path) -> None:
    _write(tmp_path / "a.jsonl", _request("a" * 32, 100.0, [0, 1]) +
           _request("b" * 32, 200.0, [0, 1]) + [("c" * 32, "decode.matched", 150.0)])
    requests = load(tmp_path)
    assert set(select(requests, 150.0, 250.0)) == {"b" * 32, "c" * 32}
    assert set(select(requests, until=120.0)) == {"a" * 32}


def test_the_command_prints_the_breakdown(tmp_path, capsys) -> None:
    _write(tmp_path / "a.jsonl", _request(RID, 100.0, [0, 3, 1]))
    assert main(["timeline", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "decode.allocated" in out and "1 requests" in out
    assert main(["timeline", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == 1
    assert main(["timeline", str(tmp_path), "--since", "1000"]) == 1
    assert "no stamped requests" in capsys.readouterr().err
    assert main(["timeline", str(tmp_path / "missing")]) == 2


# ---- the pull overlap: bytes read before Prefill's last layer was ready

def _plan(ids, main, indexer, lengths):
    import numpy as np

    from rd2h.domain.planning.planning import ReadPlan

    n = len(lengths)
    return ReadPlan(np.zeros(n, np.uint64), np.zeros(n, np.uint64),
                    np.array(lengths, np.uint64), tuple(ids), np.array(main, np.int64),
                    np.array(indexer, np.int64), np.array(main, np.int64), sum(main))


def test_the_read_stamper_stamps_each_request_its_share_of_a_read(tmp_path) -> None:
    from rd2h.app.timeline import read_stamper

    assert read_stamper(NO_TIMELINE) is None
    writer = JsonlTimeline(tmp_path)
    on_read = read_stamper(writer)
    other = "f" * 32
    # 3 blocks of RID and 1 of the other in one read of 4 x 1000 bytes; a request that
    # owns nothing of this read gets no stamp.
    on_read("p0", _plan([f"cmpl-{RID}-0-1", other, "nothing"], [3, 1, 0], [0, 0, 0],
                        [1000] * 4))
    on_read("p0", _plan([RID], [2], [0], [2000]))
    writer.close()
    reads = load_reads(tmp_path)
    assert sorted(reads) == sorted([RID, other])
    assert [n for _, n in reads[RID]] == [3000, 2000]
    assert [n for _, n in reads[other]] == [1000]


def test_pull_overlap_counts_the_bytes_read_by_the_last_layer(tmp_path) -> None:
    last = 100.0
    with open(tmp_path / "stamps-h-1.jsonl", "w") as fh:
        for rid, t, n in ((RID, 99.0, 600), (RID, 99.5, 300), (RID, 100.02, 100),
                          ("a" * 32, 99.0, 50), ("a" * 32, 100.5, 50)):
            fh.write(json.dumps({"id": rid, "hop": "decode.layer_read", "t": t, "pid": 1,
                                 "bytes": n}) + "\n")
        fh.write('{"id": "x", "hop": "decode.layer_read", "t": 1, "bytes": "many"}\n')
    _write(tmp_path / "stamps-h-2.jsonl",
           [(RID, "prefill.announced_all", last), ("a" * 32, "prefill.announced_all", last),
            ("b" * 32, "prefill.announced_all", last)])  # no reads: not counted
    o = pull_overlap(load(tmp_path), load_reads(tmp_path))
    assert o is not None and o.requests == 2
    assert o.before_last_min == pytest.approx(0.5)
    assert o.before_last_p50 == pytest.approx((0.9 + 0.5) / 2)
    assert o.before_last_all == pytest.approx(950 / 1100)
    assert o.after_last_p50_ms == pytest.approx((20 + 500) / 2)
    assert "pull overlap: 2 requests" in render_overlap(o)
    assert pull_overlap(load(tmp_path), {}) is None
    assert "no request" in render_overlap(None)


def test_the_command_prints_the_pull_overlap(tmp_path, capsys) -> None:
    _write(tmp_path / "s.jsonl", [(RID, "proxy.received", 1.0),
                                  (RID, "prefill.announced_all", 2.0)])
    with open(tmp_path / "s.jsonl", "a") as fh:
        fh.write(json.dumps({"id": RID, "hop": "decode.layer_read", "t": 1.5, "pid": 1,
                             "bytes": 10}) + "\n")
    assert main(["timeline", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pull_overlap"]["before_last_all"] == 1.0
    assert main(["timeline", str(tmp_path)]) == 0
    assert "read before Prefill's last layer was ready: p50 100.0%" in capsys.readouterr().out
