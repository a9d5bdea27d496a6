"""CurveZMQ: only producers whose public key is authorized get anything through."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from megatron_sao.bus import TrajectoryReceiver, TrajectorySender
from megatron_sao.bus.auth import generate_keypair
from megatron_sao.bus.sender_io import BusHandshakeError
from tests.bus.helpers import fast_cfg, free_addr, traj, wait_for
from tests.bus.rawclient import RawClient

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE")


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("keys")
    cmd = [sys.executable, str(REPO / "tools" / "bus_keygen.py"), str(root), "--client", "good", "--client", "evil"]
    subprocess.run(cmd, check=True, capture_output=True)
    (root / "authorized" / "evil.key").unlink()  # generated, but never authorized
    return root


def _cfgs(keys: Path, client: str) -> tuple:
    addr = free_addr()
    server = fast_cfg(
        addr,
        curve_server_key=str(keys / "server" / "learner.key_secret"),
        curve_client_keys_dir=str(keys / "authorized"),
    )
    producer = fast_cfg(
        addr,
        curve_server_public_key=str(keys / "server" / "learner.key"),
        curve_client_key=str(keys / "clients" / f"{client}.key_secret"),
    )
    return server, producer


def test_authorized_producer_gets_through(keys: Path) -> None:
    server, producer = _cfgs(keys, "good")
    with TrajectoryReceiver(server) as r, TrajectorySender(producer, "good") as s:
        s.send(traj(0), timeout_s=5)
        assert r.recv(timeout_s=10).trajectory_id == "w-0"
        r.commit()
        assert s.flush(5)


def test_unauthorized_key_and_plain_clients_get_nothing_through(keys: Path) -> None:
    server, evil = _cfgs(keys, "evil")
    plain = fast_cfg(server.bind)
    with TrajectoryReceiver(server) as r:
        intruders = [TrajectorySender(evil, "evil"), TrajectorySender(plain, "plain")]
        for s in intruders:
            with contextlib.suppress(RuntimeError):  # it may have given up already (checked below)
                s.send(traj(0, worker=s.worker_id), timeout_s=5)
        raw = RawClient(server.bind, hello=False)
        raw.send_raw([raw.data_envelope(), b"junk"], with_credit=False)
        wait_for(lambda: r.metrics().get("auth_failed", 0) >= 1, what="ZAP refusal")
        wait_for(lambda: r.metrics().get("handshake_failed", 0) >= 1, what="plain handshake refused")
        time.sleep(0.5)
        assert r.recv(timeout_s=0.5) is None
        m = r.metrics()
        assert m["received"] == 0 and m["rejected"] == 0 and m.get("hellos", 0) == 0  # nothing reached the app
        for s, why in zip(intruders, ("curve_client_keys_dir", "bus.curve off")):  # each gives up, saying why
            with pytest.raises(RuntimeError) as failed:
                s.send(traj(1, worker=s.worker_id), timeout_s=5)
                s.flush(30)
            assert isinstance(failed.value.__cause__, BusHandshakeError) and why in str(failed.value.__cause__)
            s.close()
        raw.close()


def test_a_producer_holding_another_server_key_gives_up_naming_the_key(keys: Path, tmp_path: Path) -> None:
    """A valid key that is not the learner's: the handshake can never complete, so the producer stops retrying after
    HANDSHAKE_FAILURES failures in a row, naming the key file (it used to retry forever in silence)."""
    other = str(generate_keypair(tmp_path, "another_learner")[0])
    server, producer = _cfgs(keys, "good")
    wrong = producer.model_copy(update={"curve_server_public_key": other})
    with TrajectoryReceiver(server), TrajectorySender(wrong, "good") as s:
        started = time.monotonic()
        with pytest.raises(RuntimeError) as failed:  # at the send, or at the flush when the send came first
            s.send(traj(0), timeout_s=5)
            s.flush(30)
        assert time.monotonic() - started < 30
        assert isinstance(failed.value.__cause__, BusHandshakeError) and other in str(failed.value.__cause__)
        with pytest.raises(RuntimeError, match="security handshake"):  # a worker asking for starts hears it too
            s.take_starts(1, 0)


def test_missing_key_files_are_config_errors_with_a_fix(tmp_path: Path, keys: Path) -> None:
    server, producer = _cfgs(keys, "good")
    bad = server.model_copy(update={"curve_client_keys_dir": str(tmp_path)})
    with pytest.raises(ValueError, match="bus_keygen"):
        TrajectoryReceiver(bad)
    bad = producer.model_copy(update={"curve_client_key": str(tmp_path / "nope.key_secret")})
    with pytest.raises(ValueError, match="does not exist"):
        TrajectorySender(bad, "good")
    # a certificate whose key was mangled (libzmq would say only "Invalid argument" at connect): named
    text = Path(producer.curve_server_public_key).read_text()
    mangled = tmp_path / "mangled.key"
    mangled.write_text(text.replace('public-key = "', 'public-key = "xx', 1))
    bad = producer.model_copy(update={"curve_server_public_key": str(mangled)})
    with pytest.raises(ValueError, match=rf"{mangled}: its public-key is not a CURVE key \(40 Z85"):
        TrajectorySender(bad, "good")


def test_keys_others_could_read_or_write_are_refused_naming_the_fix(tmp_path: Path, keys: Path) -> None:
    """A secret key readable by other users (ssh's rule), and an authorized-keys directory or key others may write
    (they could authorize themselves), are refused before the bus starts, naming the file and the chmod."""
    import shutil

    from megatron_sao.bus.auth import load_client_keys, start_server_auth

    mine = tmp_path / "keys"
    shutil.copytree(keys, mine)
    server, producer = _cfgs(mine, "good")
    secret = Path(producer.curve_client_key)
    secret.chmod(0o644)
    with pytest.raises(ValueError, match=rf"open to other users \(mode 644\).*chmod 600 {secret}"):
        load_client_keys(producer)
    secret.chmod(0o600)
    assert load_client_keys(producer) is not None
    authorized = Path(server.curve_client_keys_dir)
    authorized.chmod(0o777)
    ctx = zmq.Context()
    try:
        with pytest.raises(ValueError, match=rf"writable by other users.*chmod go-w {authorized}"):
            start_server_auth(ctx, server)
        authorized.chmod(0o755)
        (authorized / "good.key").chmod(0o666)
        with pytest.raises(ValueError, match="good.key is writable by other users"):
            start_server_auth(ctx, server)
    finally:
        ctx.term()


def test_a_refusal_before_the_io_thread_runs_is_still_heard(keys: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The handshake can fail before the sender's I/O thread first runs (a loaded machine: CI saw it); libzmq does not
    retry a refused handshake for long (a few times in the first second here), so a monitor attached only then would
    wait forever. Here the thread starts only after the receiver has refused the producer."""
    from megatron_sao.bus import sender_io

    server, _ = _cfgs(keys, "evil")
    with TrajectoryReceiver(server) as r:
        started = sender_io.SenderIO.loop

        def late(self: sender_io.SenderIO, *args: object) -> None:
            wait_for(lambda: r.metrics().get("handshake_failed", 0) >= 1, what="plain handshake refused")
            time.sleep(2.0)  # libzmq's few retries have come and gone too
            started(self, *args)

        monkeypatch.setattr(sender_io.SenderIO, "loop", late)
        with TrajectorySender(fast_cfg(server.bind), "plain") as s, pytest.raises(RuntimeError) as failed:
            s.send(traj(0, worker="plain"), timeout_s=10)
            s.flush(10)
        assert isinstance(failed.value.__cause__, BusHandshakeError) and "bus.curve off" in str(failed.value.__cause__)
