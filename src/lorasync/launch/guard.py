"""A shared secret in front of the c10d stores, which have no authentication.

torch's TCPStore speaks a plain protocol: whoever connects can list, read
and write keys, and torch unpickles rendezvous state it reads from there.
The guard puts a mutual challenge-response (HMAC-SHA256 over fresh nonces,
keyed with the job's secret) in front of every store connection:

* a store server listens on loopback only; its :class:`Guard` listens on the
  address peers use and relays a connection to the store only after the
  peer proved it holds the secret (and proved itself in turn);
* a store client connects through a :class:`Forwarder`: a loopback listener
  of its own process that opens the guarded connection, runs the handshake
  and relays.  torch's client code is unchanged: it talks to loopback.

A process without the secret gets a closed connection after the
challenge, before any byte of the store's protocol: it can neither join,
read nor write.  The secret itself never crosses the network, and
:func:`read_secret` takes it only from a file only its owner can read (or
the environment a launcher sets for its own children), never from a
command line.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import stat
import threading
import time

from lorasync.errors import ConfigError

__all__ = ["ENV", "FILE_ENV", "MAGIC", "GuardRefused", "new_secret", "read_secret", "job_secret",
           "run_id", "Guard", "Forwarder", "client_handshake", "server_handshake"]

#: the secret, hex, for a launcher's own children (never on a command line)
ENV = "LORASYNC_SECRET"
#: a file holding the secret (what several nodes share; mode 0600)
FILE_ENV = "LORASYNC_SECRET_FILE"
MAGIC = b"LSG1"
_NONCE = 32
_MAC = 32
#: seconds a handshake may take
HANDSHAKE_S = 15.0


class GuardRefused(ConnectionError):
    """The other end did not prove it holds the secret."""


def new_secret() -> str:
    """A fresh secret: 32 random bytes, hex."""
    return secrets.token_hex(32)


def read_secret(path: str, field: str = "--secret-file") -> str:
    """The secret in ``path``: a regular file of the caller's, readable by
    nobody else, holding at least 32 hex characters (or other text)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ConfigError(field, path, f"cannot read it ({exc.strerror}): create one with "
                          f"`lorasync secret > {path}` and copy it to every node") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(field, path, "not a regular file")
    if st.st_mode & 0o077:
        raise ConfigError(field, path, f"readable by others (mode {st.st_mode & 0o777:03o}): "
                          f"chmod 600 {path}")
    if st.st_uid != os.geteuid():
        raise ConfigError(field, path, "owned by another user: the job's secret must be yours")
    with open(path, encoding="utf-8", errors="replace") as fh:
        text = fh.read().strip()
    if len(text) < 32:
        raise ConfigError(field, path, "holds fewer than 32 characters: write a new one with "
                          "`lorasync secret`")
    return text


def job_secret(env=None) -> str | None:
    """The job's secret from the environment a launcher prepared
    (``LORASYNC_SECRET``, else the file ``LORASYNC_SECRET_FILE`` names)."""
    env = os.environ if env is None else env
    if env.get(ENV):
        return env[ENV]
    if env.get(FILE_ENV):
        return read_secret(env[FILE_ENV], FILE_ENV)
    return None


def run_id(secret: str) -> str:
    """The rendezvous id of the job holding ``secret``: random per job, the
    same on every node, and telling nothing about the secret."""
    return "lsync-" + hmac.new(secret.encode(), b"lorasync run id", hashlib.sha256).hexdigest()[:16]


def _mac(secret: str, *parts: bytes) -> bytes:
    return hmac.new(secret.encode(), b"".join(parts), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except socket.timeout:
            raise GuardRefused(f"no answer within {HANDSHAKE_S:g} s during the handshake") from None
        if not chunk:
            raise GuardRefused("the other end closed the connection during the handshake")
        buf += chunk
    return buf


def server_handshake(sock: socket.socket, secret: str) -> None:
    """The store's side: challenge, check the answer, answer the client's challenge."""
    sock.settimeout(HANDSHAKE_S)
    mine = os.urandom(_NONCE)
    sock.sendall(MAGIC + mine)
    msg = _recv_exact(sock, len(MAGIC) + _NONCE + _MAC)
    if msg[:len(MAGIC)] != MAGIC:
        raise GuardRefused("not a lorasync store client")
    theirs, mac = msg[len(MAGIC):len(MAGIC) + _NONCE], msg[len(MAGIC) + _NONCE:]
    if not hmac.compare_digest(mac, _mac(secret, b"client", mine, theirs)):
        raise GuardRefused("the client does not hold this job's secret")
    sock.sendall(_mac(secret, b"server", theirs, mine))
    sock.settimeout(None)


def client_handshake(sock: socket.socket, secret: str) -> None:
    """The client's side: answer the challenge, check the store's answer."""
    sock.settimeout(HANDSHAKE_S)
    msg = _recv_exact(sock, len(MAGIC) + _NONCE)
    if msg[:len(MAGIC)] != MAGIC:
        raise GuardRefused("not a lorasync store (no guard answered)")
    theirs = msg[len(MAGIC):]
    mine = os.urandom(_NONCE)
    sock.sendall(MAGIC + mine + _mac(secret, b"client", theirs, mine))
    answer = _recv_exact(sock, _MAC)
    if not hmac.compare_digest(answer, _mac(secret, b"server", mine, theirs)):
        raise GuardRefused("the store does not hold this job's secret")
    sock.settimeout(None)


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(1 << 16)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            try:
                s.shutdown(how)
            except OSError:
                pass


def _relay(a: socket.socket, b: socket.socket) -> None:
    """Copy both ways until both sides are done, then close both."""
    t = threading.Thread(target=_pipe, args=(b, a), daemon=True, name="lorasync-guard-relay")
    t.start()
    _pipe(a, b)
    t.join()
    a.close()
    b.close()


class _Listener:
    """Accepts on a listening socket in a daemon thread, one thread per connection."""

    def __init__(self, listener: socket.socket, name: str):
        self.sock = listener
        self.port = listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name=name).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="lorasync-guard-conn").start()

    def _serve(self, conn: socket.socket) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def close(self) -> None:
        self._closed = True
        try:
            self.sock.close()
        except OSError:
            pass


class Guard(_Listener):
    """Listens on ``listener`` (bound to the address peers use) and relays a
    connection that passed the handshake to the store at 127.0.0.1:``store_port``."""

    def __init__(self, listener: socket.socket, store_port: int, secret: str):
        self.store_port, self.secret = store_port, secret
        self.refused = 0
        super().__init__(listener, "lorasync-guard")

    def _serve(self, conn: socket.socket) -> None:
        try:
            server_handshake(conn, self.secret)
            inner = socket.create_connection(("127.0.0.1", self.store_port), timeout=HANDSHAKE_S)
            inner.settimeout(None)
        except (OSError, GuardRefused):
            self.refused += 1
            conn.close()
            return
        _relay(conn, inner)


class Forwarder(_Listener):
    """A loopback listener of this process; each connection to it is relayed
    to the guarded store at ``host``:``port`` after the handshake.  ``error``:
    why the last attempt failed (for the message when the store client does)."""

    def __init__(self, host: str, port: int, secret: str, connect_timeout: float = 300.0):
        self.host, self.remote_port, self.secret = host, port, secret
        self.connect_timeout = connect_timeout
        self.error: str | None = None
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        super().__init__(listener, "lorasync-guard-forward")

    def _connect(self) -> socket.socket:
        """The connection to the guard, retried while it is not up yet (as
        torch's own client retries a refused connection) until the timeout."""
        deadline = time.monotonic() + self.connect_timeout
        wait = 0.05
        while True:
            try:
                return socket.create_connection((self.host, self.remote_port),
                                                timeout=HANDSHAKE_S)
            except (ConnectionRefusedError, ConnectionResetError, socket.timeout):
                if time.monotonic() + wait > deadline:
                    raise
                time.sleep(wait)
                wait = min(1.0, wait * 2)

    def _serve(self, conn: socket.socket) -> None:
        try:
            outer = self._connect()
            client_handshake(outer, self.secret)
        except GuardRefused as exc:
            self.error = f"{self.host}:{self.remote_port}: {exc}"
            conn.close()
            return
        except OSError as exc:
            self.error = f"{self.host}:{self.remote_port}: {exc.strerror or exc}"
            conn.close()
            return
        _relay(conn, outer)
