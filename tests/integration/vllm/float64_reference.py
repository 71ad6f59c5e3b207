"""Greedy tokens from an independent float64 forward of a Hugging Face checkpoint.

The reference engine is itself vLLM; this is the check that the reference is
right. transformers' own model runs in float64 (its own KV cache between steps),
so nothing is shared with vLLM's kernels, its cache layout, or its
rotary-embedding op.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


class Float64Greedy:
    def __init__(self, checkpoint: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self._torch = torch
        self._memo: dict[tuple[tuple[int, ...], int], tuple[list[int], float]] = {}
        self.model = AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=torch.float64
        ).eval()

    def generate(self, prompt: Sequence[int], max_tokens: int) -> tuple[list[int], float]:
        """Greedy ``max_tokens`` after ``prompt``; also the smallest gap between the
        best and second-best logit over those steps (a tie would make greedy tokens
        depend on rounding, which a float32 engine may then round the other way)."""
        key = (tuple(prompt), max_tokens)
        if key not in self._memo:
            self._memo[key] = self._generate(prompt, max_tokens)
        tokens, margin = self._memo[key]
        return list(tokens), margin

    def _generate(self, prompt: Sequence[int], max_tokens: int) -> tuple[list[int], float]:
        torch = self._torch
        step = list(prompt)
        past = None
        out: list[int] = []
        margin = float("inf")
        with torch.inference_mode():
            for _ in range(max_tokens):
                res = self.model(torch.tensor([step]), past_key_values=past, use_cache=True)
                past = res.past_key_values
                top = torch.topk(res.logits[0, -1], 2)
                margin = min(margin, float(top.values[0] - top.values[1]))
                tok = int(top.indices[0])
                out.append(tok)
                step = [tok]
        return out, margin
