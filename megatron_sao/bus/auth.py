"""CurveZMQ authentication of the bus: key files, the ZAP authenticator thread, socket setup on both sides.

Owned here: how BusConfig's curve_* key files turn into socket options, and the receiver's ZAP handler
(zmq.auth.thread.ThreadAuthenticator) that admits only clients whose public key is in curve_client_keys_dir.
Called by receiver_io.py (server side), sender.py (client side) and tools/bus_keygen.py (key generation).
"""

from __future__ import annotations

import logging
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from megatron_sao.config.bus import BusConfig

log = logging.getLogger(__name__)

_KEYGEN_HINT = "generate keys with `python tools/bus_keygen.py DIR --server NAME --client NAME ...`"


def generate_keypair(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write DIR/NAME.key (public) and DIR/NAME.key_secret (secret, mode 0600); returns both paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(directory, name)
    Path(secret).chmod(0o600)
    return Path(public), Path(secret)


def ensure_run_keys(cfg: BusConfig) -> None:
    """bus.curve with the run's own keys (cfg.curve_keys_dir): make whichever is missing -- the server's keypair and
    one client keypair whose public key is the one authorized -- under an flock, so the learner and the workers
    starting together (on one machine or over a shared run dir) make them once. Owner-only permissions."""
    if cfg.curve_keys_dir is None:
        return
    import fcntl
    import os
    import shutil

    keys = Path(cfg.curve_keys_dir)
    keys.mkdir(parents=True, exist_ok=True)
    keys.chmod(0o700)
    fd = os.open(keys / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if not (keys / "server.key_secret").is_file():
            generate_keypair(keys, "server")
        if not (keys / "client.key_secret").is_file():
            generate_keypair(keys, "client")
        clients = keys / "clients"
        if not (clients / "client.key").is_file():
            clients.mkdir(mode=0o700, exist_ok=True)
            shutil.copyfile(keys / "client.key", clients / "client.key")
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _load(path: str, what: str, need_secret: bool) -> tuple[bytes, bytes | None]:
    if not Path(path).is_file():
        raise ValueError(f"{what} key file {path} does not exist; {_KEYGEN_HINT}")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except ValueError as e:
        raise ValueError(f"{what} key file {path} is not a ZeroMQ certificate ({e}); {_KEYGEN_HINT}") from e
    if need_secret and secret is None:
        raise ValueError(f"{what} key file {path} holds no secret key; point it at the .key_secret file")
    for name, key in (("public-key", public), ("secret-key", secret)):
        if key is not None and not _z85_key(key):  # (libzmq would only say "Invalid argument" at connect)
            raise ValueError(f"{what} key file {path}: its {name} is not a CURVE key (40 Z85 characters); "
                             f"{_KEYGEN_HINT}")  # fmt: skip
    mode = Path(path).stat().st_mode & 0o777
    if need_secret and mode & 0o077:
        raise ValueError(f"{what} key file {path} is open to other users (mode {mode:o}): a secret key must be its "
                         f"owner's alone; chmod 600 {path}")  # fmt: skip
    return public, secret


def _z85_key(key: bytes) -> bool:
    try:
        return len(key) == 40 and len(zmq.utils.z85.decode(key)) == 32
    except (ValueError, KeyError, IndexError, TypeError, OverflowError):
        return False


def _owner_writable_only(path: Path, what: str) -> None:
    """Refuse an authorized-keys directory (or key in it) that others may write: they could authorize themselves."""
    for p in [path, *sorted(path.glob("*.key"))]:
        mode = p.stat().st_mode & 0o777
        if mode & 0o022:
            raise ValueError(f"{what} {p} is writable by other users (mode {mode:o}): whoever can write it can "
                             f"authorize a producer; chmod go-w {p}")  # fmt: skip


def start_server_auth(ctx: zmq.Context, cfg: BusConfig) -> ThreadAuthenticator | None:
    """Start the ZAP handler for `ctx` when CURVE is configured on the receiver side (else None, with a warning)."""
    if cfg.curve_server_key is None:
        if not cfg.curve:
            log.warning("bus.curve=false: the bus at %s takes trajectories from any process that reaches it, and "
                        "the learner trains on them", cfg.bind)  # fmt: skip
        return None
    ensure_run_keys(cfg)
    keys_dir = Path(cfg.curve_client_keys_dir or "")
    if not keys_dir.is_dir() or not any(keys_dir.glob("*.key")):
        raise ValueError(f"bus.curve_client_keys_dir {keys_dir} holds no client public keys (*.key); {_KEYGEN_HINT}")
    _owner_writable_only(keys_dir, "bus.curve_client_keys_dir")
    _load(cfg.curve_server_key, "bus.curve_server_key", need_secret=True)
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(keys_dir))
    return auth


def configure_server(sock: zmq.Socket, cfg: BusConfig) -> None:
    """Make `sock` a CURVE server when configured; with it, unauthenticated peers never complete a handshake."""
    if cfg.curve_server_key is None:
        return
    public, secret = _load(cfg.curve_server_key, "bus.curve_server_key", need_secret=True)
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_server = True


ClientKeys = tuple[bytes, bytes, bytes]
"""(server public key, client public key, client secret key)."""


def load_client_keys(cfg: BusConfig) -> ClientKeys | None:
    """A producer's CURVE keys from its key files (None when CURVE is off); raises ValueError with the fix."""
    if cfg.curve_server_public_key is None or cfg.curve_client_key is None:
        return None
    ensure_run_keys(cfg)
    server_public, _ = _load(cfg.curve_server_public_key, "bus.curve_server_public_key", need_secret=False)
    public, secret = _load(cfg.curve_client_key, "bus.curve_client_key", need_secret=True)
    assert secret is not None
    return server_public, public, secret


def configure_client(sock: zmq.Socket, keys: ClientKeys | None) -> None:
    """Give a producer socket its CURVE identity and the server's public key (no-op without keys)."""
    if keys is None:
        return
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys
