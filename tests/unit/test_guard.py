"""The guard in front of the c10d stores: a process with the job's secret
reads and writes, one without it (a plain TCPStore client, a client with
another secret, a raw socket) gets nothing."""

import datetime
import os
import socket
import threading

import pytest

from lorasync.errors import ConfigError
from lorasync.launch import guard, stores

pytestmark = pytest.mark.timeout(120)
SHORT = datetime.timedelta(seconds=3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def store():
    """A guarded store server on 127.0.0.1 (world of 1: no wait for clients)."""
    secret = guard.new_secret()
    cls = stores._make_store_class("127.0.0.1", secret)
    port = _free_port()
    server = cls("127.0.0.1", port, 1, True, timeout=SHORT)
    server.set("rendezvous", "state")
    return secret, port, server


def test_the_secret_opens_the_store(store):
    secret, port, server = store
    assert server.port == port   # peers are told the guard's port, not the loopback store's
    client = stores._make_store_class("127.0.0.1", secret)("127.0.0.1", port, None, False,
                                                           timeout=SHORT, wait_for_workers=False)
    assert client.get("rendezvous") == b"state"
    client.set("from-client", "x")
    assert server.get("from-client") == b"x"


def test_the_store_listens_on_loopback_behind_the_guard_only(store):
    _, port, server = store
    inner = type(server).__mro__[1].port.__get__(server)   # torch's own view: the store's port
    assert inner != port
    listening = {(a, p) for a, p in _listening()}
    assert ("127.0.0.1", port) in listening and ("127.0.0.1", inner) in listening
    assert not [a for a, p in listening if p in (port, inner) and a in ("0.0.0.0", "::")]


def _listening():
    from lorasync.netdiag.doctor import parse_proc_net_tcp
    out = []
    for name, v6 in (("tcp", False), ("tcp6", True)):
        with open(f"/proc/self/net/{name}") as fh:
            out += parse_proc_net_tcp(fh.read(), v6)
    return out


def test_another_secret_gets_nothing(store):
    _, port, _ = store
    other = stores._make_store_class("127.0.0.1", guard.new_secret())
    with pytest.raises(stores.StoreAuthError, match="does not hold this job's secret|closed"):
        other("127.0.0.1", port, None, False, timeout=SHORT, wait_for_workers=False)


def test_a_plain_store_client_gets_nothing(store):
    _, port, _ = store
    plain = stores._store_class()
    with pytest.raises(Exception):
        plain("127.0.0.1", port, None, False, timeout=SHORT, wait_for_workers=False)


def test_a_raw_connection_sees_only_the_challenge(store):
    _, port, _ = store
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        hello = s.recv(100)
        assert hello.startswith(guard.MAGIC) and len(hello) == len(guard.MAGIC) + 32
        s.sendall(b"\x00" * 68)   # no valid answer: closed, not one byte of the store
        assert s.recv(100) == b""


def test_handshake_is_mutual():
    """A server that does not hold the secret cannot pass as the store: it
    cannot answer the client's challenge."""
    a, b = socket.socketpair()

    def impostor():
        a.sendall(guard.MAGIC + os.urandom(32))
        a.recv(100)                    # the client's proof, useless without the secret
        a.sendall(os.urandom(32))      # a guess at the answer

    t = threading.Thread(target=impostor)
    t.start()
    with pytest.raises(guard.GuardRefused, match="does not hold this job's secret"):
        guard.client_handshake(b, guard.new_secret())
    t.join()
    a.close()
    b.close()


def test_secret_file_rules(tmp_path):
    good = tmp_path / "job.secret"
    fd = os.open(good, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, (guard.new_secret() + "\n").encode())
    os.close(fd)
    assert len(guard.read_secret(str(good))) == 64
    os.chmod(good, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        guard.read_secret(str(good))
    with pytest.raises(ConfigError, match="lorasync secret"):
        guard.read_secret(str(tmp_path / "missing"))
    short = tmp_path / "short"
    fd = os.open(short, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"abc")
    os.close(fd)
    with pytest.raises(ConfigError, match="fewer than 32"):
        guard.read_secret(str(short))


def test_run_id_is_per_secret_and_hides_it():
    a, b = guard.new_secret(), guard.new_secret()
    assert guard.run_id(a) == guard.run_id(a) != guard.run_id(b)
    assert a[:8] not in guard.run_id(a)


def test_secret_command_writes_a_private_file(tmp_path):
    from lorasync.cli import main

    path = tmp_path / "job.secret"
    assert main(["secret", str(path)]) == 0
    assert os.stat(path).st_mode & 0o777 == 0o600 and len(guard.read_secret(str(path))) == 64
    assert main(["secret", str(path)]) == 2   # never overwritten
