"""What the kernel says about one of this process's threads."""

from __future__ import annotations

from pathlib import Path


def voluntary_switches(tid: int) -> int:
    """The thread's voluntary context switches: each sleep it woke from."""
    for line in Path(f"/proc/self/task/{tid}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise AssertionError(f"no voluntary_ctxt_switches for thread {tid}")
