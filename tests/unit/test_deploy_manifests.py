"""The Kubernetes manifests under ``deploy/`` (docs/operations/kubernetes.md), checked
offline: every overlay rendered by kubectl's built-in kustomize, every object validated
against the Kubernetes API schemas (``kubernetes-validate``, strict: unknown fields
fail), and what the schemas cannot see checked against rd2h itself:

- every ``--kv-transfer-config`` is JSON naming rd2h's connector, and its
  ``kv_connector_extra_config`` passes ``Rd2hOptions.parse`` (with a temporary file in
  place of the mounted secret) and every rank's ``Rd2hSettings``;
- the proxy's arguments go through ``rd2h proxy``'s own parser and configuration; its
  ``--prefill`` / ``--decode`` URLs name Services (or, as a sidecar, its pod's engine)
  and ports that reach an engine of that role; readiness is the pair-aware ``/health``,
  liveness a route the proxy serves;
- secrets are files that the options name, read-only, whose mode as the kubelet makes
  it (``defaultMode``, group-read added by ``fsGroup``) passes rd2h's own rule
  (``secret_mode_allowed``) and that the container's user can read; no Secret value
  appears in any argument or env value; the shipped placeholders are refused by rd2h;
- every ZeroMQ and Mooncake port an engine opens is a containerPort, on a headless
  Service that selects the pod, and admitted between the engine pods by the
  NetworkPolicy.
- every pod passes Pod Security Standards' ``restricted`` profile (``restricted_problems``,
  the profile's rules written out here); every NetworkPolicy ingress rule names its
  clients (``from``); every Prefill and Decode workload drains in a preStop hook, has
  the grace period for it and a PodDisruptionBudget; the gpu and ascend overlays
  request their accelerator, with the matching image and transport.

Each check returns its problems; the last tests break a rendered manifest in each of
these ways and assert the check names it. kubectl (with built-in kustomize, v1.14+)
must be installed: the tests fail, not skip, without it.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import io
import json
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("mooncake-tcp", "llm-d", "gpu", "ascend")
# The Kubernetes API version the objects are validated against (bundled by the pinned
# kubernetes-validate).
K8S_VERSION = "1.35"
SECRET_MODE = 0o440  # root-owned, read by the pods' fsGroup (rd2h.app.secrets)
POD_IP = "10.1.2.3"  # what the downward API gives a pod, in the simulated expansion
POD_ORDINAL = 0  # the simulated pod is the workload's first: NAME-0
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
WILDCARD = {"0.0.0.0", "::", ""}
ENGINE_MODULE = "vllm.entrypoints.openai.api_server"
ROLE_OF = {"kv_producer": "prefill", "kv_consumer": "decode"}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}
GOOD_SECRET = "0123456789abcdef0123456789abcdef"

Obj = dict[str, Any]


# ------------------------------------------------------------------ rendering

def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail("kubectl is not installed: these tests render deploy/overlays/* with "
                    "`kubectl kustomize`. Install kubectl (v1.14 or later has kustomize "
                    "built in; https://kubernetes.io/docs/tasks/tools/) and run them again")
    return path


_RENDERED: dict[str, list[Obj]] = {}


def render(overlay: str) -> list[Obj]:
    """The overlay's objects as ``kubectl kustomize`` renders them (a fresh copy)."""
    if overlay not in _RENDERED:
        out = subprocess.run([kubectl(), "kustomize", str(DEPLOY / "overlays" / overlay)],
                             capture_output=True, text=True, timeout=120, check=False)
        if out.returncode != 0:
            pytest.fail(f"kubectl kustomize deploy/overlays/{overlay} failed:\n{out.stderr}")
        _RENDERED[overlay] = [d for d in yaml.safe_load_all(out.stdout) if d]
    return copy.deepcopy(_RENDERED[overlay])


# ------------------------------------------------------------------ helpers

def pods(objects: list[Obj]) -> Iterator[tuple[str, Obj, Obj]]:
    """(name, metadata, pod spec) of every pod template and pod."""
    for o in objects:
        if o["kind"] in WORKLOADS:
            tpl = o["spec"]["template"]
            yield o["metadata"]["name"], tpl.get("metadata", {}), tpl["spec"]
        elif o["kind"] == "Pod":
            yield o["metadata"]["name"], o["metadata"], o["spec"]


def of_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


def by_name(objects: list[Obj], kind: str, name: str) -> Obj | None:
    return next((o for o in of_kind(objects, kind) if o["metadata"]["name"] == name), None)


def command_line(c: Obj) -> list[str]:
    return [*c.get("command", []), *c.get("args", [])]


def is_engine(c: Obj) -> bool:
    return any(a == "--kv-transfer-config" or a.startswith("--kv-transfer-config=")
               for a in c.get("args", []))


def is_proxy(c: Obj) -> bool:
    return c.get("command", [])[:2] == ["rd2h", "proxy"]


def env_values(c: Obj, objects: list[Obj], pod: str = "pod") -> dict[str, str]:
    """The container's environment as the kubelet gives it (pod IP: ``POD_IP``; the pod
    of workload ``pod`` is named ``pod-0``)."""
    env: dict[str, str] = {}
    for e in c.get("env", []):
        src = e.get("valueFrom", {})
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
        elif src.get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[e["name"]] = POD_IP
        elif src.get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[e["name"]] = f"{pod}-{POD_ORDINAL}"
        elif "configMapKeyRef" in src:
            ref = src["configMapKeyRef"]
            cm = by_name(objects, "ConfigMap", ref["name"]) or {}
            env[e["name"]] = cm.get("data", {}).get(ref["key"], f"<missing {ref['key']}>")
        elif "secretKeyRef" in src:
            env[e["name"]] = GOOD_SECRET
    return env


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion of command, args and env values."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
                  text)


def option(args: list[str], name: str) -> str | None:
    """The value of ``--name=V`` or ``--name V`` (the last one given), else None."""
    value = None
    for i, a in enumerate(args):
        if a.startswith(name + "="):
            value = a.split("=", 1)[1]
        elif a == name and i + 1 < len(args):
            value = args[i + 1]
    return value


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Service's selector (a plain map) or a LabelSelector (matchLabels and
    matchExpressions) against a pod's labels; an empty selector matches nothing here."""
    if not selector:
        return False
    structured = "matchLabels" in selector or "matchExpressions" in selector
    plain = selector.get("matchLabels", {}) if structured else selector
    if any(labels.get(k) != v for k, v in plain.items()):
        return False
    for expr in selector.get("matchExpressions", []) if structured else []:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def container_port(spec: Obj, port: int | str) -> int | None:
    """A port number or a containerPort name of the pod, as a number."""
    for c in spec["containers"]:
        for p in c.get("ports", []):
            if port in (p["containerPort"], p.get("name")):
                return p["containerPort"]
    return None


def secret_files(c: Obj, spec: Obj) -> dict[str, tuple[str, str]]:
    """Path in the container -> (Secret name, key) for every mounted Secret file."""
    volumes = {v["name"]: v["secret"] for v in spec.get("volumes", []) if "secret" in v}
    files: dict[str, tuple[str, str]] = {}
    for m in c.get("volumeMounts", []):
        src = volumes.get(m["name"])
        if src is None:
            continue
        # Without items every key of the Secret is a file: "*" stands for them.
        items = src.get("items") or [{"key": "*", "path": "*"}]
        for item in items:
            if m.get("subPath"):
                if m["subPath"] == item["path"]:
                    files[m["mountPath"]] = (src["secretName"], item["key"])
            else:
                files[f"{m['mountPath'].rstrip('/')}/{item['path']}"] = (
                    src["secretName"], item["key"])
    return files


def secret_data(objects: list[Obj], name: str) -> dict[str, str]:
    s = by_name(objects, "Secret", name) or {}
    data = {k: base64.b64decode(v).decode() for k, v in s.get("data", {}).items()}
    return {**data, **s.get("stringData", {})}


def resolve_secret_file(path: str, c: Obj, spec: Obj, objects: list[Obj]
                        ) -> tuple[str, str] | None:
    files = secret_files(c, spec)
    hit = files.get(path)
    if hit is None:  # a volume without items mounts every key of its Secret
        parent, _, key = path.rpartition("/")
        wildcard = files.get(f"{parent}/*")
        hit = (wildcard[0], key) if wildcard else None
    if hit is None or hit[1] not in secret_data(objects, hit[0]):
        return None
    return hit


def engine_config(c: Obj, objects: list[Obj]) -> tuple[dict[str, Any] | None, str]:
    """The container's --kv-transfer-config after the kubelet's expansion, or why not."""
    env = env_values(c, objects)
    args = [expand(a, env) for a in c.get("args", [])]
    text = option(args, "--kv-transfer-config")
    try:
        cfg = json.loads(text or "")
    except json.JSONDecodeError as exc:
        return None, f"--kv-transfer-config is not JSON ({exc})"
    return (cfg, "") if isinstance(cfg, dict) else (None, "--kv-transfer-config: not an object")


def engine_args(c: Obj, objects: list[Obj]) -> list[str]:
    env = env_values(c, objects)
    return [expand(a, env) for a in c.get("args", [])]


def engines(objects: list[Obj]) -> Iterator[tuple[str, Obj, Obj, Obj]]:
    for name, meta, spec in pods(objects):
        for c in spec["containers"]:
            if is_engine(c):
                yield name, meta, spec, c


# ------------------------------------------------------------------ the checks

def schema_problems(objects: list[Obj]) -> list[str]:
    problems = []
    for o in objects:
        what = f"{o.get('kind')}/{o.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            problems.append(f"{what}: {path}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            problems.append(f"{what}: no Kubernetes {K8S_VERSION} schema ({exc.message}): "
                            "only built-in kinds are allowed")
    return problems


def connector_problems(objects: list[Obj], tmp: Path) -> list[str]:
    from rd2h.app.settings import ConnectorConfigError, Rd2hOptions, Rd2hSettings

    problems: list[str] = []
    auth_sources = set()
    for name, meta, spec, c in engines(objects):
        where = f"{name}/{c['name']}"
        if ENGINE_MODULE not in command_line(c) and c.get("command", [])[:2] != ["vllm",
                                                                                  "serve"]:
            problems.append(f"{where}: does not run vLLM's OpenAI server ({ENGINE_MODULE})")
        cfg, why = engine_config(c, objects)
        if cfg is None:
            problems.append(f"{where}: {why}")
            continue
        if cfg.get("kv_connector") != "SfaRemoteD2HConnector" or cfg.get(
                "kv_connector_module_path") != "rd2h.entry.connector":
            problems.append(f"{where}: kv_connector / kv_connector_module_path are not "
                            "rd2h's (SfaRemoteD2HConnector, rd2h.entry.connector)")
        role = ROLE_OF.get(cfg.get("kv_role", ""))
        if role is None:
            problems.append(f"{where}: kv_role {cfg.get('kv_role')!r} is not "
                            "kv_producer or kv_consumer")
            continue
        component = meta.get("labels", {}).get("app.kubernetes.io/component")
        if component != role:
            problems.append(f"{where}: kv_role {cfg['kv_role']} in a pod labelled "
                            f"component={component}")
        extra = dict(cfg.get("kv_connector_extra_config") or {})
        for key in ("auth_secret", "curve_secret_key"):
            if key in extra:
                problems.append(f"{where}: {key} written inline in kv_connector_extra_config")
        raw = _raw_extra(c)
        if extra.get("transport") in ("mooncake", "memfabric") and not _is_pod_ip(
                raw.get("host"), c):
            problems.append(f"{where}: host {raw.get('host')!r} is not the pod IP "
                            "($(VAR) of an env var from fieldRef status.podIP)")
        environ = {}
        for key in ("auth_secret", "curve_secret_key"):
            path, var = extra.get(f"{key}_file"), extra.get(f"{key}_env")
            if path is not None:
                hit = resolve_secret_file(path, c, spec, objects)
                if hit is None:
                    problems.append(f"{where}: {key}_file {path!r} is no mounted Secret key")
                    continue
                if key == "auth_secret":
                    auth_sources.add(hit)
                extra[f"{key}_file"] = str(_stand_in(tmp, key))
            if var is not None:
                if not any(e["name"] == var and "secretKeyRef" in e.get("valueFrom", {})
                           for e in c.get("env", [])):
                    problems.append(f"{where}: {key}_env {var!r} is no env var from a "
                                    "Secret (valueFrom: secretKeyRef)")
                environ[var] = _stand_in(tmp, key).read_text()
        try:
            options = Rd2hOptions.parse(extra, environ=environ)
            tp = int(option(engine_args(c, objects), "--tensor-parallel-size") or 1)
            for rank in range(tp):
                Rd2hSettings.for_rank(options, role=role, kv_port=int(cfg["kv_port"]),
                                      tp_size=tp, tp_rank=rank)
        except (ConnectorConfigError, ValueError, KeyError, TypeError) as exc:
            problems.append(f"{where}: rd2h refuses its configuration: {exc}")
    if len(auth_sources) > 1:
        problems.append(f"the engines read auth_secret from different Secret keys "
                        f"{sorted(auth_sources)}: Prefill and Decode must share one")
    return problems


def _raw_extra(c: Obj) -> dict[str, Any]:
    """kv_connector_extra_config before expansion (to see $(POD_IP) as written)."""
    try:
        cfg = json.loads(option(c.get("args", []), "--kv-transfer-config") or "")
        return dict(cfg.get("kv_connector_extra_config") or {})
    except (json.JSONDecodeError, AttributeError):
        return {}


def _is_pod_ip(value: Any, c: Obj) -> bool:
    m = re.fullmatch(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", str(value))
    return bool(m) and any(
        e["name"] == m.group(1)
        and e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP"
        for e in c.get("env", []))


def _stand_in(tmp: Path, key: str) -> Path:
    """A valid secret file for ``key`` (mode 0400), standing in for the mounted one."""
    path = tmp / f"stand-in-{key}"
    if not path.exists():
        if key == "curve_secret_key":
            from rd2h.bootstrap.gateways import curve_keypair

            path.write_text(curve_keypair()[1])
        else:
            path.write_text(GOOD_SECRET)
        path.chmod(SECRET_MODE)
    return path


def run_proxy_cli(args: list[str]) -> tuple[Any, str]:
    """``rd2h proxy ARGS`` up to the point where it would serve: its config, or the
    error it stops with."""
    from rd2h.cli.main import build_parser

    captured = []
    err = io.StringIO()
    with contextlib.redirect_stderr(err), mock.patch(
            "rd2h.bootstrap.gateways.serve_proxy", lambda config, *a, **k: captured.append(config)):
        try:
            ns = build_parser().parse_args(["proxy", *args])
            rc = ns.func(ns)
        except SystemExit as exc:
            rc = exc.code
    return (captured[0] if rc == 0 and captured else None), err.getvalue().strip()


def proxy_problems(objects: list[Obj], tmp: Path) -> list[str]:
    from rd2h.proxy.service import create_app

    problems: list[str] = []
    services = of_kind(objects, "Service")
    for name, spec, c in [(n, s, c) for n, _, s in pods(objects)
                          for c in s["containers"] if is_proxy(c)]:
        where = f"{name}/{c['name']}"
        env = env_values(c, objects, name)
        args = [expand(a, env) for a in c.get("args", [])]
        token = option(args, "--admin-token-file")
        if option(args, "--admin-token") is not None:
            problems.append(f"{where}: --admin-token puts the token on the command line")
        if token is not None:
            if resolve_secret_file(token, c, spec, objects) is None:
                problems.append(f"{where}: --admin-token-file {token!r} is no mounted "
                                "Secret key")
            args = [a.replace(token, str(_stand_in(tmp, "admin_token"))) for a in args]
        config, err = run_proxy_cli(args)
        if config is None:
            problems.append(f"{where}: `rd2h proxy` refuses its arguments: {err}")
            continue
        port = int(option(args, "--port") or 8000)
        if (option(args, "--host") or "127.0.0.1") not in WILDCARD:
            problems.append(f"{where}: --host must be a wildcard address (0.0.0.0) for "
                            "probes and clients to reach it")
        if container_port({"containers": [c]}, port) is None:
            problems.append(f"{where}: --port {port} is not a containerPort")
        public = urlsplit(config.public_url)
        own_pod = public.hostname in (POD_IP, pod_dns_name(objects, name)) or (
            public.hostname in LOOPBACK and all(urlsplit(u).hostname in LOOPBACK
                                                for u in config.decode))
        if not own_pod or public.port != port:
            problems.append(f"{where}: --public-url {config.public_url} is not this pod's "
                            f"own address and port {port} (its StatefulSet pod's DNS name, "
                            "the pod IP, or 127.0.0.1 for a sidecar of the Decode engine)")
        for role, urls in (("prefill", config.prefill), ("decode", config.decode)):
            for url in urls:
                problems += [f"{where}: --{role} {url}: {p}"
                             for p in _url_problems(url, role, spec, services, objects)]
        ready, live = c.get("readinessProbe", {}), c.get("livenessProbe", {})
        for kind, probe in (("readiness", ready), ("liveness", live)):
            got = probe.get("httpGet", {})
            if container_port({"containers": [c]}, got.get("port", -1)) != port:
                problems.append(f"{where}: {kind} probe is not an HTTP GET on --port {port}")
        if ready.get("httpGet", {}).get("path") != "/health":
            problems.append(f"{where}: readiness probe is not the pair-aware GET /health")
        routes = {r.path for r in create_app(config).routes
                  if "GET" in (getattr(r, "methods", None) or ())}
        path = live.get("httpGet", {}).get("path")
        if path not in routes or path == "/health":
            problems.append(f"{where}: liveness probe {path!r} is not a cheap GET route of "
                            "the proxy (/health fails whenever the engines are down)")
    return problems


def pod_dns_name(objects: list[Obj], workload: str) -> str | None:
    """``NAME-0.SERVICE``: the DNS name of a StatefulSet's first pod, when its
    serviceName is a headless Service of the render that selects the pod."""
    sts = by_name(objects, "StatefulSet", workload)
    if sts is None:
        return None
    svc = by_name(objects, "Service", sts["spec"].get("serviceName", ""))
    labels = sts["spec"]["template"].get("metadata", {}).get("labels", {})
    if svc is None or svc["spec"].get("clusterIP") != "None" or not matches(
            svc["spec"].get("selector", {}), labels):
        return None
    return f"{workload}-{POD_ORDINAL}.{svc['metadata']['name']}"


def _stateful_pod(host: str, objects: list[Obj]) -> Obj | None:
    """The pod spec a ``NAME-N.SERVICE[.NS...]`` host names (a StatefulSet's pod)."""
    labels = host.split(".")
    if len(labels) < 2:
        return None
    for sts in of_kind(objects, "StatefulSet"):
        name = sts["metadata"]["name"]
        m = re.fullmatch(re.escape(name) + r"-(\d+)", labels[0])
        if m and int(m.group(1)) < sts["spec"].get("replicas", 1) and pod_dns_name(
                objects, name) == f"{name}-{POD_ORDINAL}.{labels[1]}":
            return sts["spec"]["template"]["spec"]
    return None


def _url_problems(url: str, role: str, spec: Obj, services: list[Obj],
                  objects: list[Obj]) -> list[str]:
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or 80
    if host in LOOPBACK:  # a sidecar: the pod's own engine
        targets = [(spec, port)]
    elif (pod_spec := _stateful_pod(host, objects)) is not None:  # one pod, by name
        targets = [(pod_spec, port)]
    else:
        svc = next((s for s in services if s["metadata"]["name"] == host.split(".")[0]), None)
        if svc is None:
            return [f"no Service {host.split('.')[0]!r} in the render"]
        sport = next((p for p in svc["spec"].get("ports", []) if p["port"] == port), None)
        if sport is None:
            return [f"Service {host} has no port {port}"]
        selected = [s for _, m, s in pods(objects)
                    if matches(svc["spec"].get("selector", {}), m.get("labels", {}))]
        if not selected:
            return [f"Service {host} selects no pod"]
        targets = [(s, container_port(s, sport.get("targetPort", port))) for s in selected]
    problems = []
    for pod_spec, target in targets:
        served = [c for c in pod_spec["containers"] if is_engine(c) and target is not None
                  and int(option(engine_args(c, objects), "--port") or 8000) == target]
        roles = {ROLE_OF.get((engine_config(c, objects)[0] or {}).get("kv_role", ""))
                 for c in served}
        if target is None or container_port(pod_spec, target) is None or roles != {role}:
            problems.append(f"does not reach a {role} engine's --port (reaches port "
                            f"{target}, engines {sorted(map(str, roles))})")
    return problems


def secret_problems(objects: list[Obj]) -> list[str]:
    """Secret files as the kubelet makes them: owned by root, mode ``defaultMode`` (or
    the item's), group-read added and group set to ``fsGroup`` when the pod has one.
    rd2h's own rule must accept that mode and the container's user must read it."""
    from rd2h.app.secrets import secret_mode_allowed

    problems = []
    values = [v for s in of_kind(objects, "Secret")
              for v in secret_data(objects, s["metadata"]["name"]).values() if len(v) >= 4]
    for name, _, spec in pods(objects):
        ctx = spec.get("securityContext", {})
        fs_group = ctx.get("fsGroup")
        secret_vols = {v["name"]: v["secret"] for v in spec.get("volumes", []) if "secret" in v}
        for vname, src in secret_vols.items():
            modes = [src.get("defaultMode", 0o644)] + [
                i["mode"] for i in src.get("items", []) if "mode" in i]
            for mode in modes:
                made = mode | 0o440 if fs_group is not None else mode
                if not secret_mode_allowed(made, 0):
                    problems.append(f"{name}: Secret volume {vname} mode {mode:04o} (files "
                                    f"{made:04o}, owned by root): rd2h refuses it")
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            where = f"{name}/{c['name']}"
            texts = [*command_line(c), *(e.get("value", "") for e in c.get("env", []))]
            if any(v in t for v in values for t in texts):
                problems.append(f"{where}: a Secret's value appears in its command, args "
                                "or env values")
            mounts = [m for m in c.get("volumeMounts", []) if m["name"] in secret_vols]
            for m in mounts:
                if not m.get("readOnly"):
                    problems.append(f"{where}: Secret volume {m['name']} mounted writable")
            user = c.get("securityContext", {}).get("runAsUser", ctx.get("runAsUser"))
            if mounts and user != 0 and fs_group is None:
                problems.append(f"{where}: reads Secret files owned by root as runAsUser "
                                f"{user!r} without fsGroup (set fsGroup and defaultMode "
                                "0440)")
    return problems


# Pod Security Standards, "restricted" (https://kubernetes.io/docs/concepts/security/
# pod-security-standards/), every rule of the profile (it includes "baseline").
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}
RESTRICTED_ADD_CAPS = {"NET_BIND_SERVICE"}
SECCOMP_OK = {"RuntimeDefault", "Localhost"}


def restricted_problems(objects: list[Obj]) -> list[str]:
    """What the Pod Security admission controller at level ``restricted`` would refuse,
    each problem naming the rule."""
    problems: list[str] = []
    for name, _, spec in pods(objects):
        ctx = spec.get("securityContext", {})
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            if spec.get(key):
                problems.append(f"{name}: host namespaces: {key} is true")
        for v in spec.get("volumes", []):
            kinds = set(v) - {"name"}
            if not kinds <= RESTRICTED_VOLUMES:
                problems.append(f"{name}: volume types: {v['name']} is "
                                f"{', '.join(sorted(kinds - RESTRICTED_VOLUMES))}")
        if ctx.get("runAsUser") == 0:
            problems.append(f"{name}: running as non-root user: pod runAsUser is 0")
        pod_seccomp = ctx.get("seccompProfile", {}).get("type")
        if pod_seccomp is not None and pod_seccomp not in SECCOMP_OK:
            problems.append(f"{name}: seccomp: pod seccompProfile {pod_seccomp}")
        for opt in ("windowsOptions",):
            if ctx.get(opt, {}).get("hostProcess"):
                problems.append(f"{name}: host process: {opt}.hostProcess")
        containers = [*spec.get("initContainers", []), *spec["containers"],
                      *spec.get("ephemeralContainers", [])]
        for c in containers:
            where = f"{name}/{c['name']}"
            sc = c.get("securityContext", {})
            if sc.get("privileged"):
                problems.append(f"{where}: privileged containers: privileged is true")
            if sc.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{where}: privilege escalation: allowPrivilegeEscalation "
                                "is not false")
            caps = sc.get("capabilities", {})
            if "ALL" not in caps.get("drop", []):
                problems.append(f"{where}: capabilities: drop does not hold ALL")
            if set(caps.get("add", [])) - RESTRICTED_ADD_CAPS:
                problems.append(f"{where}: capabilities: adds "
                                f"{sorted(set(caps.get('add', [])) - RESTRICTED_ADD_CAPS)}")
            if sc.get("runAsNonRoot", ctx.get("runAsNonRoot")) is not True:
                problems.append(f"{where}: running as non-root: runAsNonRoot is not true "
                                "(pod or container)")
            if sc.get("runAsUser") == 0:
                problems.append(f"{where}: running as non-root user: runAsUser is 0")
            seccomp = sc.get("seccompProfile", {}).get("type", pod_seccomp)
            if seccomp not in SECCOMP_OK:
                problems.append(f"{where}: seccomp: seccompProfile is {seccomp!r}, not "
                                "RuntimeDefault or Localhost (pod or container)")
            if any(p.get("hostPort") for p in c.get("ports", [])):
                problems.append(f"{where}: host ports: a hostPort is set")
            if sc.get("procMount", "Default") != "Default":
                problems.append(f"{where}: /proc mount type: {sc['procMount']}")
            if sc.get("seLinuxOptions", {}).get("type") not in (
                    None, "", "container_t", "container_init_t", "container_kvm_t"):
                problems.append(f"{where}: SELinux: type {sc['seLinuxOptions']['type']}")
    return problems


def policy_problems(objects: list[Obj]) -> list[str]:
    """Every ingress rule of every NetworkPolicy names its clients; every pod is under
    one (engines and proxy alike)."""
    problems = []
    policies = of_kind(objects, "NetworkPolicy")
    for pol in policies:
        for i, rule in enumerate(pol["spec"].get("ingress", [])):
            if not rule.get("from"):
                problems.append(f"NetworkPolicy {pol['metadata']['name']}: ingress rule {i} "
                                "has no from: it admits every pod of the cluster")
    for name, meta, _ in pods(objects):
        if not any(matches(p["spec"]["podSelector"], meta.get("labels", {}))
                   for p in policies):
            problems.append(f"{name}: no NetworkPolicy selects this pod")
    return problems


def drain_problems(objects: list[Obj]) -> list[str]:
    """Each Prefill and Decode workload drains before it stops: a preStop hook on its
    engine, a grace period longer than the hook's wait, and a PodDisruptionBudget."""
    problems = []
    budgets = of_kind(objects, "PodDisruptionBudget")
    for name, meta, spec, c in engines(objects):
        labels = meta.get("labels", {})
        hook = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        text = " ".join(hook)
        if not hook:
            problems.append(f"{name}/{c['name']}: no preStop hook")
        waits = [int(w) for w in re.findall(r"(?:--wait|sleep) (\d+)", text)]
        grace = spec.get("terminationGracePeriodSeconds", 30)
        if hook and (not waits or grace <= max(waits)):
            problems.append(f"{name}: terminationGracePeriodSeconds {grace} does not "
                            f"outlast its preStop hook's wait {waits}")
        if "proxy-admin" in text and " drain " not in text:
            problems.append(f"{name}/{c['name']}: preStop calls proxy-admin but not drain")
        if not any(matches(b["spec"].get("selector", {}), labels) for b in budgets):
            problems.append(f"{name}: no PodDisruptionBudget selects its pods")
    return problems


ACCELERATORS = {"gpu": ("nvidia.com/gpu", "rd2h-vllm-cuda", "mooncake"),
                "ascend": ("huawei.com/Ascend910", "rd2h-vllm-ascend", "memfabric")}


def accelerator_problems(objects: list[Obj], overlay: str) -> list[str]:
    resource, image, transport = ACCELERATORS[overlay]
    problems = []
    for name, _, _, c in engines(objects):
        limits = c.get("resources", {}).get("limits", {})
        if int(limits.get(resource, 0)) < 1:
            problems.append(f"{name}: requests no {resource} (resources.limits)")
        if image not in c.get("image", ""):
            problems.append(f"{name}: image {c.get('image')} is not {image}")
        extra = (engine_config(c, objects)[0] or {}).get("kv_connector_extra_config", {})
        if extra.get("transport") != transport:
            problems.append(f"{name}: transport {extra.get('transport')!r}, not {transport}")
    return problems


def opened_ports(c: Obj, objects: list[Obj]) -> tuple[dict[int, str], list[str]]:
    """Every port the engine container listens on -> what it is, and any problem."""
    from rd2h.domain.planning.topology import plan_ports

    args = engine_args(c, objects)
    cfg, why = engine_config(c, objects)
    if cfg is None:
        return {}, [why]
    ports = {int(option(args, "--port") or 8000): "http"}
    tp = int(option(args, "--tensor-parallel-size") or 1)
    dp = int(option(args, "--data-parallel-size") or 1)
    extra = cfg.get("kv_connector_extra_config") or {}
    problems = []
    if cfg.get("kv_role") == "kv_consumer":
        for d in range(dp):
            plan = plan_ports(int(cfg["kv_port"]), d, tp)
            ports.update({plan.rank_port(r): "kv" for r in range(tp)})
    if extra.get("transport") == "mooncake":
        env = extra.get("mooncake_env") or {}
        lo, hi = env.get("MC_MIN_RPC_PORT"), env.get("MC_MAX_RPC_PORT")
        if lo is None or hi is None:
            problems.append("mooncake_env sets no MC_MIN_RPC_PORT / MC_MAX_RPC_PORT: Mooncake "
                            "then takes ports from 15000-17000, which cannot be declared")
        else:
            if int(hi) - int(lo) + 1 < 2 * tp * dp:
                problems.append(f"Mooncake port range {lo}-{hi} is narrower than 2 ports per "
                                f"rank ({tp * dp} ranks)")
            ports.update({p: "kv" for p in range(int(lo), int(hi) + 1)})
    return ports, problems


def port_problems(objects: list[Obj]) -> list[str]:
    problems: list[str] = []
    services = of_kind(objects, "Service")
    policies = of_kind(objects, "NetworkPolicy")
    engine_labels = [m.get("labels", {}) for _, m, _, _ in engines(objects)]
    for name, meta, spec, c in engines(objects):
        where = f"{name}/{c['name']}"
        labels = meta.get("labels", {})
        ports, why = opened_ports(c, objects)
        problems += [f"{where}: {w}" for w in why]
        declared = {p["containerPort"]: p for p in c.get("ports", [])}
        headless = [s for s in services if s["spec"].get("clusterIP") == "None"
                    and matches(s["spec"].get("selector", {}), labels)]
        for port, kind in sorted(ports.items()):
            if port not in declared or declared[port].get("protocol", "TCP") != "TCP":
                problems.append(f"{where}: opens port {port} but does not declare it as a "
                                "TCP containerPort")
            if kind != "kv":
                continue
            if not any(container_port(spec, sp.get("targetPort", sp["port"])) == port
                       for s in headless for sp in s["spec"]["ports"]):
                problems.append(f"{where}: KV port {port} is on no headless Service "
                                "selecting this pod")
            # Policies add up: a port is open when any policy selecting the pod admits it.
            selecting = [p for p in policies if matches(p["spec"]["podSelector"], labels)]
            if selecting and not any(_admitted(p, port, spec, engine_labels)
                                     for p in selecting):
                problems.append(f"{where}: NetworkPolicy "
                                f"{', '.join(p['metadata']['name'] for p in selecting)} "
                                f"does not admit KV port {port} from the engine pods")
    return problems


def _admitted(policy: Obj, port: int, spec: Obj, engine_labels: list[dict]) -> bool:
    if "Ingress" not in policy["spec"].get("policyTypes", ["Ingress"]):
        return True
    for rule in policy["spec"].get("ingress", []):
        peers = rule.get("from")
        if peers is not None and not all(
                any("podSelector" in p and "namespaceSelector" not in p
                    and matches(p["podSelector"], lab) for p in peers)
                for lab in engine_labels):
            continue
        for rp in rule.get("ports") or [{"port": port}]:
            lo = container_port(spec, rp["port"]) if isinstance(rp["port"], str) else rp["port"]
            if lo is not None and lo <= port <= rp.get("endPort", lo):
                return True
    return False


# ------------------------------------------------------------------ tests

def no_problems(problems: list[str]) -> None:
    assert not problems, "\n" + "\n".join(problems)


@pytest.fixture(params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> str:
    return request.param


def test_kubectl_renders_the_overlay(overlay: str) -> None:
    kinds = {o["kind"] for o in render(overlay)}
    assert {"StatefulSet", "Service", "Secret", "ConfigMap", "NetworkPolicy",
            "PodDisruptionBudget"} <= kinds


def test_objects_validate_against_the_kubernetes_schemas(overlay: str) -> None:
    no_problems(schema_problems(render(overlay)))


def test_engine_connector_configs_pass_rd2h_validation(overlay: str, tmp_path: Path) -> None:
    objects = render(overlay)
    roles = sorted(ROLE_OF[engine_config(c, objects)[0]["kv_role"]]
                   for *_, c in engines(objects))
    assert roles == ["decode", "prefill"]
    no_problems(connector_problems(objects, tmp_path))


def test_proxy_urls_probes_and_arguments(overlay: str, tmp_path: Path) -> None:
    objects = render(overlay)
    assert [c for _, _, s in pods(objects) for c in s["containers"] if is_proxy(c)]
    no_problems(proxy_problems(objects, tmp_path))


def test_secrets_are_files_rd2h_accepts(overlay: str) -> None:
    no_problems(secret_problems(render(overlay)))


def test_every_engine_port_is_declared_and_reachable(overlay: str) -> None:
    no_problems(port_problems(render(overlay)))


def test_the_placeholder_secrets_are_refused(overlay: str, tmp_path: Path) -> None:
    """Applied without replacing the base's secrets, nothing starts."""
    from rd2h.app.settings import ConnectorConfigError, Rd2hOptions

    objects = render(overlay)
    (secret,) = of_kind(objects, "Secret")
    data = secret_data(objects, secret["metadata"]["name"])
    auth, token = tmp_path / "auth", tmp_path / "admin-token"
    auth.write_text(data["auth"])
    token.write_text(data["admin-token"])
    auth.chmod(SECRET_MODE)
    token.chmod(SECRET_MODE)
    with pytest.raises(ConnectorConfigError, match="at least 16 characters"):
        Rd2hOptions.parse({"auth_secret_file": str(auth)}, environ={})
    config, err = run_proxy_cli(["--prefill", "http://p:1", "--decode", "http://d:2",
                                 "--admin-token-file", str(token)])
    assert config is None and "at least 16 characters" in err


def test_overlay_shapes() -> None:
    tcp, llmd = render("mooncake-tcp"), render("llm-d")
    assert by_name(tcp, "StatefulSet", "rd2h-proxy") is not None
    assert by_name(llmd, "StatefulSet", "rd2h-proxy") is None
    (decode,) = [s for n, _, s in pods(llmd) if n == "rd2h-decode"]
    (sidecar,) = [c for c in decode["containers"] if is_proxy(c)]
    assert "--prefiller-header" in sidecar["args"]
    assert "prefill-allowlist" in {c["name"] for c in decode["containers"]}
    for overlay in ("mooncake-tcp", "llm-d", "gpu"):
        objects = render(overlay)
        for *_, c in engines(objects):
            extra = engine_config(c, objects)[0]["kv_connector_extra_config"]
            assert (extra["transport"], extra["mooncake_protocol"]) == ("mooncake", "tcp")


def test_pods_pass_the_restricted_pod_security_standard(overlay: str) -> None:
    objects = render(overlay)
    assert list(pods(objects))
    no_problems(restricted_problems(objects))


def test_network_policies_name_their_clients(overlay: str) -> None:
    no_problems(policy_problems(render(overlay)))


def test_engines_drain_before_they_stop(overlay: str) -> None:
    no_problems(drain_problems(render(overlay)))


@pytest.mark.parametrize("overlay", sorted(ACCELERATORS))
def test_accelerator_overlays_request_their_devices(overlay: str) -> None:
    no_problems(accelerator_problems(render(overlay), overlay))


def test_no_url_holds_a_bare_pod_ip(overlay: str) -> None:
    """``http://$(POD_IP):PORT`` is not a URL on an IPv6 cluster: URLs name pods by DNS."""
    for name, _, spec in pods(render(overlay)):
        for c in spec["containers"]:
            for text in [*command_line(c), *(" ".join(
                    c.get("lifecycle", {}).get(h, {}).get("exec", {}).get("command", []))
                    for h in ("postStart", "preStop"))]:
                assert not re.search(r"https?://\$\(?POD_IP", text), (name, text)


def test_the_prefill_allowlist_plan() -> None:
    """llm-d: the sidecar's allowlist follows the Prefill pods (prefill-allowlist.py)."""
    import importlib.util

    path = DEPLOY / "overlays" / "llm-d" / "prefill-allowlist.py"
    spec = importlib.util.spec_from_file_location("prefill_allowlist", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.instance_url("10.1.2.3", 8100) == "http://10.1.2.3:8100"
    assert mod.instance_url("fd00::5", 8100) == "http://[fd00::5]:8100"
    static, a, b = "http://rd2h-prefill-0.rd2h-prefill-kv:8100", "http://a:1", "http://b:1"
    assert mod.plan({static}, set(), {a, b}) == ({a, b}, set())
    assert mod.plan({static, a, b}, {a, b}, {b}) == (set(), {a})
    assert mod.plan({static, a}, {a}, {a}) == (set(), set())
    assert mod.resolve("localhost", 8100) <= {"http://127.0.0.1:8100", "http://[::1]:8100"}
    # The header names a pod as IP:port; the proxy compares it with the URL's host:port.
    assert mod.instance_url("fd00::5", 8100).split("://", 1)[1] == "[fd00::5]:8100"


def test_the_restricted_check_names_each_rule() -> None:
    """A deliberately broken pod: each rule it breaks is named."""
    pod = {"kind": "Pod", "metadata": {"name": "bad"}, "spec": {
        "hostNetwork": True, "securityContext": {"runAsUser": 0},
        "volumes": [{"name": "host", "hostPath": {"path": "/"}}],
        "containers": [{"name": "c", "image": "x", "ports": [{"containerPort": 1,
                                                              "hostPort": 1}],
                        "securityContext": {"privileged": True,
                                            "capabilities": {"add": ["SYS_ADMIN"]}}}]}}
    text = "\n".join(restricted_problems([pod]))
    for rule in ("host namespaces", "volume types: host is hostPath", "runAsUser is 0",
                 "privileged", "allowPrivilegeEscalation", "drop does not hold ALL",
                 "adds ['SYS_ADMIN']", "runAsNonRoot", "seccomp", "hostPort"):
        assert rule in text, text


@pytest.mark.parametrize("name", ["Containerfile", "Containerfile.ascend"])
def test_containerfiles_install_existing_extras(name: str) -> None:
    from importlib.metadata import metadata

    text = (DEPLOY / name).read_text()
    extras = set(metadata("rd2h").get_all("Provides-Extra") or ())
    wanted = re.search(r"^ARG RD2H_EXTRAS=(\S+)$", text, re.M)
    assert wanted, f"deploy/{name} names no RD2H_EXTRAS"
    assert set(wanted.group(1).split(",")) <= extras
    assert "proxy" in wanted.group(1).split(",")
    assert "not built" in text.lower()


# ------------------------------------------------------------------ the checks can fail

def _container(objects: list[Obj], pod: str, name: str) -> Obj:
    return next(c for n, _, s in pods(objects) if n == pod
                for c in s["containers"] if c["name"] == name)


def _spec(objects: list[Obj], pod: str) -> Obj:
    return next(s for n, _, s in pods(objects) if n == pod)


def _edit_config(c: Obj, edit: Callable[[dict], None]) -> None:
    i = c["args"].index("--kv-transfer-config") + 1
    cfg = json.loads(c["args"][i])
    edit(cfg)
    c["args"][i] = json.dumps(cfg)


def _set_arg(c: Obj, old: str, new: str) -> None:
    c["args"] = [new if a == old else a for a in c["args"]]


def _break_inline_secret(o: list[Obj]) -> None:
    def edit(cfg: dict) -> None:
        extra = cfg["kv_connector_extra_config"]
        extra.pop("auth_secret_file")
        extra["auth_secret"] = GOOD_SECRET
    _edit_config(_container(o, "rd2h-decode", "vllm"), edit)


def _break_policy(o: list[Obj]) -> None:
    by_name(o, "NetworkPolicy", "rd2h-engines")["spec"]["ingress"][0]["ports"].pop()


def _break_sidecar_decode(o: list[Obj]) -> None:
    _set_arg(_container(o, "rd2h-decode", "rd2h-proxy"), "http://127.0.0.1:8200",
             "http://127.0.0.1:8201")


# (check, what is broken, how, a phrase the check's report must hold); on mooncake-tcp
# unless the check names another overlay after "@".
BREAKS: list[tuple[str, str, Callable[[list[Obj]], None], str]] = [
    ("schema", "unknown container field",
     lambda o: _container(o, "rd2h-prefill", "vllm").update(imagePullPolicyy="Always"),
     "imagePullPolicyy"),
    ("schema", "a kind the core schemas lack",
     lambda o: o.append({"apiVersion": "leaderworkerset.x-k8s.io/v1",
                         "kind": "LeaderWorkerSet", "metadata": {"name": "x"}}),
     "only built-in kinds"),
    ("connector", "kv_connector_extra_config with an unknown key",
     lambda o: _edit_config(_container(o, "rd2h-prefill", "vllm"),
                            lambda cfg: cfg["kv_connector_extra_config"].update(hots="x")),
     "unknown key 'hots'"),
    ("connector", "auth_secret inline", _break_inline_secret, "inline"),
    ("connector", "host not the pod IP",
     lambda o: _edit_config(_container(o, "rd2h-decode", "vllm"),
                            lambda cfg: cfg["kv_connector_extra_config"].update(
                                host="127.0.0.1")),
     "not the pod IP"),
    ("connector", "Decode pod running kv_producer",
     lambda o: _edit_config(_container(o, "rd2h-decode", "vllm"),
                            lambda cfg: cfg.update(kv_role="kv_producer")),
     "component=decode"),
    ("proxy", "--prefill names a missing Service",
     lambda o: _set_arg(_container(o, "rd2h-proxy", "proxy"),
                        "http://rd2h-prefill-0.rd2h-prefill-kv:8100",
                        "http://rd2h-prefil:8100"),
     "no Service 'rd2h-prefil'"),
    ("proxy", "--decode names the Prefill Service",
     lambda o: _set_arg(_container(o, "rd2h-proxy", "proxy"),
                        "http://rd2h-decode-0.rd2h-decode-kv:8200",
                        "http://rd2h-prefill-0.rd2h-prefill-kv:8100"),
     "decode engine"),
    ("proxy", "readiness probe on /healthcheck",
     lambda o: _container(o, "rd2h-proxy", "proxy")["readinessProbe"]["httpGet"].update(
         path="/healthcheck"),
     "pair-aware GET /health"),
    ("proxy", "liveness probe on a route the proxy lacks",
     lambda o: _container(o, "rd2h-proxy", "proxy")["livenessProbe"]["httpGet"].update(
         path="/livez"),
     "liveness probe '/livez'"),
    ("proxy", "--public-url names the Service",
     lambda o: _set_arg(_container(o, "rd2h-proxy", "proxy"),
                        "--public-url=http://$(POD_NAME).rd2h-proxy-pods:8000",
                        "--public-url=http://rd2h-proxy:8000"),
     "own address"),
    ("proxy", "--decode names a pod the StatefulSet does not have",
     lambda o: _set_arg(_container(o, "rd2h-proxy", "proxy"),
                        "http://rd2h-decode-0.rd2h-decode-kv:8200",
                        "http://rd2h-decode-1.rd2h-decode-kv:8200"),
     "no Service 'rd2h-decode-1'"),
    ("proxy", "admin token on the command line",
     lambda o: _set_arg(_container(o, "rd2h-proxy", "proxy"),
                        "--admin-token-file=/var/run/secrets/rd2h/admin-token",
                        "--admin-token=CHANGE-ME"),
     "command line"),
    ("secrets", "Secret volume readable by others",
     lambda o: _spec(o, "rd2h-decode")["volumes"][0]["secret"].update(defaultMode=0o444),
     "0444"),
    ("secrets", "group-writable Secret volume",
     lambda o: _spec(o, "rd2h-decode")["volumes"][0]["secret"].update(defaultMode=0o460),
     "rd2h refuses it"),
    ("secrets", "non-root user without fsGroup",
     lambda o: _spec(o, "rd2h-proxy")["securityContext"].pop("fsGroup"),
     "runAsUser 10001 without fsGroup"),
    ("secrets", "a Secret value in an env value",
     lambda o: _container(o, "rd2h-proxy", "proxy")["env"].append(
         {"name": "TOKEN", "value": "CHANGE-ME"}),
     "appears"),
    ("ports", "ZeroMQ port not declared",
     lambda o: _container(o, "rd2h-decode", "vllm")["ports"].pop(1),
     "port 30000 but does not declare"),
    ("ports", "TP 2 without the second ZeroMQ port",
     lambda o: _set_arg(_container(o, "rd2h-decode", "vllm"), "--tensor-parallel-size=1",
                        "--tensor-parallel-size=2"),
     "port 30001"),
    ("ports", "Mooncake port missing from the headless Service",
     lambda o: by_name(o, "Service", "rd2h-prefill-kv")["spec"]["ports"].pop(),
     "KV port 15003 is on no headless Service"),
    ("ports", "Mooncake range left at the library default",
     lambda o: _edit_config(_container(o, "rd2h-prefill", "vllm"),
                            lambda cfg: cfg["kv_connector_extra_config"].pop("mooncake_env")),
     "cannot be declared"),
    ("ports", "NetworkPolicy without the Mooncake range", _break_policy, "does not admit"),
    ("restricted", "a container running as root",
     lambda o: _container(o, "rd2h-decode", "vllm").setdefault(
         "securityContext", {}).update(runAsUser=0),
     "runAsUser is 0"),
    ("restricted", "a hostPath volume",
     lambda o: _spec(o, "rd2h-prefill")["volumes"].append(
         {"name": "driver", "hostPath": {"path": "/usr/local/Ascend"}}),
     "volume types: driver is hostPath"),
    ("restricted", "capabilities not dropped",
     lambda o: _container(o, "rd2h-proxy", "proxy")["securityContext"].pop("capabilities"),
     "drop does not hold ALL"),
    ("restricted", "no seccomp profile",
     lambda o: _spec(o, "rd2h-proxy")["securityContext"].pop("seccompProfile"),
     "seccomp"),
    ("policy", "an HTTP rule open to every pod",
     lambda o: by_name(o, "NetworkPolicy", "rd2h-engine-http")["spec"]["ingress"][0].pop(
         "from"),
     "has no from"),
    ("policy", "the proxy under no policy",
     lambda o: o.remove(by_name(o, "NetworkPolicy", "rd2h-proxy")),
     "rd2h-proxy: no NetworkPolicy selects this pod"),
    ("drain", "no preStop hook",
     lambda o: _container(o, "rd2h-decode", "vllm")["lifecycle"].pop("preStop"),
     "no preStop hook"),
    ("drain", "the default grace period",
     lambda o: _spec(o, "rd2h-prefill").pop("terminationGracePeriodSeconds"),
     "does not outlast"),
    ("drain", "no PodDisruptionBudget",
     lambda o: o.remove(by_name(o, "PodDisruptionBudget", "rd2h-decode")),
     "rd2h-decode: no PodDisruptionBudget"),
    ("gpu@gpu", "no GPU requested",
     lambda o: _container(o, "rd2h-decode", "vllm")["resources"].pop("limits"),
     "requests no nvidia.com/gpu"),
    ("ascend@ascend", "Mooncake on Ascend",
     lambda o: _edit_config(_container(o, "rd2h-prefill", "vllm"),
                            lambda cfg: cfg["kv_connector_extra_config"].update(
                                transport="mooncake")),
     "not memfabric"),
    ("proxy@llm-d", "sidecar's --decode not its pod's engine", _break_sidecar_decode,
     "does not reach a decode engine"),
    ("proxy@llm-d", "sidecar's --prefill allowlist names a missing Service",
     lambda o: _set_arg(_container(o, "rd2h-decode", "rd2h-proxy"),
                        "http://rd2h-prefill-0.rd2h-prefill-kv:8100", "http://prefill-0:8100"),
     "no Service 'prefill-0'"),
]


@pytest.mark.parametrize(("check", "what", "breaks", "expect"), BREAKS,
                         ids=[f"{b[0]}: {b[1]}" for b in BREAKS])
def test_each_check_catches_a_broken_manifest(check: str, what: str,
                                              breaks: Callable[[list[Obj]], None],
                                              expect: str, tmp_path: Path) -> None:
    checks: dict[str, Callable[[list[Obj]], list[str]]] = {
        "schema": schema_problems, "secrets": secret_problems, "ports": port_problems,
        "connector": lambda o: connector_problems(o, tmp_path),
        "proxy": lambda o: proxy_problems(o, tmp_path), "restricted": restricted_problems,
        "policy": policy_problems, "drain": drain_problems,
        "gpu": lambda o: accelerator_problems(o, "gpu"),
        "ascend": lambda o: accelerator_problems(o, "ascend")}
    check, _, overlay = check.partition("@")
    objects = render(overlay or "mooncake-tcp")
    no_problems(checks[check](objects))
    breaks(objects)
    problems = checks[check](objects)
    assert any(expect in p for p in problems), problems
