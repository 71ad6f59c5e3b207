"""ZeroMQ CURVE configured the way a deployment does it: keys from ``rd2h keys`` in the
settings (``kv_connector_extra_config``), sockets built by the composition root (the
rig's bootstrap).

A listed Prefill key handshakes and transfers; an unlisted one never gets a
connection (its handshake deadline says so); the receive high-water mark comes from
the settings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import zmq
from fakes.logs import RecordingLogger
from fakes.net import HOST
from fakes.rig import (
    WAIT,
    Rig,
    Transfer,
    assert_transfer_landed,
    internal,
    run_transfer,
)

from rd2h.app.settings import Rd2hOptions, Rd2hSettings

pytestmark = pytest.mark.integration

LAYERS = (0, 1)


def keypair() -> tuple[str, str]:
    out = subprocess.run([sys.executable, "-m", "rd2h", "keys", "--json"], check=True,
                         capture_output=True, text=True, timeout=60)
    pair = json.loads(out.stdout)
    return pair["public"], pair["secret"]


def test_curve_from_settings_admits_listed_prefill_keys_only(rig: Rig) -> None:
    d_pub, d_sec = keypair()
    p_pub, p_sec = keypair()
    _, stranger_sec = keypair()
    deadlines = {"meta_ack_s": 1.0, "layer_ack_s": WAIT}
    extra = {  # Decode's kv_connector_extra_config
        "transport": "inproc", "host": HOST, "curve_secret_key": d_sec,
        "curve_allowed_keys": [p_pub], "limits": {"recv_hwm": 7}, "deadlines": deadlines,
    }
    # valid as vLLM would hand it over: the secret named by an environment variable
    vllm_extra = {k: v for k, v in extra.items() if k != "curve_secret_key"}
    Rd2hOptions.parse({**vllm_extra, "curve_secret_key_env": "D_SEC"}, environ={"D_SEC": d_sec})
    d = rig.decode(LAYERS, settings=extra)
    assert d.receiver._server._sock.getsockopt(zmq.RCVHWM) == 0  # never libzmq's (see channel)
    p = rig.prefill_memory(LAYERS, seed=4, advertise=True)
    good, stranger = (
        rig.start_sender(p, settings={"curve_secret_key": secret, "curve_server_key": d_pub,
                                      "deadlines": deadlines},
                         log=RecordingLogger(role="prefill"))
        for secret in (p_sec, stranger_sec)
    )
    assert good.prepare([d.endpoint], WAIT) == {}
    refused = stranger.prepare([d.endpoint], WAIT)
    # ZeroMQ drops the refused connection at once; the handshake fails naming it.
    assert "refusing this peer" in refused[d.endpoint], refused
    t = Transfer("curve-req", (1, 2), (3, 4), (5, 6), (7, 8))
    out = run_transfer(p, d, good, t, [(0, 2)])
    assert out.finished == {internal(t.ext)} and out.failed == frozenset()
    assert_transfer_landed(p, d, t)
    assert d.receiver.counters()["peers"] == 1  # the stranger's MF_META never arrived


def test_curve_settings_are_checked_up_front_without_echoing_secrets() -> None:
    pub, sec = keypair()
    with pytest.raises(ValueError, match="curve_allowed_keys"):
        Rd2hSettings(role="decode", curve_secret_key=sec)
    with pytest.raises(ValueError, match="curve_server_key"):
        Rd2hSettings(role="prefill", curve_secret_key=sec)
    with pytest.raises(ValueError, match="need curve_secret_key"):
        Rd2hOptions.parse({"curve_allowed_keys": [pub]})
    bad = "x" * 39
    with pytest.raises(ValueError, match="40 Z85 characters") as ei:
        Rd2hOptions.parse({"curve_secret_key_env": "K"}, environ={"K": bad})
    assert bad not in str(ei.value)
    assert sec not in repr(Rd2hSettings(role="prefill", curve_secret_key=sec,
                                        curve_server_key=pub))
