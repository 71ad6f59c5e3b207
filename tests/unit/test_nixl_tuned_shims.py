"""The benchmark-only shims behind ``serving_vs_peers.py``'s ``nixl-tuned`` target
(``benchmarks/nixl_tuned/sitecustomize.py``), checked against a stand-in ``nixl``
package (CI does not install the ``bench`` extra): inert without the switch; with it,
the NIXL worker's ``sched_setaffinity`` is suppressed (and no other caller's), and every
``nixl_agent_config`` is built without the progress thread."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SHIMS = Path(__file__).resolve().parents[2] / "benchmarks" / "nixl_tuned"

FAKE_API = '''
class nixl_agent_config:
    def __init__(self, enable_prog_thread=True, num_threads=0):
        self.enable_pthread = enable_prog_thread
        self.num_threads = num_threads
'''
# The real wheel's __init__ puts its CUDA build's module at sys.modules["nixl._api"].
FAKE_INIT = ("import importlib, sys\n"
             "sys.modules['nixl._api'] = importlib.import_module('nixl_fake_api')\n")
FAKE_WORKER = "import os\n\ndef pin():\n    os.sched_setaffinity(0, {0})\n"
PROBE = '''
import os
import nixl._api as api
from vllm_like.nixl import base_worker
before = os.sched_getaffinity(0)
base_worker.pin()
after_worker = os.sched_getaffinity(0)
os.sched_setaffinity(0, {0})
after_other = os.sched_getaffinity(0)
c = api.nixl_agent_config(num_threads=4)
print(sorted(before) == sorted(after_worker), sorted(after_other), c.enable_pthread, c.num_threads)
'''


def _run(tmp_path: Path, tuned: bool) -> subprocess.CompletedProcess[str]:
    (tmp_path / "nixl").mkdir()
    (tmp_path / "nixl" / "__init__.py").write_text(FAKE_INIT)
    (tmp_path / "nixl_fake_api.py").write_text(FAKE_API)
    worker = tmp_path / "vllm_like" / "nixl"
    worker.mkdir(parents=True)
    (tmp_path / "vllm_like" / "__init__.py").write_text("")
    (worker / "__init__.py").write_text("")
    (worker / "base_worker.py").write_text(FAKE_WORKER)
    env = {k: v for k, v in os.environ.items() if k != "RD2H_BENCH_NIXL_TUNED"}
    env["PYTHONPATH"] = os.pathsep.join((str(SHIMS), str(tmp_path)))
    if tuned:
        env["RD2H_BENCH_NIXL_TUNED"] = "1"
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                          text=True, timeout=60, check=True)


def test_with_the_switch_both_handicaps_are_off(tmp_path: Path) -> None:
    assert len(os.sched_getaffinity(0)) >= 2, "an affinity change needs two cores to show"
    out = _run(tmp_path, tuned=True)
    kept, other, pthread, threads = out.stdout.split(maxsplit=3)
    assert kept == "True"  # the NIXL worker's call did nothing
    assert other == "[0]"  # any other caller's still works
    assert (pthread, threads.strip()) == ("False", "4")
    assert "suppressed the NIXL worker's sched_setaffinity" in out.stderr
    assert "enable_prog_thread=False" in out.stderr


def test_without_the_switch_the_shims_do_nothing(tmp_path: Path) -> None:
    assert len(os.sched_getaffinity(0)) >= 2, "an affinity change needs two cores to show"
    out = _run(tmp_path, tuned=False)
    kept, _, pthread, _ = out.stdout.split(maxsplit=3)
    assert (kept, pthread) == ("False", "True")
    assert "nixl-tuned shim" not in out.stderr
