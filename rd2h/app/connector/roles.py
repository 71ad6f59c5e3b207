"""What vLLM asks a KV connector, in plain values: one role object per role.

The vLLM adapter (``rd2h.entry.connector``) holds exactly one
``ConnectorRole`` and forwards every hook to it after translating vLLM's objects
into the plain values below (``rd2h.entry.translate``). The defaults
are what a role with nothing to do answers, so the adapter never asks which
role it has. The four real roles (``DecodeScheduler``, ``PrefillScheduler``,
``DecodeWorker``, ``PrefillWorker``) override the hooks they serve.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from rd2h.app.connector.plans import StepPlan

BlockIds = Sequence[Sequence[int]]  # one list of block ids per KV cache group


@dataclass(frozen=True)
class RequestFacts:
    """A vLLM ``Request`` as the connector needs it. ``params`` is the request's own
    ``kv_transfer_params`` mapping (the Decode scheduler clears a flag in it)."""

    request_id: str
    prompt_len: int
    num_prompt_tokens: int
    num_computed_tokens: int
    params: MutableMapping[str, Any] | None


@dataclass(frozen=True)
class ScheduledRequest:
    """One request of a ``SchedulerOutput``: blocks added this step (None: none), tokens
    computed before it and scheduled in it; ``replace_blocks`` for new or resumed ones."""

    request_id: str
    new_block_ids: BlockIds | None
    num_computed_tokens: int
    num_scheduled_tokens: int
    replace_blocks: bool


@dataclass(frozen=True)
class TransferResults:
    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()
    failed_recving: frozenset[str] = frozenset()


class ConnectorRole:
    """Every hook, answering "nothing to do"."""

    # -- scheduler side
    def get_num_new_matched_tokens(self, request: RequestFacts,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: RequestFacts, block_ids: BlockIds,
                                 num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduled: Sequence[ScheduledRequest]) -> StepPlan:
        return StepPlan()

    def update_connector_output(self, admitted: Mapping[str, int],
                                finished_recving: Iterable[str] = ()) -> None:
        """The workers' admission reports (summed over ranks) and the requests whose
        KV vLLM now holds as received."""
        return None

    def request_finished(self, request_id: str) -> bool:
        """True: keep the request's blocks until ``finished_sending`` reports it."""
        return False

    def prompt_backoff(self, request: RequestFacts) -> int:
        """How many trailing prompt tokens this engine leaves uncomputed (Prefill of a
        model with recurrent state: Decode computes them); asked once, on arrival."""
        return 0

    def requests_preempted(self, request_ids: Iterable[str]) -> None:
        """vLLM preempted these requests in the step being built (and freed their
        blocks without ``request_finished``); called before ``build_connector_meta``."""
        return None

    # -- worker side
    def handle_preemptions(self, plan: StepPlan) -> None:
        """Before the step's forward, which may overwrite the preempted requests' blocks."""
        return None

    def bind_connector_metadata(self, plan: StepPlan) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str) -> None:
        return None

    def wait_for_save(self) -> None:
        """After the step's forward (every layer computed)."""
        return None

    def wait_for_layer_reuse(self, layer_idx: int) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: Iterable[str]) -> TransferResults:
        return TransferResults()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def take_admitted(self) -> list[str]:
        return []

    def kv_connector_stats(self) -> dict[str, Any]:
        """Cumulative counters; ``read_latency_ms`` (if present) holds the latencies
        since the last call."""
        return {}

    def shutdown(self) -> None:
        return None
