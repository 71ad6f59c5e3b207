"""Fault matrix over the multi-process demo (real rank processes, ZeroMQ, cma reads,
gloo exchange): each injected fault at the first, middle and last layer where a layer
applies, at P/D ratio 1 (2 Prefill x 2 Decode ranks) and ratio 2 (2 x 1).

For every scenario: every request ends (ok or failed with a reason) within its
deadline, every ok request carries exactly the right bytes, and no rank keeps any
request state. Deadlines are short so that the matrix runs in a few minutes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from rd2h.demo import DemoConfig, DemoResult, run_demo
from rd2h.demo.faults import KILLED_EXIT_CODE, parse_fault

pytestmark = pytest.mark.integration

LAYERS = 4
REQUEST_S = 2.5
LAYER_ACK_S = 1.5
SMALL = dict(layers=LAYERS, requests=4, prompt_tokens=300, block_size=64, chunks=2,
             timeout_s=120, request_timeout_s=REQUEST_S, layer_ack_timeout_s=LAYER_ACK_S,
             meta_ack_timeout_s=1.0, exchange_timeout_s=10.0, log_level="ERROR")
RATIOS = {"ratio1": (2, 2), "ratio2": (2, 1)}
POSITIONS = {"first": 0, "middle": LAYERS // 2, "last": LAYERS - 1}
# One run must end well inside this: spawn, the request deadline, settling, teardown.
RUN_BUDGET_S = 45.0


def run(ratio: str, *faults: str, slack_s: float = 0.0, **extra: object) -> DemoResult:
    p_tp, d_tp = RATIOS[ratio]
    cfg = DemoConfig(prefill_tp=p_tp, decode_tp=d_tp,
                     faults=tuple(parse_fault(f) for f in faults), **{**SMALL, **extra})
    t0 = time.monotonic()
    res = run_demo(cfg, progress=False)
    took = time.monotonic() - t0
    check_promises(res, took, slack_s)
    return res


def unacknowledged(error: str) -> list[int]:
    """The layers a reply deadline's error names: one, or a layer run's (one reply
    answers them all)."""
    named = re.search(r"no acknowledgement of layers? ([\d, ]+)(?: \(one layer run\))? "
                      r"from decode endpoint tcp://", error)
    return [int(x) for x in named.group(1).split(", ")] if named else []


def check_promises(res: DemoResult, took: float, slack_s: float = 0.0) -> None:
    """What every scenario must keep, whatever failed."""
    assert res.errors == [], res.errors
    assert res.verified, res
    assert took < RUN_BUDGET_S, f"run took {took:.1f} s"
    assert res.requests_hung == 0 and res.corrupted_ok == 0 and res.mismatched_blocks == 0
    assert res.leaked_state == 0, res.leaks
    for name, counters in res.leaks.items():
        assert counters is None or not any(counters.values()), (name, counters)
    assert len(res.outcomes) == res.requests
    assert res.requests_ok + res.requests_failed == res.requests
    for rid, o in res.outcomes.items():
        assert o["status"] in ("ok", "failed"), (rid, o)
        if o["status"] == "failed":
            assert o["reason"], (rid, o)
        else:
            assert o["mismatched_blocks"] == 0
        if o["ended_s"] is not None:  # ended on the Decode ranks that lived
            assert o["ended_s"] <= REQUEST_S + 1.5 + slack_s, (rid, o)


def reasons(res: DemoResult) -> set[str]:
    return {o["reason"] for o in res.outcomes.values() if o["status"] == "failed"}


@pytest.mark.parametrize("ratio", RATIOS)
def test_no_fault_baseline(ratio: str) -> None:
    res = run(ratio)
    assert res.requests_ok == res.requests and res.layer_errors == []


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("ratio", RATIOS)
def test_kill_prefill(ratio: str, position: str) -> None:
    layer = POSITIONS[position]
    res = run(ratio, f"kill-prefill@layer={layer}")
    assert res.exits["prefill 0"] == KILLED_EXIT_CODE
    assert res.leaks["prefill 0"] is None
    # Prefill rank 0 feeds every request (ratio 1: Decode rank 0's share; ratio 2: member
    # 0 of the only group): none can complete.
    assert res.requests_failed == res.requests
    if layer == 0:  # Decode never heard of it for these requests: the deadline ends them
        assert all("no KV arrived within" in r for r in reasons(res)), reasons(res)
    else:  # the lost connection ends them, well before the request deadline
        assert all("disconnected before announcing the final layer" in r
                   for r in reasons(res)), reasons(res)
        assert all(o["ended_s"] < REQUEST_S for o in res.outcomes.values())


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("ratio", RATIOS)
def test_kill_decode(ratio: str, position: str) -> None:
    layer = POSITIONS[position]
    d_tp = RATIOS[ratio][1]
    rank = 1 if (d_tp == 2 and position == "middle") else 0
    res = run(ratio, f"kill-decode@layer={layer},rank={rank}")
    assert res.exits[f"decode {rank}"] == KILLED_EXIT_CODE
    assert res.requests_failed == res.requests  # every request spans every Decode rank
    assert f"decode {rank} was killed by an injected fault" in reasons(res)
    # The Prefill ranks sending to it learned at once (monitor), not at the deadline.
    mapped = [p for p in range(RATIOS[ratio][0]) if p // (RATIOS[ratio][0] // d_tp) == rank]
    for p in mapped:
        assert any(e.startswith(f"prefill {p}:") for e in res.layer_errors), res.layer_errors


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("ratio", RATIOS)
def test_drop_ack(ratio: str, position: str) -> None:
    layer = POSITIONS[position]
    res = run(ratio, f"drop-ack@layer={layer}")
    # Decode read the layer; Prefill never heard back and failed exactly that layer, or
    # the layers of the layer run that carried it (one reply answers them all), naming
    # the endpoint, at its deadline, then reset the connection.
    assert res.layer_errors, res
    assert all(layer in unacknowledged(e) for e in res.layer_errors), res.layer_errors
    # Decode completes the requests long before that deadline; a request still in flight
    # at the reset fails, naming it.
    for reason in reasons(res):
        assert "disconnected" in reason, reason


# Layer runs read several layers in one batched read, so a round makes few reads (as few
# as 4 per Decode rank here): a partial rate must still hit one.
@pytest.mark.parametrize("rate", [0.6, 1.0])
@pytest.mark.parametrize("ratio", RATIOS)
def test_read_error(ratio: str, rate: float) -> None:
    res = run(ratio, f"read-error@rate={rate:g}", seed=3)
    assert res.requests_failed >= 1
    if rate == 1.0:
        assert res.requests_failed == res.requests
        assert all("injected read error" in r or "another decode rank" in r
                   for r in reasons(res)), reasons(res)
        # Prefill heard READ_FAILED for its layers (what a gate still holds at the end of
        # the round depends on whether a later chunk's answer came first).
        assert res.prefill_layers_failed >= 1


@pytest.mark.parametrize("fault", ["corrupt", "misplace"])
@pytest.mark.parametrize("ratio", RATIOS)
def test_corrupted_reads_are_caught_with_verify_kv_and_real_without(ratio: str,
                                                                    fault: str) -> None:
    """``corrupt``: bytes flipped after the transport returned; ``misplace``: blocks read
    into the wrong destination blocks. With ``verify_kv`` every affected request fails on
    the digest and none completes from corrupted blocks; without it they complete and
    the demo's own byte check sees the corruption."""
    res = run(ratio, f"{fault}@rate=1", verify_kv=True, seed=5)
    assert res.requests_failed == res.requests
    assert all("KV digest mismatch" in r or "another decode rank" in r
               for r in reasons(res)), reasons(res)
    p_tp, d_tp = RATIOS[ratio]
    cfg = DemoConfig(prefill_tp=p_tp, decode_tp=d_tp, seed=5,
                     faults=(parse_fault(f"{fault}@rate=1"),), **SMALL)
    blind = run_demo(cfg, progress=False)
    assert not blind.verified and blind.requests_ok == blind.requests
    assert blind.corrupted_ok >= 1 and blind.mismatched_blocks >= 1
    print(f"[{fault}@rate=1, {ratio}] verify_kv on: {res.requests_failed}/{res.requests} "
          f"failed, 0 served corrupted; off: {blind.corrupted_ok}/{blind.requests} served "
          f"corrupted ({blind.mismatched_blocks} mismatched blocks)")


@pytest.mark.parametrize("ratio", RATIOS)
def test_intact_reads_with_verify_kv_all_complete(ratio: str) -> None:
    """Every Prefill member states digests for what Decode may read from it (member 0
    main and indexer, the others the indexer and no main): with nothing
    corrupted every request completes (a read block without a stated digest, or a wrong
    one, would fail its layer)."""
    res = run(ratio, verify_kv=True)
    assert res.requests_ok == res.requests and res.layer_errors == []


@pytest.mark.parametrize("ratio", RATIOS)
def test_slow_decode_within_deadlines(ratio: str) -> None:
    res = run(ratio, "slow-decode@ms=40")
    assert res.requests_ok == res.requests and res.layer_errors == []
    assert res.layer_ack_p50_ms is not None and res.layer_ack_p50_ms >= 40


@pytest.mark.parametrize("shared_buffers", [0, 2])
@pytest.mark.parametrize("ratio", RATIOS)
def test_slow_decode_past_the_layer_deadline(ratio: str, shared_buffers: int) -> None:
    """Decode reads later than Prefill waits: Prefill fails the layers and resets the
    connection; Decode must then not complete requests from storage Prefill may have
    reused (with shared buffers it really is reused)."""
    # A failed request is reported once no read can still land in its blocks: a read
    # slowed by 2 s may hold its report back by as much.
    res = run(ratio, "slow-decode@ms=2000", shared_buffers=shared_buffers, slack_s=2.0)
    assert res.requests_failed == res.requests
    assert res.layer_errors


@pytest.mark.parametrize("ratio", RATIOS)
def test_drop_ack_with_reused_storage(ratio: str) -> None:
    res = run(ratio, "drop-ack@layer=1", shared_buffers=2)
    assert any(1 in unacknowledged(e) for e in res.layer_errors), res.layer_errors


def test_two_faults_at_once() -> None:
    res = run("ratio2", "kill-prefill@layer=2,rank=1", "read-error@rate=0.3")
    assert res.exits["prefill 1"] == KILLED_EXIT_CODE
    assert res.requests_failed == res.requests


def test_cli_reports_a_fault_run_in_json() -> None:
    cmd = [
        sys.executable, "-m", "rd2h", "demo", "--json", "--prefill-tp", "2", "--decode-tp", "1",
        "--layers", "4", "--requests", "3", "--prompt-tokens", "300", "--block-size", "64",
        "--request-timeout", "2.5", "--layer-ack-timeout", "1", "--meta-ack-timeout", "1",
        "--fault", "kill-decode@layer=2",
    ]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]  # promises kept, though all failed
    out = json.loads(proc.stdout)
    assert out["verified"] is True and out["faults"] == ["kill-decode@layer=2"]
    assert out["requests_ok"] == 0 and out["requests_failed"] == 3
    assert out["requests_hung"] == 0 and out["leaked_state"] == 0
    assert out["exits"]["decode 0"] == KILLED_EXIT_CODE
    assert {o["status"] for o in out["outcomes"].values()} == {"failed"}
    assert all("decode 0 was killed" in o["reason"] for o in out["outcomes"].values())
    assert time.monotonic() - t0 < 120
