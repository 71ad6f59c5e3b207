"""Greedy completions with logprobs, as the exact-comparison modules ask for them (a
P/D pair behind ``rd2h proxy`` against a plain engine: ``test_deepseek_v4_e2e``,
``test_deepseek_v32_e2e``), and rd2h's series summed over an engine's ``/metrics``."""

from __future__ import annotations

import httpx


def post(url: str, model: str, prompt: list[int], max_tokens: int = 12, logprobs: int = 5,
         timeout: float = 300.0) -> dict:
    """One greedy completion of ``prompt`` (token ids); the response must be 200."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": logprobs, "return_token_ids": True}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
    assert resp.status_code == 200, resp.text
    return resp.json()


def answer(out: dict) -> dict:
    """What greedy decoding served: tokens, each one's logprob, the top-k at each step."""
    (choice,) = out["choices"]
    lp = choice["logprobs"]
    return {"tokens": list(choice["token_ids"]), "logprobs": lp["token_logprobs"],
            "top": lp["top_logprobs"]}


def metric_sum(server, name: str) -> float:
    """The sum of series ``name`` on the engine's /metrics (0 when absent)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))
