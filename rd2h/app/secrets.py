"""Secrets from a file or an environment variable, never from a value in a config or
on a command line (docs/security.md, "Providing secrets").

vLLM prints the whole ``--kv-transfer-config`` in its log at start (its "non-default
args" line) and keeps it on the engine's command line (``/proc/<pid>/cmdline``), so a
secret written there reaches every log shipper and every process listing. A
deployment names where the secret is instead: a file no one but its owner can read,
or a root-owned file its group may also read (a Kubernetes Secret mounted as a file
with ``defaultMode: 0440`` and the pod's ``fsGroup``), or an environment variable.
Errors name the file or the variable, never the value.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

MAX_SECRET_BYTES = 4096


class SecretSourceError(ValueError):
    """A secret's file or variable cannot be used; the message names it, not its value."""


def read_secret_file(path: str | os.PathLike[str], what: str) -> str:
    """The secret in file ``path``: a regular file (a link to one is followed) holding at
    most ``MAX_SECRET_BYTES`` of UTF-8. One trailing line break is not part of the secret
    (``echo ... > file`` leaves one).

    Its permissions follow PostgreSQL's rule for its TLS key: accepted when only its
    owner has any permission (``mode & 0o077 == 0``: 0400, 0600), or when it is owned by
    root and its group may read it but not write or execute it, and others have no
    permission (``mode & 0o037 == 0``: 0440, 0640). The second form is what Kubernetes
    gives a pod's non-root user: a Secret volume's files belong to root and to the
    pod's ``fsGroup``, and ``defaultMode: 0440`` lets that group read them. Anything
    else is refused, naming the file, its mode and the rule."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as exc:
        raise SecretSourceError(f"{what}: cannot read {str(p)!r} ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise SecretSourceError(f"{what}: {str(p)!r} is not a regular file")
    mode = stat.S_IMODE(st.st_mode)
    if not secret_mode_allowed(mode, st.st_uid):
        owner = "root" if st.st_uid == 0 else f"uid {st.st_uid}"
        raise SecretSourceError(
            f"{what}: {str(p)!r} is open to group or others (mode {mode:04o}, owned by "
            f"{owner}); a secret file must be readable by its owner only (chmod 0400 or "
            f"0600), or be owned by root and readable by its group only (0440 or 0640, "
            f"no group write, nothing for others: a Kubernetes Secret volume with "
            f"defaultMode: 0440 and the pod's fsGroup)")
    if st.st_size > MAX_SECRET_BYTES:
        raise SecretSourceError(f"{what}: {str(p)!r} holds {st.st_size} bytes (a secret "
                                f"of at most {MAX_SECRET_BYTES} is expected)")
    try:
        text = p.read_bytes().decode("utf-8")
    except OSError as exc:
        raise SecretSourceError(f"{what}: cannot read {str(p)!r} ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise SecretSourceError(f"{what}: {str(p)!r} is not UTF-8 text") from None
    value = text.removesuffix("\n").removesuffix("\r") if text.endswith("\n") else text
    if not value:
        raise SecretSourceError(f"{what}: {str(p)!r} is empty")
    return value


def secret_mode_allowed(mode: int, uid: int) -> bool:
    """Whether a file of permission bits ``mode`` owned by ``uid`` may hold a secret:
    owner-only, or root-owned with at most group read (``read_secret_file``)."""
    return mode & 0o077 == 0 or (uid == 0 and mode & 0o037 == 0)


def read_secret_env(name: str, what: str, environ: Mapping[str, str] | None = None) -> str:
    """The secret in environment variable ``name``."""
    value = (os.environ if environ is None else environ).get(name)
    if not value:
        raise SecretSourceError(f"{what}: the environment variable {name!r} is not set "
                                f"or empty")
    return value


def read_secret(what: str, *, file: str | None = None, env: str | None = None,
                environ: Mapping[str, str] | None = None) -> str | None:
    """The secret ``what`` from ``file`` or ``env`` (one of them; None if neither)."""
    if file is not None and env is not None:
        raise SecretSourceError(f"{what}: give {what}_file or {what}_env, not both")
    if file is not None:
        return read_secret_file(file, f"{what}_file")
    if env is not None:
        return read_secret_env(env, f"{what}_env", environ)
    return None
