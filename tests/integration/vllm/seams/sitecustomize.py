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

# With ``RD2H_TEST_ADMIT_DELAY_FLAG`` naming a file: while it exists, a Decode worker
# waits that file's number of seconds before admitting a step's loads (a Decode engine
# slow to admit, as under load): announcements of a parallel dispatch then arrive
# before the admission. ``test_disaggregated_e2e`` uses it.
_ADMIT_FLAG = os.environ.get("RD2H_TEST_ADMIT_DELAY_FLAG")

if _ADMIT_FLAG:
    import time

    from rd2h.app.connector.decode_worker import DecodeWorker

    _bind = DecodeWorker.bind_connector_metadata

    def _slow_admission(self, plan):
        if plan.loads:
            try:
                with open(_ADMIT_FLAG) as f:
                    time.sleep(float(f.read().strip() or 0))
            except (OSError, ValueError):
                pass
        return _bind(self, plan)

    DecodeWorker.bind_connector_metadata = _slow_admission
