"""A test-only vLLM scheduler for a plain reference engine that computes each prompt in
the chunks a P/D pair computes it in: the first N-1 tokens in chunks of the token
budget (what Prefill computes of a prompt shortened by its last token, the N-1 scheme),
then the last prompt token alone (what Decode computes). Run it with
``--scheduler-cls pd_split_scheduler.PdSplitScheduler --max-num-seqs 1`` and prefix
caching off; this directory on the engine's PYTHONPATH.

Why: vLLM 0.32's bfloat16 CPU kernels are not split-invariant (a prompt computed in
chunks [64, 64, 3] and one computed in [64, 64, 2, 1] differ in the last bits, and a
tiny random model turns that into other tokens within a few positions), so the exact
reference for a P/D answer is a plain engine computing the same split. The kernels,
weights and cache are the plain engine's own; only where a prefill chunk ends differs.

How: with one request at a time (``--max-num-seqs 1``), before each step the token
budget is lowered so that a chunk of the one request in prefill ends at N-1 instead of
crossing it; every other step keeps the configured budget. Where vLLM runs without
chunked prefill, prompts are computed whole, as vLLM computes them.
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler


class PdSplitScheduler(Scheduler):
    def schedule(self, *args, **kwargs):
        full = self.max_num_scheduled_tokens
        if self.running:
            request = self.running[0]
        elif self.waiting:
            request = self.waiting.peek_request()
        else:
            request = None
        # Without chunked prefill (vLLM turns it off for a model with non-causal attention
        # layers) a prompt is never split: a lower budget would only starve it.
        if request is not None and self.scheduler_config.enable_chunked_prefill:
            last = request.num_prompt_tokens - 1  # the position Decode computes alone
            done = request.num_computed_tokens
            if done < last:
                self.max_num_scheduled_tokens = min(full, last - done)
        try:
            return super().schedule(*args, **kwargs)
        finally:
            self.max_num_scheduled_tokens = full
