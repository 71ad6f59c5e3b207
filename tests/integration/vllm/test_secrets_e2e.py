"""No secret in any log, error or process listing (issue #41), on real vLLM engines.

A Prefill and a Decode engine (tiny Llama, cma) sign every control message
(``auth_secret``) and encrypt the channel (ZeroMQ CURVE), every secret given the way a
deployment mounts a Kubernetes Secret: a file readable by its owner only, named in
``kv_connector_extra_config`` (``auth_secret_file``, ``curve_secret_key_file``), or an
environment variable (Decode's signing secret: ``auth_secret_env``); ``rd2h proxy``
reads its admin token from ``--admin-token-file``. Requests get the plain engine's
tokens, and no secret byte appears in any engine's or the proxy's log (vLLM's
"non-default args" line, rd2h's lines) or on the command line of any of their
processes (``/proc/<pid>/cmdline``, children included). conftest.py scans every
real-engine module's logs for the secrets it registered the same way.

An engine given a secret inline is refused at start: the message says vLLM logs that
config, names the file and environment options, and holds no part of the value.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import httpx
import pytest
import stall
from fakes.net import free_port, quiet_ports
from servers import Server, leaks_in, proxy_server, rd2h_kv, running, secret_file, vllm_server

from rd2h.bootstrap.gateways import curve_keypair
from rd2h.demo.tiny_model import VOCAB

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

AUTH_ENV = "RD2H_TEST_AUTH_SECRET"


def _prompt(n: int, seed: int) -> list[int]:
    return [3 + (seed * 71 + i * 13) % (VOCAB - 3) for i in range(n)]


def _tokens(url: str, model: str, prompt: list[int]) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "return_token_ids": True}
    resp = stall.post(url + "/v1/completions", body, 120.0)
    assert resp.status_code == 200, resp.text
    return list(resp.json()["choices"][0]["token_ids"])


@pytest.fixture(scope="module")
def secured(tmp_path_factory, llama_model, llama_reference):
    root = tmp_path_factory.mktemp("secrets")
    auth = secrets.token_urlsafe(24)
    (d_pub, d_sec), (p_pub, p_sec) = curve_keypair(), curve_keypair()
    admin = secrets.token_urlsafe(24)
    files = {"auth": secret_file(root / "auth-secret", auth),
             "p_curve": secret_file(root / "prefill-curve", p_sec),
             "d_curve": secret_file(root / "decode-curve", d_sec),
             "admin": secret_file(root / "admin-token", admin)}
    kv_port = quiet_ports(2)
    base = {"transport": "cma", "log_level": "DEBUG",
            "deadlines": {"layer_ack_s": 10.0, "meta_ack_s": 5.0}}
    p_extra = {**base, "auth_secret_file": str(files["auth"]),
               "curve_secret_key_file": str(files["p_curve"]), "curve_server_key": d_pub}
    d_extra = {**base, "auth_secret_env": AUTH_ENV,
               "curve_secret_key_file": str(files["d_curve"]), "curve_allowed_keys": [p_pub]}
    prefill = vllm_server("prefill engine (secured)", llama_model, free_port(),
                          root / "prefill.log", kv=rd2h_kv("kv_producer", kv_port, p_extra))
    decode = vllm_server("decode engine (secured)", llama_model, free_port(),
                         root / "decode.log", kv=rd2h_kv("kv_consumer", kv_port, d_extra),
                         env={AUTH_ENV: auth})
    proxy = proxy_server(free_port(), [prefill.url], [decode.url], root / "proxy.log",
                         args=["--admin-token-file", str(files["admin"])])
    with running(prefill, decode, proxy):
        yield {"model": str(llama_model), "reference": llama_reference, "root": root,
               "prefill": prefill, "decode": decode, "proxy": proxy, "admin": admin,
               "secrets": (auth, p_sec, d_sec, admin)}


def _family(pid: int) -> list[int]:
    """``pid`` and every process below it (vLLM's engine core and workers)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def test_signed_encrypted_pulls_from_secret_files_serve_the_reference(secured) -> None:
    s = secured
    for n, seed in ((40, 1), (97, 2), (150, 3)):
        prompt = _prompt(n, seed)
        want = _tokens(s["reference"].url, s["model"], prompt)
        assert _tokens(s["proxy"].url, s["model"], prompt) == want, s["decode"].tail(40)
    for side in ("prefill", "decode"):  # the channel really is signed and encrypted
        text = s[side].log.read_text(errors="replace")
        assert "control channel" in text and "signing=HMAC-SHA256" in text, s[side].tail(40)
        assert "encryption=CURVE" in text, s[side].tail(40)
    # The proxy's admin API is on, with the token read from its file.
    r = httpx.get(s["proxy"].url + "/admin/instances", timeout=10,
                  headers={"Authorization": f"Bearer {s['admin']}"})
    assert r.status_code == 200, r.text


def test_no_secret_in_any_log_or_process_listing(secured) -> None:
    s = secured
    found = []
    for name in ("prefill", "decode", "proxy"):
        server: Server = s[name]
        found += leaks_in(server.log.read_text(errors="replace"), f"{name}'s log")
        assert server.proc is not None
        pids = _family(server.proc.pid)
        assert pids, name
        for pid in pids:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue  # exited meanwhile
            found += leaks_in(cmdline.decode(errors="replace"), f"{name} pid {pid}'s cmdline")
    assert not found, found
    assert len(s["secrets"]) == 4


def test_an_inline_secret_is_refused_at_start_without_echoing_it(tmp_path, llama_model) -> None:
    """vLLM itself prints the value in its 'non-default args' line before rd2h's connector
    starts (this is why rd2h refuses it); rd2h's refusal holds no part of it."""
    value = "inline-" + secrets.token_hex(12)  # shown by vLLM on purpose: not registered
    log = tmp_path / "engine.log"
    server = vllm_server("engine with an inline secret", llama_model, free_port(), log,
                         kv=rd2h_kv("kv_consumer", quiet_ports(2),
                                    {"transport": "cma", "auth_secret": value}))
    with pytest.raises(RuntimeError, match="exited"), running(server, startup_s=300):
        pass
    lines = log.read_text(errors="replace").splitlines()
    refusal = [ln for ln in lines if "holds 'auth_secret' inline" in ln]
    assert refusal, "\n".join(lines[-40:])
    for line in refusal:
        assert "auth_secret_file" in line and "auth_secret_env" in line, line
        assert "vLLM prints" in line, line
        assert value not in line and value[7:] not in line, line
    assert any(value in ln and "non-default args" in ln for ln in lines), (
        "vLLM no longer logs kv_connector_extra_config at start; update the docs' reason")


def test_the_environment_variable_stays_out_of_the_command_line(secured) -> None:
    """Decode's signing secret came from its environment: the name is on its command
    line, the value is not (checked above); a process listing shows only the name."""
    cmd = " ".join(secured["decode"].cmd)
    assert AUTH_ENV in cmd and secured["secrets"][0] not in cmd
    assert os.environ.get(AUTH_ENV) is None  # never set in the test process itself
