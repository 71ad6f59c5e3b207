"""rd2h installed as an operator installs it, outside the repository (issue 42).

The wheel is built from the checkout's tracked files and installed, with the
``proxy`` and ``mooncake`` extras, into a fresh virtualenv that does not see the
checkout. The virtualenv stands for an engine image: it sees the vLLM, torch and
transport packages already installed in the project's ``.venv`` (through a directory
of links to them, without rd2h's own editable install), so pip must install nothing
but rd2h and is not allowed to download (``--no-index``). From a directory outside
the checkout, that virtualenv's Python then starts a real vLLM engine that loads the
connector by module path, and the engine serves the reference engine's tokens.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from fakes.net import free_port
from servers import rd2h_kv, running, vllm_server

from rd2h.demo.tiny_model import VOCAB

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[3]
EXTRAS = "proxy,mooncake"


def _run(cmd: list[str], cwd: Path, log: Path, timeout: float = 300) -> str:
    """Run ``cmd``; its output goes to ``log``; fail with the output's end."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=env)
    with open(log, "a") as fh:
        fh.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}\n")
    assert proc.returncode == 0, f"{' '.join(cmd)}:\n{(proc.stdout + proc.stderr)[-3000:]}"
    return proc.stdout


def _image_site(site: Path, into: Path) -> Path:
    """Links to everything installed in ``site`` but rd2h (its editable install)."""
    into.mkdir()
    for entry in site.iterdir():
        name = entry.name
        if name.startswith(("rd2h", "__editable__")) or name.endswith(".pth"):
            continue
        (into / name).symlink_to(entry)
    return into


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("wheel")
    log = base / "install.log"
    # The tracked files alone (what a clean clone has), built without touching the checkout.
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    src = base / "src"
    for f in filter(None, files):
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    dist = base / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "--disable-pip-version-check", "-w", str(dist), str(src)], base, log)
    (wheel,) = dist.glob("rd2h-*.whl")
    venv = base / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], base, log)
    py = venv / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     base, log).strip())
    ours = Path(subprocess.run([sys.executable, "-c",
                                "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    image = _image_site(ours, base / "image-site")
    (site / "engine-image.pth").write_text(f"{image}\n")
    # The venv's own (older) setuptools would shadow the image's, which torch requires.
    _run([str(py), "-m", "pip", "uninstall", "--yes", "--disable-pip-version-check",
          "setuptools"], base, log)
    _run([str(py), "-m", "pip", "install", "--no-index", "--disable-pip-version-check",
          f"{wheel}[{EXTRAS}]"], base, log)
    return {"base": base, "venv": venv, "py": py, "wheel": wheel, "log": log}


def test_the_wheel_installs_rd2h_alone_outside_the_checkout(installed) -> None:
    base, py = installed["base"], installed["py"]
    out = _run([str(py), "-c", "import rd2h, vllm, torch; print(rd2h.__file__); "
                "print(vllm.__version__, torch.__version__)"], base, installed["log"])
    where = Path(out.splitlines()[0])
    assert where.is_relative_to(installed["venv"]), where
    assert not where.is_relative_to(ROOT), where
    # pip installed rd2h only: the engine image's packages satisfied every requirement.
    text = installed["log"].read_text()
    assert "Successfully installed rd2h-" in text, text[-2000:]
    installed_line = next(x for x in text.splitlines() if "Successfully installed" in x)
    assert installed_line.split() == ["Successfully", "installed",
                                      f"rd2h-{installed['wheel'].name.split('-')[1]}"]
    # The console script and the extras' imports work from there.
    assert "proxy" in _run([str(installed["venv"] / "bin" / "rd2h"), "--help"], base,
                           installed["log"])
    _run([str(py), "-c", "import rd2h.adapters.mooncake, rd2h.proxy.service"], base,
         installed["log"])
    # The wheel carries the package and its entry point, not the tests or the docs.
    names = subprocess.run([sys.executable, "-m", "zipfile", "-l", str(installed["wheel"])],
                           capture_output=True, text=True, check=True).stdout
    assert "rd2h/entry/connector.py" in names and "entry_points.txt" in names
    assert "tests/" not in names and "docs/" not in names


def test_an_engine_started_from_the_install_serves(installed, llama_model,
                                                   llama_reference) -> None:
    base = installed["base"]
    port = free_port()
    server = vllm_server("engine from the wheel", llama_model, port, base / "engine.log",
                         kv=rd2h_kv("kv_consumer", free_port(), {"transport": "cma"}),
                         log_stats=True)
    server.cmd[0] = str(installed["py"])
    server.cwd = base
    prompt = [2 + (i * 13) % (VOCAB - 2) for i in range(70)]
    body = {"model": str(llama_model), "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "return_token_ids": True}
    with running(server):
        got = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
    want = httpx.post(llama_reference.url + "/v1/completions", json=body, timeout=120)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["token_ids"] == want.json()["choices"][0]["token_ids"]
    assert "vllm:rd2h_" in metrics  # the connector's series: it was loaded and runs
    log = server.log.read_text(errors="replace")
    assert "SfaRemoteD2HConnector" in log, server.tail()
    assert str(ROOT / "rd2h") not in log, "the engine loaded rd2h from the checkout"
