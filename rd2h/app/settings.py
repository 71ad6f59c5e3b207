"""rd2h settings (pydantic): validated up front, errors name the field."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rd2h.domain.errors import TopologyError
from rd2h.domain.topology import MAX_PORT, plan_ports

Transport = Literal["cma", "inproc", "memfabric", "mooncake"]
Role = Literal["prefill", "decode"]


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


class Rd2hSettings(BaseModel):
    """One rd2h endpoint (a Prefill or Decode TP rank)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

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
    max_frame_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "WARNING"
    deadlines: Deadlines = Field(default_factory=Deadlines)

    @model_validator(mode="after")
    def _check(self) -> Rd2hSettings:
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} must be < tp_size {self.tp_size}")
        if self.role == "decode":
            try:
                plan_ports(self.kv_port, self.global_dp_rank, self.tp_size)
            except TopologyError as exc:
                raise ValueError(str(exc)) from exc
        return self

    @property
    def rank_port(self) -> int:
        """Decode: the port this rank binds (spec 9)."""
        return plan_ports(self.kv_port, self.global_dp_rank, self.tp_size).rank_port(self.tp_rank)

    @property
    def base_port(self) -> int:
        return plan_ports(self.kv_port, self.global_dp_rank, self.tp_size).base_port
