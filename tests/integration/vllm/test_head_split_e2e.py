"""Head-split main KV on real vLLM engines (#22 parts 4 and 5, docs/guide/vllm.md,
"Head-split main KV" and "Topologies").

The tiny Llama has 2 KV heads (GQA), split over the TP ranks. Two topologies:

- Prefill TP 2 -> Decode TP 1: each Prefill rank holds one head, the Decode rank both.
  Without the extension Decode refuses every layer ("main layout mismatch: source block
  is ... bytes, destination block is ... bytes"). With it, both Prefill ranks state
  their heads in MF_META (``main_heads``) and each fills its slice of every Decode block.
- Prefill TP 1 -> Decode TP 2 (Decode TP above Prefill TP): the one Prefill rank
  announces every layer to both Decode ranks, each answers separately, and each Decode
  rank reads its own head's slice of every Prefill block.

Greedy tokens through ``rd2h proxy`` must equal the plain TP 1 reference engine's, with
chunked Prefill (prompts over the 64-token step budget) and a prompt list; nothing
stays pending.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest
import stall
from fakes.net import free_port, quiet_ports
from servers import Server, proxy_server, rd2h_kv, vllm_server

from rd2h.demo.tiny_model import VOCAB
from rd2h.domain.planning.topology import compute_mapping, contributor_group

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

MAX_TOKENS = 8
STARTUP_S = 600.0
EXTRA = {"transport": "cma", "log_level": "INFO",
         "deadlines": {"request_s": 120.0, "layer_ack_s": 60.0, "meta_ack_s": 30.0,
                       "heartbeat_timeout_s": 30.0}}


def _prompt(n: int, seed: int) -> list[int]:
    return [2 + (seed * 131 + i * 17) % (VOCAB - 2) for i in range(n)]


# Block size 32 (servers.py): under one block, three blocks and a part (two chunks).
PROMPTS = {"partial-block": _prompt(20, 1), "chunked-multi-block": _prompt(110, 2)}
PROMPT_LIST = [_prompt(40, 3), _prompt(70, 4), _prompt(33, 5)]


def _engine(name: str, model: Path, log: Path, kv: dict, tp: int) -> Server:
    args = ["--kv-cache-memory-bytes", str(128 << 20)]
    if tp > 1:
        args += ["--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp"]
    server = vllm_server(name, model, free_port(), log, kv=kv, args=args)
    server.cmd[:0] = ["env", "-u", "VLLM_CPU_KVCACHE_SPACE"]  # (see test_unequal_tp_e2e)
    return server


def _complete(url: str, model: str, prompt, timeout: float = 180.0) -> list[list[int]]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True}
    resp = stall.post(url + "/v1/completions", body, timeout)
    assert resp.status_code == 200, resp.text
    return [list(c["token_ids"]) for c in sorted(resp.json()["choices"],
                                                 key=lambda c: c["index"])]


@pytest.fixture(scope="module", params=[(2, 1), (1, 2)],
                ids=lambda t: f"prefill-tp{t[0]}-decode-tp{t[1]}")
def cluster(request, tmp_path_factory, llama_model, llama_reference):
    p_tp, d_tp = request.param
    root = tmp_path_factory.mktemp(f"head-split-p{p_tp}-d{d_tp}")
    kv_port = quiet_ports(d_tp)
    prefill = _engine(f"prefill engine (TP {p_tp})", llama_model, root / "prefill.log",
                      rd2h_kv("kv_producer", quiet_ports(1), EXTRA), p_tp)
    decode = _engine(f"decode engine (TP {d_tp})", llama_model, root / "decode.log",
                     rd2h_kv("kv_consumer", kv_port, EXTRA), d_tp)
    proxy = proxy_server(free_port(), [prefill.url], [decode.url], root / "proxy.log")
    t0 = time.monotonic()
    try:
        for server in (prefill, decode, proxy):
            server.start()
        deadline = time.monotonic() + STARTUP_S
        for server in (prefill, decode):
            server.wait_ready("/health", deadline)
        # /health, not /healthcheck: 200 only once the proxy's probes admitted both
        # engines. The proxy starts with them, ejects the Decode its first probes find
        # down, and readmits it only at a probe after its back-off; a request sent in
        # that gap was answered 503 (CI, stop 57).
        proxy.wait_ready("/health", deadline)
        model = str(llama_model)
        for server in (prefill, decode):  # the first TP 2 forward compiles: pay it here
            assert len(_complete(server.url, model, [5, 6, 7], STARTUP_S)[0]) == MAX_TOKENS
        print(f"\nhead split, Prefill TP {p_tp} -> Decode TP {d_tp}: ready in "
              f"{time.monotonic() - t0:.0f} s")
        yield {"model": model, "base": llama_reference, "prefill": prefill, "decode": decode,
               "proxy": proxy, "kv_port": kv_port, "p_tp": p_tp, "d_tp": d_tp}
    finally:
        for server in (proxy, decode, prefill):
            server.stop()


def _logs(c) -> str:
    return "\n".join(f"--- {k}\n{c[k].tail(40)}" for k in ("prefill", "decode", "proxy"))


@pytest.mark.parametrize("kind", list(PROMPTS))
def test_tokens_match_the_reference(cluster, kind):
    c = cluster
    want = _complete(c["base"].url, c["model"], PROMPTS[kind])
    got = _complete(c["proxy"].url, c["model"], PROMPTS[kind])
    assert got == want, f"{kind}\n{_logs(c)}"


def test_prompt_list_matches_and_nothing_is_pending(cluster):
    c = cluster
    want = _complete(c["base"].url, c["model"], PROMPT_LIST)
    got = _complete(c["proxy"].url, c["model"], PROMPT_LIST)
    assert got == want, _logs(c)
    health = httpx.get(c["proxy"].url + "/healthcheck", timeout=10).json()
    assert health["pending"] == 0, health
    assert health["counters"]["decode_errors"] == 0, health


_STORED = re.compile(r"peer metadata stored\s+.*?rank=(\d+) role=decode session=(\S+)")
_ACKED = re.compile(r"decode endpoint acknowledged metadata\s+endpoint=tcp://[\d.]+:(\d+) "
                    r".*?rank=(\d+) role=prefill")


def test_every_decode_rank_holds_its_contributors_heads(cluster):
    """Each Prefill rank talked to exactly its Decode rank(s), each Decode rank stored the
    metadata of exactly its contributors, and nothing was refused or failed; the tokens
    above equal the reference only if every head arrived."""
    c = cluster
    p_tp, d_tp, kv_port = c["p_tp"], c["d_tp"], c["kv_port"]
    _complete(c["proxy"].url, c["model"], PROMPTS["chunked-multi-block"])
    p_log = c["prefill"].log.read_text(errors="replace")
    d_log = c["decode"].log.read_text(errors="replace")
    sent = {(int(rank), int(port) - kv_port) for port, rank in _ACKED.findall(p_log)}
    assert sent == {(p, d) for p in range(p_tp)
                    for d in compute_mapping(p_tp, d_tp, p).d_ranks}, _logs(c)
    stored: dict[int, set[str]] = {}
    for rank, session in _STORED.findall(d_log):
        stored.setdefault(int(rank), set()).add(session)
    assert {r: len(s) for r, s in stored.items()} == {
        d: len(contributor_group(p_tp, d_tp, d)) for d in range(d_tp)}, stored
    for bad in ("layout mismatch", "layer read failed", "request failed to receive its KV"):
        assert bad not in d_log, _logs(c)
