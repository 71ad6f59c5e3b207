"""``rd2h proxy``'s ``/health`` probes over real loopback sockets and real deadlines: an
engine whose API server answers a probe late is kept until ``eject_after_probe_timeouts``
probes in a row got no answer in time; one that refuses, or answers anything but 200,
is ejected at the first probe."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fakes.logs import RecordingLogger
from fakes.net import HOST, free_port

from rd2h.proxy.metrics import ProxyMetrics
from rd2h.proxy.options import ProxyConfig
from rd2h.proxy.router import EngineRouter

pytestmark = pytest.mark.integration

PROBE_S, DEADLINE_S = 0.05, 0.25


class Engine:
    """A loopback HTTP server whose ``/health`` answers each probe as ``answers`` says
    (cycled): "ok" at once, "late" after longer than the probe deadline, "500"."""

    def __init__(self, answers: list[str]) -> None:
        self.answers = answers
        self.probes: list[str] = []
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> str:
        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
            try:
                await reader.readuntil(b"\r\n\r\n")
                answer = self.answers[len(self.probes) % len(self.answers)]
                self.probes.append(answer)
                if answer == "late":
                    await asyncio.sleep(DEADLINE_S * 4)
                status = b"500 Internal Server Error" if answer == "500" else b"200 OK"
                writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-length: 0\r\n\r\n")
                await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        self.server = await asyncio.start_server(on_connect, HOST, 0)
        return f"http://{HOST}:{self.server.sockets[0].getsockname()[1]}"

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def _probe(answers: list[str] | None, probes: int, **config: Any) -> dict[str, Any]:
    """Probe one Decode engine (``None``: nothing listens) until it was probed
    ``probes`` times or ejected; what the router saw."""

    async def main() -> dict[str, Any]:
        engine = Engine(answers or ["ok"])
        url = await engine.start() if answers is not None else f"http://{HOST}:{free_port()}"
        log = RecordingLogger()
        metrics = ProxyMetrics(lambda: 0, lambda: 0)
        cfg = ProxyConfig(prefill=[f"http://{HOST}:{free_port()}"], decode=[url],
                          public_url=f"http://{HOST}:{free_port()}",
                          probe_interval_s=PROBE_S, probe_timeout_s=DEADLINE_S,
                          eject_base_s=30.0, eject_max_s=30.0, **config)
        router = EngineRouter(cfg, metrics, log)
        inst = router.pools["decode"].get(url)
        router.start()
        try:
            loop = asyncio.get_running_loop()
            end = loop.time() + 20
            while inst.healthy and router.probes < probes and loop.time() < end:
                await asyncio.sleep(0.01)
            ejections = {s.labels["cause"]: s.value
                         for m in metrics.registry.collect() if m.name.endswith("ejections")
                         for s in m.samples if s.name.endswith("_total")
                         and s.labels["role"] == "decode"}
            return {"healthy": inst.healthy, "probes": list(engine.probes),
                    "error": inst.last_error, "ejections": ejections,
                    "late_kept": [kw for lv, e, kw in log.records
                                  if e.startswith("health probe answered late")]}
        finally:
            await router.aclose()
            engine.close()

    return asyncio.run(asyncio.wait_for(main(), 60))


def test_late_answers_that_alternate_with_good_ones_never_eject() -> None:
    seen = _probe(["late", "ok"], probes=8)
    assert seen["healthy"], seen
    assert seen["probes"].count("late") >= 3 and seen["ejections"] == {}
    assert seen["late_kept"] and {kw["in_row"] for kw in seen["late_kept"]} == {1}
    assert "probe_timeout: /health: ReadTimeout" in seen["error"]


def test_a_hung_engine_is_ejected_after_two_late_probes_in_a_row() -> None:
    seen = _probe(["late"], probes=50)
    assert not seen["healthy"], seen
    assert seen["probes"] == ["late", "late"]
    assert seen["ejections"] == {"probe_timeout": 1.0}
    assert [kw["in_row"] for kw in seen["late_kept"]] == [1]


def test_one_late_probe_ejects_when_configured_so() -> None:
    seen = _probe(["late", "ok"], probes=50, eject_after_probe_timeouts=1)
    assert not seen["healthy"] and seen["probes"] == ["late"], seen
    assert seen["ejections"] == {"probe_timeout": 1.0} and seen["late_kept"] == []


@pytest.mark.parametrize("answers", [["500"], None], ids=["http-500", "refused"])
def test_a_probe_refused_or_answered_500_ejects_at_once(answers) -> None:
    seen = _probe(answers, probes=50)
    assert not seen["healthy"], seen
    assert seen["probes"] == ([] if answers is None else ["500"])
    assert seen["ejections"] == {"probe": 1.0} and seen["late_kept"] == []
