"""Multi-process Prefill -> Decode pulls through the same code path as ``rd2h demo``:
real processes, real ZMQ sockets, the cma transport, a real gloo TP exchange."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from rd2h.demo import (
    SENTINEL,
    DemoConfig,
    main_pool_bytes,
    run_demo,
    verify_main_pool,
)
from rd2h.demo.synthetic import allocate

pytestmark = pytest.mark.integration

SMALL = dict(layers=3, requests=3, prompt_tokens=700, block_size=64, chunks=2, timeout_s=180)


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "extra"),
    [
        (1, 1, {}),
        (2, 2, {"scale": False}),
        (4, 2, {"shared_buffers": 2}),
        (4, 1, {"indexer": False, "scale": False, "chunks": 3}),
    ],
    ids=["1x1", "2x2-no-scale", "4x2-shared-buffers-2", "4x1-main-only"],
)
def test_demo_topologies_verify_every_byte(p_tp: int, d_tp: int, extra: dict) -> None:
    cfg = DemoConfig(prefill_tp=p_tp, decode_tp=d_tp, **{**SMALL, **extra})
    res = run_demo(cfg, progress=False)
    assert res.errors == []
    assert res.verified, res
    assert res.requests_ok == cfg.requests and res.requests_failed == 0
    assert res.mismatched_blocks == 0 and res.leaked_state == 0
    # Every D rank holds the full indexer (+ scale); main is pulled once in total.
    shapes = cfg.shapes
    blocks = cfg.requests * -(-cfg.prompt_tokens // cfg.block_size) * cfg.layers
    main = blocks * (shapes.bytes_per_block("main_k") + shapes.bytes_per_block("main_v"))
    idx = 0
    if cfg.indexer:
        idx = blocks * shapes.bytes_per_block("indexer")
        if cfg.scale:
            idx += blocks * shapes.bytes_per_block("scale")
    assert res.bytes == main + d_tp * idx
    assert res.layer_ack_p50_ms is not None and res.raw_gbps is not None


def test_verification_catches_untouched_and_corrupted_blocks() -> None:
    cfg = DemoConfig(prefill_tp=1, decode_tp=1, **SMALL)
    alloc = allocate(cfg.requests, cfg.prompt_tokens, cfg.block_size, cfg.seed)
    pool = np.full(main_pool_bytes(cfg, alloc), SENTINEL, dtype=np.uint8)
    expected = cfg.layers * 2 * cfg.requests * alloc.blocks_per_request
    assert verify_main_pool(cfg, alloc, pool) == expected


def test_cli_demo_json_and_exit_status() -> None:
    cmd = [
        sys.executable, "-m", "rd2h", "demo", "--json", "--prefill-tp", "2", "--decode-tp", "1",
        "--layers", "2", "--requests", "2", "--prompt-tokens", "300", "--block-size", "64",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    for key in ("verified", "requests_ok", "requests_failed", "bytes", "seconds", "gbps",
                "raw_gbps", "memcpy_gbps", "layer_ack_p50_ms", "layer_ack_p99_ms"):
        assert key in out
    assert out["verified"] is True and out["requests_ok"] == 2


def test_cli_demo_with_a_shared_secret_verifies(tmp_path) -> None:
    secret = tmp_path / "auth"
    secret.write_text("a-demo-secret-of-24-chars\n")
    secret.chmod(0o600)
    cmd = [
        sys.executable, "-m", "rd2h", "demo", "--json", "--prefill-tp", "2", "--decode-tp", "1",
        "--layers", "2", "--requests", "2", "--prompt-tokens", "300", "--block-size", "64",
        "--auth-secret-file", str(secret),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["verified"] is True and out["requests_ok"] == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prefill-tp", "3", "--decode-tp", "2"], "one must be a multiple"),
        (["--prefill-tp", "2", "--decode-tp", "4"], "to be a multiple of --decode-tp"),
        (["--shared-buffers", "99"], "--shared-buffers"),
        (["--block-size", "0"], "--block-size"),
        (["--auth-secret", "too-short"], "--auth-secret"),
    ],
)
def test_cli_rejects_bad_configuration_clearly(args: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "rd2h", "demo", *args], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------- mooncake, two hosts


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (4, 2)], ids=["2x1", "4x2"])
def test_demo_over_mooncake_verifies_every_byte(p_tp: int, d_tp: int) -> None:
    cfg = DemoConfig(prefill_tp=p_tp, decode_tp=d_tp, transport="mooncake", **SMALL)
    res = run_demo(cfg, progress=False)
    assert res.errors == [] and res.verified, res
    assert res.transport == "mooncake" and res.network == "loopback"
    assert res.raw_gbps is not None and res.leaked_state == 0


def _netns_possible() -> bool:
    import os
    import shutil

    return os.geteuid() == 0 and shutil.which("ip") is not None


@pytest.mark.parametrize("transport", ["mooncake", "cma"])
def test_demo_across_two_network_namespaces(transport: str) -> None:
    """Prefill and Decode on two "hosts": control messages (and, with mooncake, the
    data) cross a veth pair between two addresses."""
    cfg = DemoConfig(prefill_tp=4, decode_tp=2, transport=transport, netns=True,
                     shared_buffers=2, **SMALL)
    res = run_demo(cfg, progress=False)
    assert res.errors == [] and res.verified, res
    if _netns_possible():
        assert res.network.startswith("netns "), res.network
    else:  # the documented fallback
        assert res.network == "loopback"
