"""Engines answer only to their run (owned by engines/; the launchers make the key, client.py sends it, the embedded
engine and the push agent check it).

SGLang's `--api-key` (srt/utils/auth.py, 0.5.23): every endpoint but /health*, /ready* and /metrics* requires
`Authorization: Bearer <key>` (its weight-update routes included, ADMIN_OPTIONAL: the api key when no admin key is
set), else 401 `{"error": "Unauthorized"}`. The embedded engine and the push agent enforce the same rule with the
same answer. The key of a run lives in one owner-only file, `<run_dir>/engine_api_key` (rollout.api_key); every
process of the run finds it by the environment variable API_KEY_FILE_ENV, which the launchers set -- never on a
command line of ours (an SGLang server takes it as `--api-key`, read from the file by the shell that starts it).
"""

from __future__ import annotations

import fcntl
import os
import secrets
from pathlib import Path

API_KEY_FILE_ENV = "SAO_ENGINE_API_KEY_FILE"
KEY_FILE = "engine_api_key"
UNAUTHORIZED = {"error": "Unauthorized"}
"""SGLang's 401 body."""
OPEN_PREFIXES = ("/health", "/ready", "/metrics")
"""What SGLang serves without a key (probes)."""


def ensure_key(run_dir: str | Path) -> Path:
    """The run's key file (made once, owner-only, under a lock: several launchers of one run agree on it)."""
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    path = run / KEY_FILE
    fd = os.open(run / f".{KEY_FILE}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if not path.is_file() or not path.read_text().strip():
            tmp = run / f".{KEY_FILE}.tmp"
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                f.write(secrets.token_urlsafe(32) + "\n")
            os.replace(tmp, path)
        path.chmod(0o600)
    finally:
        os.close(fd)
    return path


def read_key(path: str | Path) -> str:
    """The key in `path`; ValueError naming the file when it cannot be read or is empty."""
    try:
        key = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"engine API key file {path}: {e.strerror} (${API_KEY_FILE_ENV}, rollout.api_key)") from None
    if not key:
        raise ValueError(f"engine API key file {path} is empty (${API_KEY_FILE_ENV}, rollout.api_key)")
    return key


def run_key() -> str | None:
    """The key this process's run uses (from $SAO_ENGINE_API_KEY_FILE), None when the run has none."""
    path = os.environ.get(API_KEY_FILE_ENV)
    return read_key(path) if path else None


def allowed(path: str, authorization: str | None, key: str | None) -> bool:
    """SGLang's decision for an endpoint of normal or admin-optional level with only --api-key set."""
    if key is None or path.startswith(OPEN_PREFIXES):
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), key.encode())
