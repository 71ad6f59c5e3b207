"""``verify_kv`` on real vLLM engines (issue 29, parts 2 and 3): tiny Llama, cma, two
``rd2h proxy`` instances in front of one Decode, one Prefill stating digests and one not.

Decode carries a test seam (``seams/sitecustomize.py`` on its PYTHONPATH, never
shipped): while a flag file exists, every read lands in the wrong destination (K's
blocks into V's). With the flag off, both Prefills serve the plain engine's tokens.
With it on, through the Prefill without digests the engine serves HTTP 200 with wrong
tokens (the bug is real); through the one with digests every request fails (vLLM's
default ``kv_load_failure_policy``: "fail") and none is wrong; Decode's Prometheus
counts the mismatches. Figures (latency with and without digests, intact) print with
``-s``."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes.net import free_port, quiet_ports
from servers import proxy_server, rd2h_kv, running, vllm_server, wait_admitted

from rd2h.demo.tiny_model import VOCAB

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

SEAMS = Path(__file__).parent / "seams"
MAX_TOKENS = 8


def _prompt(seed: int, n: int = 96) -> list[int]:
    return [2 + (seed * 37 + i * 11 + seed * i) % (VOCAB - 2) for i in range(n)]


def _body(model: str, prompt: list[int]) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True}


@pytest.fixture(scope="module")
def rig(tmp_path_factory, llama_model, llama_reference) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("verify-kv")
    flag = root / "misplace"
    kv_port = quiet_ports(2)
    base = {"transport": "cma", "log_level": "INFO"}
    verified = vllm_server("prefill verify", llama_model, free_port(), root / "p_verify.log",
                           kv=rd2h_kv("kv_producer", kv_port, {**base, "verify_kv": True}))
    plain = vllm_server("prefill plain", llama_model, free_port(), root / "p_plain.log",
                        kv=rd2h_kv("kv_producer", kv_port, base))
    decode = vllm_server("decode", llama_model, free_port(), root / "decode.log",
                         kv=rd2h_kv("kv_consumer", kv_port, base), log_stats=True,
                         env={"PYTHONPATH": str(SEAMS), "RD2H_TEST_MISPLACE_FLAG": str(flag)})
    via_verified = proxy_server(free_port(), [verified.url], [decode.url], root / "pv.log")
    via_plain = proxy_server(free_port(), [plain.url], [decode.url], root / "pp.log")
    with running(verified, plain, decode, via_verified, via_plain):
        yield {"model": str(llama_model), "base": llama_reference, "flag": flag,
               "decode": decode, "verified": via_verified, "plain": via_plain,
               "p_verify": verified}


def _post(url: str, model: str, prompt: list[int]) -> tuple[int, list[int] | None, float]:
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", json=_body(model, prompt), timeout=180)
    took = time.monotonic() - t0
    tokens = list(r.json()["choices"][0]["token_ids"]) if r.status_code == 200 else None
    return r.status_code, tokens, took


def _reference(c: dict[str, Any], prompt: list[int]) -> list[int]:
    status, tokens, _ = _post(c["base"].url, c["model"], prompt)
    assert status == 200 and tokens is not None
    return tokens


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def test_intact_reads_serve_equal_tokens_with_and_without_digests(rig: dict[str, Any]) -> None:
    took: dict[str, list[float]] = {"verified": [], "plain": []}
    for i in range(6):
        prompt = _prompt(i)
        want = _reference(rig, prompt)
        for via in ("verified", "plain"):
            status, tokens, seconds = _post(rig[via].url, rig["model"], prompt)
            assert status == 200 and tokens == want, (via, rig["decode"].tail(30))
            took[via].append(seconds)
    verified = _metric(rig["decode"].url, "vllm:rd2h_kv_blocks_verified_total")
    print(f"[verify_kv] intact, 96-token prompts, request latency p50: with digests "
          f"{statistics.median(took['verified']) * 1e3:.0f} ms, without "
          f"{statistics.median(took['plain']) * 1e3:.0f} ms; Decode checked "
          f"{verified:.0f} blocks, 0 mismatches")
    assert verified > 0
    assert _metric(rig["decode"].url, "vllm:rd2h_kv_digest_mismatches_total") == 0


def test_a_wrong_destination_serves_wrong_tokens_unless_digests_catch_it(
        rig: dict[str, Any]) -> None:
    prompts = [_prompt(100 + i) for i in range(4)]
    wants = [_reference(rig, p) for p in prompts]
    rig["flag"].touch()
    try:
        plain = [_post(rig["plain"].url, rig["model"], p) for p in prompts]
        verified = [_post(rig["verified"].url, rig["model"], p) for p in prompts]
    finally:
        rig["flag"].unlink()
    wrong_plain = sum(s == 200 and t != w for (s, t, _), w in zip(plain, wants))
    wrong_verified = sum(s == 200 and t != w for (s, t, _), w in zip(verified, wants))
    failed_verified = sum(s != 200 for s, _, _ in verified)
    mismatches = _metric(rig["decode"].url, "vllm:rd2h_kv_digest_mismatches_total")
    print(f"[verify_kv] wrong destination: without digests {wrong_plain}/4 served wrong "
          f"tokens with HTTP 200; with digests {failed_verified}/4 failed, "
          f"{wrong_verified}/4 wrong; Decode counted {mismatches:.0f} mismatched blocks")
    assert wrong_plain >= 1  # the seam really corrupts what Decode serves
    assert wrong_verified == 0 and failed_verified == 4
    assert mismatches > 0
    assert "KV digest mismatch" in rig["decode"].log.read_text(errors="replace")
    # Decode serves again once the bug is gone (the proxy ejects an instance after 5
    # failed answers in a row; wait for it to be admitted in case it was).
    wait_admitted(rig["verified"], rig["decode"].url)
    prompt = _prompt(200)
    status, tokens, _ = _post(rig["verified"].url, rig["model"], prompt)
    assert status == 200 and tokens == _reference(rig, prompt)
