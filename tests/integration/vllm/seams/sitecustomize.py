"""A test seam, never shipped: with ``RD2H_TEST_MISPLACE_FLAG`` naming a file, every
cma read of this process lands in the wrong destination while that file exists (the
destinations of equal-sized descriptors rotated, e.g. K's blocks into V's; a lone
descriptor gets its bytes flipped instead). ``test_verify_kv_e2e`` puts this directory
on a Decode engine's PYTHONPATH to reintroduce a wrong-destination bug."""

import os

_FLAG = os.environ.get("RD2H_TEST_MISPLACE_FLAG")

if _FLAG:
    import numpy as np

    from rd2h.adapters.cma.transport import CmaTransferEngine

    _read = CmaTransferEngine.batch_read

    def _misplacing(self, session, local_addrs, remote_addrs, lengths):
        if not os.path.exists(_FLAG):
            return _read(self, session, local_addrs, remote_addrs, lengths)
        local = np.asarray(local_addrs, dtype=np.int64)
        sizes = np.asarray(lengths, dtype=np.int64)
        if local.size >= 2 and (sizes == sizes[0]).all():
            return _read(self, session, np.roll(local, 1), remote_addrs, lengths)
        _read(self, session, local_addrs, remote_addrs, lengths)
        view = (np.ctypeslib.ctypes.c_uint8 * int(sizes[0])).from_address(int(local[0]))
        arr = np.ctypeslib.as_array(view)
        arr[: min(64, arr.size)] ^= 0xFF
        return None

    CmaTransferEngine.batch_read = _misplacing
