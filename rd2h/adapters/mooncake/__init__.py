"""Mooncake transfer engine adapter (TCP or RDMA); imports ``mooncake`` only when built."""

from rd2h.adapters.mooncake.transport import MooncakeTransferEngine

__all__ = ["MooncakeTransferEngine"]
