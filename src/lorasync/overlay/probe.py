"""Which transport reaches the hub: UDP to its WireGuard port, TCP to its SSH port.

Used by ``lorasync tunnel join --transport auto`` on a real node, and by the
emulated cluster's ``overlay=auto`` from each node's namespace; both pick with
:func:`decide` and record its reason.

A probe needs something on the hub that answers: before the overlay runs,
that is :func:`serve` (``lorasync tunnel probe-server`` on the hub while the
nodes join; the emulated cluster starts it in the hub's namespace).  It echoes
UDP datagrams on the WireGuard port and greets every TCP connection on the SSH
port with a token (the plan's id), so that another service on that port (the
system's sshd, a web server) is not taken for the hub: a TCP connect alone
proves a path, not the hub.

Run as ``python -m lorasync.overlay.probe serve HOST UDP_PORT TCP_PORT
[--token T] [--seconds S]`` (prints ``ready``) or ``python -m
lorasync.overlay.probe check HOST UDP_PORT TCP_PORT [--token T]`` (prints
``[udp, tcp]`` as JSON).
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import sys
import time

from lorasync.errors import ConfigError, EnvironmentProblem

__all__ = ["PROBE_TRIES", "PROBE_WAIT_S", "TOKEN", "check", "decide", "serve"]

#: UDP probes to the hub (one every PROBE_WAIT_S) before UDP is called blocked
PROBE_TRIES = 3
PROBE_WAIT_S = 0.5
#: the greeting when no plan id is given (the emulated cluster)
TOKEN = "lorasync-probe"
TCP_TIMEOUT_S = 3.0


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def serve(host: str, udp_port: int, tcp_port: int, token: str = TOKEN,
          seconds: float | None = None, ready=None) -> None:
    """Answer probes on ``host`` (one address, never a wildcard) until
    ``seconds`` have passed (None: forever).  ``ready()`` is called once both
    sockets listen.  ConfigError naming the port when one is taken or the
    address is not this host's."""
    fam = _family(host)
    u = socket.socket(fam, socket.SOCK_DGRAM)
    t = socket.socket(fam, socket.SOCK_STREAM)
    t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        for s, port, proto in ((u, udp_port, "UDP"), (t, tcp_port, "TCP")):
            try:
                s.bind((host, int(port)))
            except OSError as exc:
                if exc.errno == 98:   # EADDRINUSE
                    raise ConfigError("port", port, f"{proto} port {port} on {host} is already in "
                                      "use on this host (the overlay already up here, or another "
                                      "service): stop it while the nodes probe") from None
                raise ConfigError("address", host, f"cannot listen there ({exc.strerror}): give "
                                  "an address of this host") from None
        t.listen(64)
        if ready is not None:
            ready()
        greet = (token + "\n").encode()
        end = None if seconds is None else time.monotonic() + seconds
        while end is None or time.monotonic() < end:
            wait = 1.0 if end is None else max(0.0, min(1.0, end - time.monotonic()))
            for s in select.select([u, t], [], [], wait)[0]:
                if s is u:
                    data, peer = u.recvfrom(256)
                    if data.startswith(token.encode()):
                        u.sendto(data, peer)
                else:
                    conn, _ = t.accept()
                    try:
                        conn.settimeout(1.0)
                        conn.sendall(greet)
                    except OSError:
                        pass
                    finally:
                        conn.close()
    finally:
        u.close()
        t.close()


def check(host: str, udp_port: int, tcp_port: int | None, token: str = TOKEN,
          tries: int = PROBE_TRIES, wait_s: float = PROBE_WAIT_S) -> tuple[bool, bool]:
    """(UDP answers, TCP greets) from here to the hub's probe server; ``tcp_port``
    None: not tried (False)."""
    udp = False
    try:
        infos = socket.getaddrinfo(host, int(udp_port), type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise EnvironmentProblem(f"the hub's address {host} does not resolve ({exc.strerror}): "
                                 "check the name given to `tunnel init --hub`") from None
    fam, addr = infos[0][0], infos[0][4]
    u = socket.socket(fam, socket.SOCK_DGRAM)
    u.settimeout(wait_s)
    msg = (token + " udp").encode()
    try:
        for _ in range(tries):
            try:
                u.sendto(msg, addr)
                udp = u.recv(256) == msg
            except OSError:
                pass
            if udp:
                break
    finally:
        u.close()
    tcp = False
    if tcp_port is not None:
        try:
            with socket.create_connection((host, int(tcp_port)), timeout=TCP_TIMEOUT_S) as c:
                c.settimeout(TCP_TIMEOUT_S)
                got = b""
                while not got.endswith(b"\n") and len(got) < 256:
                    chunk = c.recv(256)
                    if not chunk:
                        break
                    got += chunk
                tcp = got.decode(errors="replace").strip() == token
        except OSError:
            tcp = False
    return udp, tcp


_FIX = ("check that `lorasync tunnel probe-server` runs on the hub while the nodes join (and that "
        "a firewall lets one of the two out), or choose with --transport udp|ssh")


def decide(udp: bool, tcp: bool, *, host: str, udp_port: int, ssh_port: int | None,
           relayed: bool = False, tries: int = PROBE_TRIES, fix: str = _FIX) -> tuple[str, str]:
    """(transport, reason) from what the probes found: WireGuard where UDP
    reaches the hub (direct, or relayed through it), SSH where only TCP does.
    EnvironmentProblem when neither does (``ssh_port`` None: the SSH path is
    not offered)."""
    if udp:
        how = ("relayed through the hub to the other nodes behind NAT until a direct path is "
               "punched" if relayed else "direct")
        return "wireguard", f"UDP to the hub {host}:{udp_port} answers: WireGuard over UDP, {how}"
    if tcp and ssh_port is not None:
        return "ssh", (f"UDP to the hub {host}:{udp_port} got no answer ({tries} tries), TCP to "
                       f"port {ssh_port} connects: SSH over TCP")
    tried = f"UDP (port {udp_port})" + ("" if ssh_port is None else f" nor over TCP (port {ssh_port})")
    raise EnvironmentProblem(f"the hub {host} answers neither over {tried}: no transport can "
                             f"join it" + (f"; {fix}" if fix else ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lorasync.overlay.probe")
    p.add_argument("command", choices=["serve", "check"])
    p.add_argument("host")
    p.add_argument("udp_port", type=int)
    p.add_argument("tcp_port", type=int)
    p.add_argument("--token", default=TOKEN)
    p.add_argument("--seconds", type=float, default=None)
    p.add_argument("--tries", type=int, default=PROBE_TRIES)
    p.add_argument("--wait", type=float, default=PROBE_WAIT_S)
    a = p.parse_args(argv)
    if a.command == "serve":
        try:
            serve(a.host, a.udp_port, a.tcp_port, a.token, a.seconds,
                  ready=lambda: print("ready", flush=True))
        except ConfigError as exc:
            print(f"error: {exc}", flush=True)
            return 2
        return 0
    print(json.dumps(list(check(a.host, a.udp_port, a.tcp_port, a.token, a.tries, a.wait))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
