"""``rd2h demo``: Prefill -> Decode pull between real processes on loopback.

The parent starts ``decode_tp`` Decode rank processes (each binds its ROUTER,
maps the TP-shared main pool from one shared-memory region and owns rank-local
indexer/scale copies) and ``prefill_tp`` Prefill rank processes (each owns
synthetic KV in the spec 13 shapes and announces it layer by layer, in chunks).
Decode ranks pull, acknowledge and complete requests through a real
torch.distributed (gloo) exchange. Every destination byte of every request that
ended ok is then verified; the same descriptors are replayed on the bare transport
(``raw_gbps``) and a same-size in-process copy is timed (``memcpy_gbps``). Rates are
in 10^9 bytes per second. With ``--rounds R`` the ranks stay up for R rounds, each a
pull of new requests and a bare replay, in alternating order (``rd2h.demo.rounds``).

With ``--fault`` (``rd2h.demo.faults``) ranks fail for real: the summary still
appears, every request is reported ``ok`` or ``failed`` with its reason, and
``verified`` means the run kept rd2h's promises: every ok request carries exactly
the right bytes, every request ended (none hanging), no state was left behind.
Without faults, ``verified`` also needs every request to be ok.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import sys
import time
from dataclasses import dataclass, replace
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from rd2h.bootstrap.gateways import network_namespaces
from rd2h.demo.config import SENTINEL, DemoConfig, internal_id, main_pool_bytes, round_order
from rd2h.demo.decode_rank import decode_main
from rd2h.demo.faults import KILLED_EXIT_CODE, may_die
from rd2h.demo.memory import threads_cpu
from rd2h.demo.prefill_rank import prefill_main
from rd2h.demo.report import DemoResult, Progress, memcpy_gbps, percentile
from rd2h.demo.rounds import RoundFigures, summarize
from rd2h.demo.signals import Signals
from rd2h.demo.synthetic import allocate

# Reasons that only point at another failure: reported after the root cause.
CONSEQUENCES = ("failed on another decode rank", "TP exchange failed")


def ports_free(base: int, count: int, host: str = "127.0.0.1") -> bool:
    """Whether ports ``base .. base + count - 1`` can all be bound right now."""
    socks = []
    try:
        for i in range(count):
            t = socket.socket()
            socks.append(t)
            t.bind((host, base + i))
        return True
    except OSError:
        return False
    finally:
        for t in socks:
            t.close()


def free_ports(count: int, host: str = "127.0.0.1") -> int:
    """A base port with ``count`` consecutive ports free right now."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind((host, 0))
            base = s.getsockname()[1]
        if base + count <= 65535 and ports_free(base, count, host):
            return base
    raise RuntimeError("could not find free consecutive ports")


def run_demo(cfg: DemoConfig, *, progress: bool = True) -> DemoResult:
    cfg.validate()
    if cfg.faults:  # a replay of a faulty run times nothing meaningful
        cfg = replace(cfg, replay=False)
    network, pair = "loopback", None
    if cfg.netns:
        netns = network_namespaces()
        try:
            pair = netns.create_host_pair(f"{os.getpid() % 100000}")
        except netns.NetnsUnavailable as exc:
            print(f"[rd2h demo] cannot create network namespaces ({exc}); "
                  "running Prefill and Decode on loopback instead", file=sys.stderr)
        else:
            network = f"netns {pair.prefill_addr} -> {pair.decode_addr} (veth)"
            cfg = replace(cfg, host=pair.decode_addr, prefill_host=pair.prefill_addr,
                          prefill_netns=pair.prefill_ns, decode_netns=pair.decode_ns)
    try:
        return _Run(cfg, progress, network).run()
    finally:
        if pair is not None:
            network_namespaces().delete_host_pair(pair)


# Imported once by the fork server; every rank process is forked from it ready to run.
_PRELOAD = ["rd2h.demo.prefill_rank", "rd2h.demo.decode_rank", "rd2h.bootstrap.container",
            "rd2h.adapters.cma", "rd2h.adapters.torch.exchange", "torch.distributed"]


def _context() -> Any:
    """Rank processes come from a fork server (not from this process, which may hold
    threads and sockets): it pays the imports once for all ranks and all runs."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class _Hang(Exception):
    """A rank did not report within the run deadline."""


@dataclass
class _Rank:
    role: str
    rank: int
    proc: Any

    @property
    def name(self) -> str:
        return f"{self.role} {self.rank}"


class _Run:
    """The parent side of one demo run: start ranks, relay phases, collect reports.

    Phases: Decode ranks bind -> Prefill ranks start and handshake -> ``go`` (Decode
    admits) -> ``go_prefill`` (Prefill announces) -> every rank reports done or dies
    -> ``settle`` (Decode waits out late state, replays) -> ``release``. A rank that
    dies is noticed through its exit code at every wait; every wait is bounded by
    the run deadline (``--timeout``).
    """

    def __init__(self, cfg: DemoConfig, progress: bool, network: str) -> None:
        self.cfg = cfg
        self.network = network
        self.bar = Progress(cfg.requests * cfg.rounds, progress)
        self.ctx = _context()
        self.out: Any = self.ctx.Queue()
        self.msgs: dict[str, dict[str, Any]] = {}  # kind -> who -> payload
        self.errors: list[str] = []
        self.ranks: dict[str, _Rank] = {}
        self.terminated: set[str] = set()  # ranks the parent had to end (a hang)
        self.t0: dict[int, float] = {}  # round -> when Prefill was told to announce
        self.alloc: Any = None

    # ------------------------------------------------------------ messages
    def _take(self, timeout: float) -> bool:
        try:
            kind, who, payload = self.out.get(timeout=timeout)
        except queue.Empty:
            return False
        if kind == "error":
            self.errors.append(f"{who} failed: {payload}")
        elif kind == "progress":
            self.bar.show(payload)
        else:
            self.msgs.setdefault(kind, {})[who] = payload
        return True

    def _exited(self, name: str) -> bool:
        proc = self.ranks[name].proc
        return proc.pid is not None and proc.exitcode is not None

    def _wait(self, kind: str, names: list[str], deadline: float) -> None:
        """Until each of ``names`` sent ``kind`` or exited; ``_Hang`` at ``deadline``."""
        got = self.msgs.setdefault(kind, {})
        while True:
            pending = [n for n in names if n not in got and not self._exited(n)]
            if not pending:
                while self._take(0.05):  # what an exited rank sent just before it ended
                    pass
                return
            if time.monotonic() > deadline:
                raise _Hang(f"{', '.join(pending)} sent no {kind!r} within "
                            f"{self.cfg.timeout_s:g} s")
            self._take(0.2)

    def _start(self, role: str, rank: int, target: Any, args: tuple[Any, ...]) -> None:
        proc = self.ctx.Process(target=target, name=f"rd2h-{role}-{rank}", args=args)
        r = _Rank(role, rank, proc)
        self.ranks[r.name] = r
        proc.start()

    def _killed_by_fault(self, name: str) -> bool:
        r = self.ranks[name]
        return r.proc.exitcode == KILLED_EXIT_CODE and may_die(
            self.cfg.faults, r.role, r.rank  # type: ignore[arg-type]
        )

    def _death(self, name: str) -> str:
        if self._killed_by_fault(name):
            return f"{name} was killed by an injected fault"
        if name in self.terminated:
            return f"{name} was still running at the run deadline"
        return f"{name} exited with code {self.ranks[name].proc.exitcode}"

    # ------------------------------------------------------------ run
    def run(self) -> DemoResult:
        cfg = self.cfg
        alloc = self.alloc = allocate(cfg.requests, cfg.prompt_tokens, cfg.block_size, cfg.seed)
        # In a fresh Decode namespace every port is free; on loopback pick free ones.
        base_port = cfg.kv_port or free_ports(cfg.decode_tp, "127.0.0.1")
        dist_port = free_ports(1)
        shm = shared_memory.SharedMemory(create=True, size=max(1, main_pool_bytes(cfg, alloc)))
        np.ndarray((shm.size,), dtype=np.uint8, buffer=shm.buf).fill(SENTINEL)
        sig = Signals.create(self.ctx, cfg.rounds, cfg.decode_tp)
        decoders = [f"decode {d}" for d in range(cfg.decode_tp)]
        prefills = [f"prefill {p}" for p in range(cfg.prefill_tp)]
        deadline = time.monotonic() + cfg.timeout_s
        started = False
        try:
            for d in range(cfg.decode_tp):
                self._start("decode", d, decode_main, (
                    cfg, d, base_port, dist_port, shm.name, alloc, sig, self.out))
            self._wait("bound", decoders, deadline)  # Decode listens: start Prefill
            self._require("bound", decoders)
            for p in range(cfg.prefill_tp):
                self._start("prefill", p, prefill_main, (
                    cfg, p, base_port, alloc, sig, self.out))
            self._wait("ready", decoders + prefills, deadline)
            self._require("ready", decoders + prefills)
            started = True
            for k in range(cfg.rounds):
                for phase in round_order(k):
                    if phase == "pipeline":
                        sig.admit[k].set()  # Decode admits (request deadlines start) ...
                        self._wait(f"admitted/{k}", decoders, deadline)
                        self.t0[k] = time.monotonic()
                        sig.announce[k].set()  # ... then Prefill announces
                        self._wait(f"decode_done/{k}", decoders, deadline)
                        self._wait(f"prefill_done/{k}", prefills, deadline)
                    elif cfg.replay:  # Prefill's (idle) CPU meanwhile counts too
                        cpu0 = self._cpu(prefills)
                        sig.bare[k].set()
                        self._wait(f"bare/{k}", decoders, deadline)
                        self.msgs[f"bare_prefill_cpu/{k}"] = self._cpu(prefills, cpu0)
            sig.settle.set()
            self._wait("decode_final", decoders, deadline)
            sig.release.set()
            for name in self.ranks:
                self.ranks[name].proc.join(max(1.0, deadline - time.monotonic()))
        except _Hang as exc:
            self.errors.append(f"hang: {exc}")
        except Exception as exc:
            self.errors.append(f"demo parent: {exc!r}")
        finally:
            for event in sig.every():
                event.set()  # nobody waits on a signal that will never come
            started_ranks = [r for r in self.ranks.values() if r.proc.pid is not None]
            for r in started_ranks:
                r.proc.join(0.5)
                if r.proc.is_alive():
                    self.terminated.add(r.name)
                    r.proc.terminate()
            for r in started_ranks:
                r.proc.join(5)
                if r.proc.is_alive():
                    r.proc.kill()
                    r.proc.join(5)
            while self._take(0.05):
                pass
            shm.close()
            shm.unlink()
        return self._result(started)

    def _cpu(self, names: list[str], since: dict[str, float] | None = None
             ) -> dict[str, float]:
        """CPU seconds of these ranks (every thread) so far, or since ``since``."""
        now = {n: threads_cpu(self.ranks[n].proc.pid) for n in names}
        if since is None:
            return {n: c for n, c in now.items() if c is not None}
        return {n: c - since[n] for n, c in now.items() if c is not None and n in since}

    def _require(self, kind: str, names: list[str]) -> None:
        missing = [n for n in names if n not in self.msgs.get(kind, {})]
        if missing:
            raise RuntimeError(f"{'; '.join(self._death(n) for n in missing)} before {kind!r}")

    # ------------------------------------------------------------ report
    def _outcomes(self, started: bool) -> dict[str, dict]:
        """Per request and round: ok only if every Decode rank reported it ok (rank 0
        also checked the shared main pool); failed with the most specific reason; hung
        if a rank that was still running never reported it."""
        cfg = self.cfg
        outcomes: dict[str, dict[str, Any]] = {}
        for k in range(cfg.rounds):
            done = self.msgs.get(f"decode_done/{k}", {})
            for r in range(cfg.requests):
                outcomes[internal_id(r, k)] = self._outcome(done, internal_id(r, k), started)
        return outcomes

    def _outcome(self, done: dict[str, Any], rid: str, started: bool) -> dict[str, Any]:
        reasons: list[str] = []
        hung = False
        ended: list[float] = []
        bad = 0
        for d in range(self.cfg.decode_tp):
            name = f"decode {d}"
            rep = done.get(name)
            if rep is None:
                if not started:
                    reasons.append("the run did not start")
                elif name in self.terminated or not self._exited(name):
                    hung = True
                    reasons.append(f"{name} reported no outcome within the run deadline")
                else:
                    reasons.append(self._death(name))
                continue
            if rid not in rep["outcomes"]:
                hung = True
                reasons.append(f"{name}: no outcome within the run deadline")
                continue
            ended.append(rep["ended_s"][rid])
            if rep["outcomes"][rid] is not None:
                reasons.append(rep["outcomes"][rid])
            bad += rep["mismatched"].get(rid, 0)
        status = "hung" if hung else ("failed" if reasons else "ok")
        # The root cause first: a rank death or a read failure, not its echoes.
        reasons.sort(key=lambda x: any(c in x for c in CONSEQUENCES))
        return {
            "status": status,
            "reason": reasons[0] if reasons else None,
            "ended_s": round(max(ended), 3) if ended else None,
            "mismatched_blocks": bad if status == "ok" else None,
        }

    def _leaks(self) -> dict[str, dict[str, int] | None]:
        """Each rank's request state left at the end (None: the rank is gone, and its
        state with it). A rank that ended without reporting is an error."""
        leaks: dict[str, dict[str, int] | None] = {}
        for name, r in self.ranks.items():
            last = self.cfg.rounds - 1
            kind = f"prefill_done/{last}" if r.role == "prefill" else "decode_final"
            rep = self.msgs.get(kind, {}).get(name)
            leaks[name] = None
            if rep is not None:
                leaks[name] = {k: v for k, v in rep["counters"].items() if k != "peers"}
            elif not self._killed_by_fault(name):
                self.errors.append(f"{self._death(name)} before reporting {kind!r}")
        return leaks

    def _result(self, started: bool) -> DemoResult:
        cfg = self.cfg
        rounds = range(cfg.rounds)
        pres = [self.msgs.get(f"prefill_done/{k}", {}) for k in rounds]
        decs = [self.msgs.get(f"decode_done/{k}", {}) for k in rounds]
        outcomes = self._outcomes(started)
        leaks = self._leaks() if started else {}
        ok = sum(1 for o in outcomes.values() if o["status"] == "ok")
        hung = sum(1 for o in outcomes.values() if o["status"] == "hung")
        mismatched = sum(o["mismatched_blocks"] or 0 for o in outcomes.values())
        corrupted = sum(1 for o in outcomes.values() if o["mismatched_blocks"])
        leaked = sum(v for c in leaks.values() if c for v in c.values())
        undrained = sorted({n for pre in pres for n, p in pre.items() if not p["drained"]})
        if undrained:
            self.errors.append(f"{', '.join(undrained)}: announcements still in flight at exit")
        fig = summarize(cfg, self.alloc, self.msgs, self.t0) if self.alloc else RoundFigures()
        acks = [ms for pre in pres for p in pre.values() for ms in p["ack_ms"]]
        layer_errors = [f"{who}: {e}" for pre in pres for who, p in sorted(pre.items())
                        for e in p["layer_errors"]]
        expected = cfg.requests * cfg.rounds
        verified = (
            started and not self.errors and hung == 0 and corrupted == 0 and leaked == 0
            and len(outcomes) == expected and (bool(cfg.faults) or ok == expected)
        )
        first = decs[0]
        return DemoResult(
            verified=verified, requests_ok=ok, requests_failed=expected - ok - hung,
            bytes=fig.bytes, seconds=fig.seconds, gbps=fig.gbps, raw_gbps=fig.raw_gbps,
            memcpy_gbps=memcpy_gbps(fig.bytes) if fig.bytes else 0.0,
            layer_ack_p50_ms=percentile(acks, 50), layer_ack_p99_ms=percentile(acks, 99),
            mismatched_blocks=mismatched, prefill_tp=cfg.prefill_tp, decode_tp=cfg.decode_tp,
            transport=cfg.transport, layers=cfg.layers, requests=cfg.requests,
            prompt_tokens=cfg.prompt_tokens, chunks=cfg.chunks,
            shared_buffers=cfg.shared_buffers,
            descriptors=sum(p["descriptors"] for p in first.values()), leaked_state=leaked,
            errors=self.errors,
            read_busy_seconds=max((p["read_seconds"] for p in first.values()), default=0.0),
            network=self.network, raw_seconds=fig.raw_seconds,
            faults=[str(f) for f in cfg.faults], outcomes=outcomes, requests_hung=hung,
            corrupted_ok=corrupted, leaks=leaks, layer_errors=layer_errors,
            prefill_layers_failed=sum(p["layers_failed"] for pre in pres for p in pre.values()),
            exits={n: r.proc.exitcode for n, r in self.ranks.items()},
            deadlines=cfg.deadlines().model_dump(),
            prefill_driver="provider" if cfg.via_provider else "sender",
            early_dispatches=(sum(p.get("early_dispatches", 0) for p in pres[0].values())
                              if cfg.via_provider else None),
            rounds=fig.rounds, ratio_median=fig.ratio_median, ratio_min=fig.ratio_min,
            ratio_max=fig.ratio_max, layer_compute_ms=cfg.layer_compute_ms,
            tail_ms_p50=percentile(fig.tail_ms, 50), tail_ms_p99=percentile(fig.tail_ms, 99),
            bare_layer_ms=fig.bare_layer_ms, cores=fig.cores, cpu=fig.cpu,
            cpu_ratio_ceiling=fig.cpu_ratio_ceiling, cpu_per_byte=fig.cpu_per_byte,
        )
