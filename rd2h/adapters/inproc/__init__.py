"""In-process transfer engine: peers in the same process, reads by memmove."""

from rd2h.adapters.inproc.transport import InprocTransferEngine
from rd2h.adapters.regions import RegionTable, validate_batch

__all__ = ["InprocTransferEngine", "RegionTable", "validate_batch"]
