"""``kv_connector_extra_config`` for rd2h, validated up front (pydantic).

Unknown keys and wrong types are refused with a message naming the key, before
any socket is opened or any memory registered.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rd2h.adapters.memfabric.config import TransferTypeName
from rd2h.app.settings import Deadlines, Transport, check_memfabric_fields
from rd2h.domain.errors import Rd2hError


class ConnectorConfigError(Rd2hError, ValueError):
    """``kv_connector_extra_config`` is not valid; the message names the key."""


class ConnectorOptions(BaseModel):
    """Every option of ``kv_connector_extra_config`` (all optional)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    transport: Transport = Field("cma", description="transfer engine")
    host: str = Field(
        "127.0.0.1", min_length=1,
        description="Decode: address its control sockets bind and that Prefill is told; "
        "network transports bind and advertise it",
    )
    engine_id: str = Field("", description="advertised engine id (default: vLLM's)")
    cma_threads: int = Field(1, ge=1, le=64)
    mooncake_protocol: Literal["tcp", "rdma"] = "tcp"
    mooncake_device: str = ""
    mooncake_env: dict[str, str] = Field(default_factory=dict)
    memfabric_store_url: str | None = Field(
        None,
        description="MemFabric config store of the deployment, 'tcp://<IPv4>:<port>' "
        "(required with transport 'memfabric'; 'host' must then be a numeric IPv4 address)",
    )
    memfabric_transfer_type: TransferTypeName = Field(
        "SDMA", description="MemFabric data path (TransDataOpType)"
    )
    memfabric_device_id: int | None = Field(
        None, ge=0,
        description="Ascend device the rank's MemFabric engine binds; unset: the rank's "
        "local device as vLLM assigned it (its local rank)",
    )
    memfabric_nic: str = Field("", description="MemFabric NIC (RDMA transfer types), or empty")
    destinations: Literal["vllm", "sparse_kv_pool"] = Field(
        "vllm",
        description="Decode destination memory: vLLM's registered KV caches (each rank "
        "has its own main cache) or a SparseKVOffloadManager-style TP-shared host pool",
    )
    main_sharing: Literal["rank_local", "shared_pool"] | None = Field(
        None,
        description="how Decode ranks hold main KV; follows 'destinations' when unset "
        "(vllm -> rank_local: every rank pulls all main blocks; sparse_kv_pool -> "
        "shared_pool: each rank pulls its share)",
    )
    buffer_reuse: bool = Field(
        False,
        description="Prefill: layers share physical buffers, so a layer's next write "
        "waits for Decode to have read it (wait_for_layer_load / wait_for_layer_reuse)",
    )
    device_events: Literal["auto", "cpu", "npu"] = "auto"
    deadlines: Deadlines = Field(default_factory=Deadlines)
    metaserver_timeout_s: float = Field(5.0, gt=0, description="one metaserver POST")
    metaserver_retries: int = Field(3, ge=0, description="immediate retries on transport error")
    metaserver_retry_interval_s: float = Field(1.0, gt=0)
    max_frame_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "WARNING"

    @model_validator(mode="after")
    def _check(self) -> ConnectorOptions:
        wanted = "rank_local" if self.destinations == "vllm" else "shared_pool"
        if self.main_sharing is not None and self.main_sharing != wanted:
            raise ValueError(
                f"main_sharing {self.main_sharing!r} does not fit destinations "
                f"{self.destinations!r} (which needs {wanted!r})"
            )
        check_memfabric_fields(self.transport, self.memfabric_store_url, self.host)
        return self

    @property
    def main_shared(self) -> bool:
        # main_sharing, when set, was checked above to agree with destinations.
        return self.destinations == "sparse_kv_pool"

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> ConnectorOptions:
        """Validate ``extra``; raise ``ConnectorConfigError`` naming every bad key."""
        if extra is not None and not isinstance(extra, Mapping):
            raise ConnectorConfigError(
                f"kv_connector_extra_config must be a JSON object, got {type(extra).__name__}"
            )
        try:
            return cls.model_validate(dict(extra or {}))
        except ValidationError as exc:
            problems = []
            for err in exc.errors():
                key = ".".join(str(p) for p in err["loc"]) or "(config)"
                if err["type"] == "extra_forbidden":
                    problems.append(f"unknown key {key!r}")
                else:
                    problems.append(f"{key!r}: {err['msg']}")
            raise ConnectorConfigError(
                "invalid kv_connector_extra_config for rd2h: " + "; ".join(problems)
            ) from None
