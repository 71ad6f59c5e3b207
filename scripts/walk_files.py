"""Which of rd2h's files one announcement walks through, on each side.

Prefill and Decode run in this process on the in-memory control network and the
in-process transport (the same drivers, sessions and codec as in production). A first
transfer does the handshake; during the second (one layer, one request) a profile hook
records every rd2h function called, per thread:

- Decode: its receive thread, from the READ_READY_BATCH frame to the reply (decode,
  validate, plan, read, verify, answer);
- Prefill: the caller's ``submit`` and the sender thread, from the submitted layer to
  its answer (book, announce, encode, send, read the reply, complete).

Run: ``.venv/bin/python scripts/walk_files.py`` (add ``--list`` for the files). The
count guards the house's layout (``tests/unit/test_architecture.py``).
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = str(ROOT / "rd2h") + "/"


def walks() -> dict[str, list[str]]:
    """``{"decode": files, "prefill": files}``, paths relative to the checkout."""
    sys.path.insert(0, str(ROOT / "tests"))
    import numpy as np
    from fakes.control import MemoryNetwork
    from fakes.logs import RecordingLogger

    from rd2h.adapters.inproc import InprocTransferEngine
    from rd2h.app.settings import Deadlines, Rd2hSettings
    from rd2h.bootstrap.container import bootstrap
    from rd2h.domain.planning.layout import (
        DestinationLayout,
        DestTensor,
        SourceLayout,
        TensorComponent,
    )
    from rd2h.domain.prefill.announce import LayerTarget
    from rd2h.domain.wire.protocol import ReadRequest

    ep, nb, width = "mem://d0", 8, 256
    net = MemoryNetwork()
    p_engine, d_engine = InprocTransferEngine(), InprocTransferEngine()
    src_buf = np.arange(nb * width, dtype=np.uint32).astype(np.uint8).reshape(nb, width)
    dst_buf = np.zeros((nb, width), dtype=np.uint8)
    p_engine.register_memory(src_buf.ctypes.data, src_buf.nbytes)
    d_engine.register_memory(dst_buf.ctypes.data, dst_buf.nbytes)
    name = "model.layers.0.attn"
    src = SourceLayout(name, (TensorComponent(src_buf.ctypes.data, width, 1),))
    dst = DestinationLayout(name, (DestTensor(dst_buf.ctypes.data, width, nb),))
    receiver = bootstrap(Rd2hSettings(role="decode"), control_server=lambda: net.server(ep),
                         transport=d_engine, logger=RecordingLogger()
                         ).decode_receiver(destinations={name: dst})
    sender = bootstrap(
        Rd2hSettings(role="prefill", deadlines=Deadlines(meta_ack_s=5, layer_ack_s=5)),
        control_clients=net.clients, logger=RecordingLogger(),
    ).prefill_sender(p_session=p_engine.session_id, layers={0: src})
    seen: dict[str, set[str]] = defaultdict(set)
    recording = threading.Event()

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and recording.is_set():
            path = frame.f_code.co_filename
            if path.startswith(PACKAGE):
                seen[threading.current_thread().name].add(path[len(str(ROOT)) + 1:])

    threading.setprofile(hook)  # threads started from here on
    sys.setprofile(hook)  # the caller's thread (submit)
    receiver.start()
    sender.start()
    try:
        for n, record in ((0, False), (1, True)):
            rid = f"req-{n}"
            receiver.admit(rid + "X" * 9, [n + 2], [])
            if record:
                recording.set()
            sender.submit(0, None, [LayerTarget(ep, ReadRequest(rid, (n,), (), 0, 0), True,
                                                0, 1)])
            sender.wait_for_layer_send(0, timeout=5)
            recording.clear()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        sender.stop(2)
        receiver.stop(2)
        p_engine.close()
        d_engine.close()
    assert np.array_equal(dst_buf[3], src_buf[1]), "the recorded transfer did not land"
    main = threading.main_thread().name
    decode = sorted(f for t, files in seen.items() if "decode" in t.lower() for f in files)
    prefill = sorted({f for t, files in seen.items()
                      if t == main or "prefill" in t.lower() for f in files})
    return {"decode": decode, "prefill": prefill}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print the files too")
    args = parser.parse_args()
    for side, files in walks().items():
        print(f"{side}: {len(files)} files")
        if args.list:
            for f in files:
                print(f"  {f}")


if __name__ == "__main__":
    main()
