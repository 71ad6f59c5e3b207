"""Recording vLLM KV connectors: real ``KVConnectorBase_V1`` subclasses that note every
hook call in one shared ``JOURNAL``, so a test sees the order in which a multi-connector
calls its sub-connectors. vLLM builds them from a config through its own factory
(``kv_connector_module_path: "fakes.vllm_connectors"``).

Each instance is named by ``kv_connector_extra_config["name"]`` (default: the class
name). ``RecordingSink`` takes ``accept_waiter`` (default True) and, like a layer-wise
offload store, calls the waiter it was handed before it reuses a layer's buffer (in
``wait_for_layer_load``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)

JOURNAL: list[tuple[str, str, tuple[Any, ...]]] = []  # (connector name, hook, args)
INSTANCES: list[RecordingConnector] = []


def layer_idx(layer_name: str) -> int:
    return int(layer_name.split(".")[2])  # "model.layers.<i>.self_attn"


def calls(hook: str) -> list[str]:
    """The connector names that received ``hook``, in call order."""
    return [who for who, name, _ in JOURNAL if name == hook]


def reset() -> None:
    JOURNAL.clear()
    INSTANCES.clear()


@dataclass
class _Meta(KVConnectorMetadata):
    who: str


class RecordingConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self.name = str(extra.get("name", type(self).__name__))
        self.matched_tokens = int(extra.get("matched_tokens", 0))
        INSTANCES.append(self)

    def _note(self, hook: str, *args: Any) -> None:
        JOURNAL.append((self.name, hook, args))

    # scheduler
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        return self.matched_tokens, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._note("update_state_after_alloc", request.request_id, blocks.get_block_ids(),
                   num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return _Meta(self.name)

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> Any:
        return False, None

    # worker
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._note("start_load_kv")

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._note("wait_for_layer_load", layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        self._note("save_kv_layer", layer_name)

    def wait_for_save(self) -> None:
        self._note("wait_for_save")


class RecordingPlain(RecordingConnector):
    """Neither provider nor sink, and no Ascend hook."""


class RecordingProvider(RecordingConnector):
    """A buffer-reuse provider (rd2h's role in spec 11)."""

    supports_layerwise_buffer_reuse = True
    requires_full_blocks_on_update_after_alloc = True

    def wait_for_layer_reuse(self, layer_idx: int) -> None:
        self._note("wait_for_layer_reuse", layer_idx)

    def on_kv_cache_written(self, layer_name: str) -> None:
        self._note("on_kv_cache_written", layer_name)


class RecordingSink(RecordingConnector):
    """A layer-wise offload store that waits on a provider's gate before buffer reuse."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self.accept = bool(extra.get("accept_waiter", True))
        self.waiter: Any = None

    def set_external_slot_release_waiter(self, waiter: Any) -> bool:
        self._note("set_external_slot_release_waiter", waiter)
        if self.accept:
            self.waiter = waiter
        return self.accept

    def wait_for_layer_load(self, layer_name: str) -> None:
        super().wait_for_layer_load(layer_name)
        if self.waiter is not None:
            self._note("calls_waiter", layer_name)
            self.waiter(layer_idx(layer_name))

    def on_kv_cache_written(self, layer_name: str) -> None:
        self._note("on_kv_cache_written", layer_name)


class ProviderWithoutWaiter(RecordingConnector):
    """Advertises the provider flag but offers no waiter: a configuration error."""

    supports_layerwise_buffer_reuse = True
