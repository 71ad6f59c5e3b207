"""``rd2h demo --shared-buffers K --via-provider``: the multi-process demo with its Prefill
ranks driven through the connector's buffer-reuse provider interface (spec 11) rather
than the sender directly; Decode verifies every byte."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

LAYERS, REQUESTS, CHUNKS = 4, 2, 2


def test_cli_demo_via_provider_with_shared_buffers_verifies_every_byte() -> None:
    cmd = [
        sys.executable, "-m", "rd2h", "demo", "--json", "--via-provider",
        "--shared-buffers", "2", "--prefill-tp", "2", "--decode-tp", "1",
        "--layers", str(LAYERS), "--requests", str(REQUESTS), "--prompt-tokens", "300",
        "--block-size", "64", "--chunks", str(CHUNKS), "--no-replay", "--timeout", "120",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["verified"] is True and out["errors"] == []
    assert out["prefill_driver"] == "provider" and out["shared_buffers"] == 2
    assert out["requests_ok"] == REQUESTS and out["mismatched_blocks"] == 0
    assert out["leaked_state"] == 0 and out["layer_errors"] == []
    # Every layer of every chunk on each Prefill rank was announced by the early
    # dispatch (on_kv_cache_written); save_kv_layer never announced it again.
    assert out["early_dispatches"] == 2 * CHUNKS * LAYERS
    # Both Prefill ranks' request state (requests, tickets, gates) was released.
    for name in ("prefill 0", "prefill 1"):
        assert out["leaks"][name] is not None
        assert out["leaks"][name]["requests"] == 0 and out["leaks"][name]["tickets"] == 0


def test_via_provider_help_is_documented() -> None:
    proc = subprocess.run([sys.executable, "-m", "rd2h", "demo", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert "--via-provider" in proc.stdout and "wait_for_layer_reuse" in proc.stdout
