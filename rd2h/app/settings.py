"""rd2h settings (pydantic): validated up front, errors name the field."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from rd2h.adapters.memfabric.config import TransferTypeName, parse_ipv4, parse_store_url
from rd2h.domain.errors import TopologyError
from rd2h.domain.topology import MAX_PORT, plan_ports

Transport = Literal["cma", "inproc", "memfabric", "mooncake"]
Role = Literal["prefill", "decode"]
MIN_SECRET_CHARS = 16


class Deadlines(BaseModel):
    """Every wait in rd2h has one of these deadlines (seconds)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    meta_ack_s: float = Field(10.0, gt=0, description="MF_META -> b'ACK' on Prefill")
    layer_ack_s: float = Field(30.0, gt=0, description="READ_READY_BATCH -> reply on Prefill")
    device_event_s: float = Field(30.0, gt=0, description="a layer's device event on Prefill")
    request_s: float = Field(120.0, gt=0, description="Decode request: admission -> all KV")
    tp_exchange_s: float = Field(60.0, gt=0, description="one TP all-gather among Decode ranks")
    start_s: float = Field(10.0, gt=0, description="start of a sender / receiver")
    stop_s: float = Field(5.0, gt=0, description="stop (join) of a sender / receiver")
    heartbeat_ivl_s: float = Field(
        1.0, ge=0, description="control-connection heartbeat interval (0 = no heartbeats)"
    )
    heartbeat_timeout_s: float = Field(
        5.0, gt=0, description="a silent control connection is dropped (and its pending "
        "layers / requests failed) after this long"
    )

    @model_validator(mode="after")
    def _check_heartbeat(self) -> Deadlines:
        if self.heartbeat_ivl_s > 0 and self.heartbeat_timeout_s <= self.heartbeat_ivl_s:
            raise ValueError(
                f"heartbeat_timeout_s {self.heartbeat_timeout_s:g} must exceed "
                f"heartbeat_ivl_s {self.heartbeat_ivl_s:g}"
            )
        return self


def check_memfabric_fields(transport: str, store_url: str | None, host: str) -> None:
    """MemFabric needs a ``tcp://<IPv4>:<port>`` config store and a numeric IPv4 host
    (the library refuses host names); shared by the settings and the connector options."""
    if store_url is not None:
        parse_store_url(store_url)
    if transport == "memfabric":
        if store_url is None:
            raise ValueError("memfabric_store_url is required with transport 'memfabric'")
        parse_ipv4(host, "host (with transport 'memfabric')")


class Rd2hSettings(BaseModel):
    """One rd2h endpoint (a Prefill or Decode TP rank)."""

    # Errors name the field and the rule but never echo input: it may hold the secret.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    role: Role
    transport: Transport = "cma"
    host: str = Field(
        "127.0.0.1", min_length=1,
        description="this endpoint's address: Decode binds its control socket there; "
        "network transports (mooncake) bind and advertise it",
    )
    kv_port: int = Field(30000, ge=1, le=MAX_PORT)
    global_dp_rank: int = Field(0, ge=0)
    tp_size: int = Field(1, ge=1)
    tp_rank: int = Field(0, ge=0)
    cma_threads: int = Field(1, ge=1, le=64)
    mooncake_protocol: Literal["tcp", "rdma"] = "tcp"
    mooncake_device: str = Field("", description="RDMA device names (mooncake rdma)")
    mooncake_env: dict[str, str] = Field(
        default_factory=dict, description="MC_* tuning variables for the Mooncake engine"
    )
    memfabric_store_url: str | None = Field(
        None,
        description="MemFabric config store shared by the deployment, 'tcp://<IPv4>:<port>' "
        "(required with transport 'memfabric'); host must then be a numeric IPv4 address",
    )
    memfabric_transfer_type: TransferTypeName = Field(
        "SDMA", description="MemFabric data path (TransDataOpType)"
    )
    memfabric_device_id: int = Field(0, ge=0, description="Ascend device this rank binds")
    memfabric_nic: str = Field("", description="MemFabric NIC (RDMA transfer types), or empty")
    max_frame_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    auth_secret: SecretStr | None = Field(
        None,
        description="shared secret (>= 16 characters) for HMAC-SHA256 signing of every "
        "control message; Prefill and Decode must configure the same one. Unset: "
        "unsigned legacy messages. Set: unsigned or wrongly signed messages are refused",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "WARNING"
    deadlines: Deadlines = Field(default_factory=Deadlines)

    @model_validator(mode="after")
    def _check(self) -> Rd2hSettings:
        secret = self.auth_secret
        if secret is not None and len(secret.get_secret_value()) < MIN_SECRET_CHARS:
            raise ValueError(
                f"auth_secret must have at least {MIN_SECRET_CHARS} characters "
                f"(got {len(secret.get_secret_value())})"
            )
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} must be < tp_size {self.tp_size}")
        if self.role == "decode":
            try:
                plan_ports(self.kv_port, self.global_dp_rank, self.tp_size)
            except TopologyError as exc:
                raise ValueError(str(exc)) from exc
        return self

    @model_validator(mode="after")
    def _check_memfabric(self) -> Rd2hSettings:
        check_memfabric_fields(self.transport, self.memfabric_store_url, self.host)
        return self

    @property
    def rank_port(self) -> int:
        """Decode: the port this rank binds (spec 9)."""
        return plan_ports(self.kv_port, self.global_dp_rank, self.tp_size).rank_port(self.tp_rank)

    @property
    def base_port(self) -> int:
        return plan_ports(self.kv_port, self.global_dp_rank, self.tp_size).base_port
