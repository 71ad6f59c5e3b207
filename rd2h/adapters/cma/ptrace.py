"""Letting a sibling process read this one with ``process_vm_readv`` under Yama.

With Yama ``ptrace_scope`` = 1 only ancestors may read a process's memory. A process
that exposes memory to a sibling (two children of one launcher) names the launcher with
``prctl(PR_SET_PTRACER, pid)``: that process and its descendants may then read it.
"""

from __future__ import annotations

import ctypes
import sys

PR_SET_PTRACER = 0x59616D61  # "Yama"


def allow_reads_by(pid: int) -> bool:
    """Allow ``pid`` and its descendants to read this process; False where that is not
    possible or not needed (no Yama, not Linux). Never raises."""
    if not sys.platform.startswith("linux") or pid <= 0:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0)
    except (OSError, AttributeError):
        return False
    return rc == 0
