"""A short TCP link test between two hosts: round-trip time, then bulk goodput.

Owns the measurement protocol behind ``Cluster.measure`` (and ``lorasync
tunnel status``): Python's socket module only, no extra tools, so it runs
in any namespace or host that has this package.

Protocol, one TCP connection per part, the first byte saying which:

- ``p``: ping. The server echoes single bytes until EOF; the client times
  7 one-byte round trips on a TCP_NODELAY connection and keeps the median of
  the last 6 (the first pays for slow start of the receive path).
- ``d``: data. The client sends as fast as it can; the server counts what
  arrives for ``window`` seconds or ``max_bytes``, leaves out the first
  quarter (TCP's ramp-up) and answers one JSON line with its goodput, then
  drains the rest so the client never blocks on a full buffer.
- ``D`` + 4 bytes: the same with the window (milliseconds, big-endian, at
  most 10 s) chosen by the client, for a long-running server (the overlay's
  supervisor serves ``lorasync tunnel status`` this way).
- ``e``: endpoints (a hub's long-running server only). The server answers
  one JSON object, each node's outside ``ADDRESS:PORT`` as its WireGuard
  sees it, and closes: what nodes behind NAT punch holes with
  (:mod:`lorasync.overlay.punch`).

Run as ``python -m lorasync.overlay.linktest serve ADDR WINDOW MAX_BYTES`` (prints
its port, serves pings until one data connection has been measured, exits)
and ``python -m lorasync.overlay.linktest measure ADDR PORT WINDOW`` (prints one
JSON object: bytes, seconds, rate_bps, rtt_s, rtt_min_s, connect_s).
"""

from __future__ import annotations

import json
import select
import socket
import statistics
import struct
import sys
import time

__all__ = ["measure", "serve"]

PINGS = 7
_CHUNK = 1 << 16


def _serve_ping(c: socket.socket) -> None:
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        b = c.recv(1)
        if not b:
            break
        c.sendall(b)


def _serve_data(c: socket.socket, window: float, max_bytes: int) -> dict:
    buf = bytearray(1 << 20)
    n, marks, t0 = 0, [], None
    while True:
        k = c.recv_into(buf)
        if not k:
            break
        now = time.monotonic()
        n += k
        if t0 is None:
            t0 = now
        if not marks or now - marks[-1][0] >= 0.005:
            marks.append((now, n))
        if now - t0 >= window or n >= max_bytes:
            break
    if t0 is None:  # the client closed before sending anything
        return {"bytes": 0, "seconds": 0.0, "rate_bps": 0.0}
    marks.append((time.monotonic(), n))
    ws = t0 + 0.25 * (marks[-1][0] - t0)  # leave out TCP's ramp-up
    a = next(m for m in marks if m[0] >= ws)
    dt = marks[-1][0] - a[0]
    rate = (marks[-1][1] - a[1]) * 8 / dt if dt > 0 else 0.0
    res = {"bytes": n, "seconds": marks[-1][0] - t0, "rate_bps": rate}
    c.sendall(json.dumps(res).encode() + b"\n")
    c.settimeout(5)
    try:
        while c.recv_into(buf):
            pass
    except OSError:
        pass
    return res


MAX_CLIENT_WINDOW = 10.0


def _recv_exact(c: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        got = c.recv(n - len(buf))
        if not got:
            raise ConnectionError("closed early")
        buf += got
    return buf


def handle(c: socket.socket, window: float, max_bytes: int, endpoints=None) -> str:
    """Serve one accepted connection (any part); returns its mode letter.
    ``endpoints``: a callable giving the ``e`` answer (None: ``e`` is refused
    by closing)."""
    c.settimeout(window + 20)
    try:
        mode = c.recv(1)
        if mode == b"e" and endpoints is not None:
            c.sendall(json.dumps(endpoints()).encode())
        elif mode == b"p":
            _serve_ping(c)
        elif mode == b"d":
            _serve_data(c, window, max_bytes)
        elif mode == b"D":
            asked = struct.unpack("!I", _recv_exact(c, 4))[0] / 1000
            asked = min(MAX_CLIENT_WINDOW, max(0.05, asked))
            c.settimeout(asked + 20)
            _serve_data(c, asked, max_bytes)
        return mode.decode(errors="replace")
    finally:
        c.close()


def serve(addr: str, window: float, max_bytes: int, port: int = 0, ready=None) -> None:
    """Listen on ``addr:port`` (0 = any free port), call ``ready(port)``, serve
    pings until one data connection has been measured."""
    srv = socket.socket()
    try:
        srv.bind((addr, port))
        srv.listen(8)
        srv.settimeout(window + 20)
        if ready is not None:
            ready(srv.getsockname()[1])
        while True:
            c, _ = srv.accept()
            if handle(c, window, max_bytes) in ("d", "D"):
                break
    finally:
        srv.close()


def measure(addr: str, port: int, window: float, pings: int = PINGS,
            connect_timeout: float = 10.0, send_window: bool = False) -> dict:
    """Client side: RTT from ``pings`` one-byte round trips, then ``window``
    seconds of bulk data; returns the server's figures plus rtt_s, rtt_min_s
    and connect_s (time to open the first connection).  ``send_window``: tell
    the server the window (mode ``D``) instead of relying on its own."""
    t = time.monotonic()
    c = socket.create_connection((addr, port), timeout=connect_timeout)
    connect = time.monotonic() - t
    rtts = []
    try:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c.sendall(b"p")
        for _ in range(pings):
            t = time.monotonic()
            c.sendall(b"x")
            if c.recv(1) != b"x":
                raise OSError("echo failed")
            rtts.append(time.monotonic() - t)
    finally:
        c.close()
    d = socket.create_connection((addr, port), timeout=connect_timeout)
    try:
        d.sendall(b"D" + struct.pack("!I", int(window * 1000)) if send_window else b"d")
        d.setblocking(False)
        chunk = b"\0" * _CHUNK
        deadline = time.monotonic() + window + 15
        reply = b""
        while not reply.endswith(b"\n"):
            if time.monotonic() > deadline:
                raise TimeoutError("bulk transfer timed out")
            r, w, _ = select.select([d], [d], [], 1.0)
            if r:
                got = d.recv(4096)
                if not got:
                    break
                reply += got
            elif w:
                try:
                    d.send(chunk)
                except BlockingIOError:
                    pass
        # drop what is still queued instead of trickling it out at a slow rate
        d.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    finally:
        d.close()
    res = json.loads(reply)
    kept = rtts[1:] or rtts
    res.update(rtt_s=statistics.median(kept), rtt_min_s=min(kept), connect_s=connect)
    return res


def serve_in_background(address: str, port: int, stop, *, freebind: bool = False,
                        endpoints=None) -> socket.socket:
    """A link-test server on ``address:port`` in a daemon thread, one thread per
    connection, until ``stop`` (a threading.Event) is set or the socket closed:
    what ``tunnel status --measure`` talks to on every overlay node.
    ``freebind``: bind before the address exists (it goes away while a
    transport restarts; the socket must outlive that); ``endpoints``: what
    mode ``e`` answers (the hub's)."""
    import threading

    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if freebind:
        srv.setsockopt(socket.SOL_IP, getattr(socket, "IP_FREEBIND", 15), 1)
    srv.bind((address, port))
    srv.listen(16)

    def quietly(c: socket.socket) -> None:
        try:
            handle(c, 1.0, 1 << 30, endpoints)
        except (OSError, ValueError, LookupError):
            pass

    def loop():
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=quietly, args=(c,), daemon=True).start()
    threading.Thread(target=loop, daemon=True, name="linktest").start()
    return srv


def current_netns() -> str | None:
    """Name of the network namespace this process is in (``ip netns identify``)."""
    import os
    import subprocess

    proc = subprocess.run(["ip", "netns", "identify", str(os.getpid())], capture_output=True,
                          text=True)
    return proc.stdout.strip() or None


def measure_peer(address: str, port: int, seconds: float, netns: str | None) -> dict:
    """RTT and rate to a peer's link-test server through the overlay (from inside
    ``netns`` when given), as ``tunnel status --measure`` reports them."""
    import subprocess

    if netns:
        proc = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-m",
                               "lorasync.overlay.linktest", "measure", address, str(port),
                               str(seconds), "--send-window"],
                              capture_output=True, text=True, timeout=seconds + 40)
        if proc.returncode != 0:
            return {"measure_error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
        r = json.loads(proc.stdout)
    else:
        try:
            r = measure(address, port, seconds, send_window=True, connect_timeout=5)
        except (OSError, ValueError) as exc:
            return {"measure_error": f"{type(exc).__name__}: {exc}"}
    return {"rtt_s": r["rtt_s"], "rate_bps": r["rate_bps"]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    usage = ("usage: python -m lorasync.overlay.linktest serve ADDR WINDOW MAX_BYTES | "
             "measure ADDR PORT WINDOW [--send-window]")
    send_window = "--send-window" in argv
    argv = [a for a in argv if a != "--send-window"]
    if len(argv) != 4 or argv[0] not in ("serve", "measure"):
        print(usage, file=sys.stderr)
        return 2
    if argv[0] == "serve":
        serve(argv[1], float(argv[2]), int(argv[3]), ready=lambda p: print(p, flush=True))
        return 0
    try:
        res = measure(argv[1], int(argv[2]), float(argv[3]), send_window=send_window)
    except (OSError, ValueError) as exc:
        print(f"linktest: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
