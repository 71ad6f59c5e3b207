"""MemFabric (Ascend) transfer engine adapter; imports ``memfabric_hybrid`` only when an
engine or a config store is started."""

from rd2h.adapters.memfabric.config import (
    ROLES,
    TRANSFER_TYPES,
    MemFabricConfig,
    TransferTypeName,
    parse_store_url,
)
from rd2h.adapters.memfabric.library import MemFabricLibrary, load_library
from rd2h.adapters.memfabric.transport import MemFabricTransferEngine, start_config_store

__all__ = [
    "ROLES",
    "TRANSFER_TYPES",
    "MemFabricConfig",
    "MemFabricLibrary",
    "MemFabricTransferEngine",
    "TransferTypeName",
    "load_library",
    "parse_store_url",
    "start_config_store",
]
