"""``rd2h serve`` end to end: one command starts a Prefill and a Decode engine with rd2h
and the proxy on the built-in tiny Llama (with its word tokenizer), prints the URL; a
request through it gets the plain engine's tokens; Ctrl-C (SIGINT) stops every process
it started, the engines' own children included."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from fakes.net import free_port
from servers import VENV_BIN

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def _children(pid: int) -> dict[int, int]:
    """Every process below ``pid``: pid -> parent pid."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    below, frontier = {}, {pid}
    while frontier:
        nxt = {p for p, pp in parents.items() if pp in frontier and p not in below}
        below.update({p: parents[p] for p in nxt})
        frontier = nxt
    return below


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_rd2h_serve_serves_then_stops_everything(tmp_path, llama_reference, llama_model):
    port = free_port()
    work = tmp_path / "serve"
    proc = subprocess.Popen(
        [str(VENV_BIN / "rd2h"), "serve", "--port", str(port), "--workdir", str(work),
         "--max-model-len", "512", "--engine-arg=--enforce-eager",
         # The reference engine's numerics (vLLM's CPU default dtype would differ).
         "--engine-arg=--dtype=float32", "--engine-arg=--block-size=32",
         "--startup-timeout", "480"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "ready at" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(540), "".join(lines[-40:])
        out = "".join(lines)
        assert f"ready at http://127.0.0.1:{port}" in out and "curl -s" in out
        model = str(work / "tiny-llama")
        prompt = [5, 6, 7, 8, 9, 10, 11, 12] * 6
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"model": model, **body}, timeout=120)
        assert r.status_code == 200, r.text
        want = httpx.post(llama_reference.url + "/v1/completions",
                          json={"model": str(llama_model), **body}, timeout=120)
        assert r.json()["choices"][0]["token_ids"] == want.json()["choices"][0]["token_ids"]
        # And a text prompt, as the printed example sends.
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={
            "model": model, "prompt": "w5 w6 w7 w8", "max_tokens": 4}, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
        started = _children(proc.pid)
        assert len(started) >= 3  # two engines (and their engine cores) and the proxy
        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 0, "".join(lines[-40:])
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = [p for p in started if _alive(p)]
        assert not left, f"processes left behind: {left}"
        assert "stopping every process" in "".join(lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
