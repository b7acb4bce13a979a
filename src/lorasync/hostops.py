"""What the network rooms do to the host itself: where their runtime state
lives, whether a process is still running, and the root check.

Emulated clusters (:mod:`lorasync.emulate`), overlay tunnels
(:mod:`lorasync.overlay`) and TCP tuning (:mod:`lorasync.netdiag.tune`)
change the host and keep state that other processes (``down``, ``status``)
read back; this module is the one home of those few host facts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from lorasync.errors import EnvironmentProblem

__all__ = ["RUN_DIR", "CLUSTERS_DIR", "TUNNELS_DIR", "pid_alive", "require_root", "as_root"]

#: runtime state (gone at reboot, as the namespaces and tunnels it describes)
RUN_DIR = Path("/run/lorasync")
#: one ``NAME.json`` per emulated cluster (``LORASYNC_STATE_DIR`` overrides)
CLUSTERS_DIR = Path(os.environ.get("LORASYNC_STATE_DIR", RUN_DIR / "clusters"))
#: one ``IFNAME.json`` and event log per overlay tunnel (``LORASYNC_TUNNEL_DIR`` overrides)
TUNNELS_DIR = Path(os.environ.get("LORASYNC_TUNNEL_DIR", RUN_DIR / "tunnels"))


def pid_alive(pid: int | None) -> bool:
    """Running (a zombie counts as gone; it is its parent's to reap)."""
    if not pid:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def as_root(args: str) -> str:
    """The command line that runs ``lorasync ARGS`` as root from here: sudo
    does not keep a venv's PATH, so the lorasync this process runs, by its
    full path."""
    exe = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if os.path.basename(exe) == "lorasync":
        return f"sudo {exe} {args}"
    return f"sudo {sys.executable} -m lorasync {args}"


def require_root(what: str, fix: str) -> None:
    """Raise :class:`EnvironmentProblem` unless this process is root:
    ``"{what}: {fix}"``."""
    if os.geteuid() != 0:
        raise EnvironmentProblem(f"{what}: {fix}")


def route_address(host: str, port: int = 9) -> str | None:
    """The local address this host sends from to reach ``host`` (a UDP
    socket's connect picks the route; nothing is sent), or None."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.connect(sockaddr)
                return s.getsockname()[0]
            except OSError:
                continue
    return None


def stop_process(proc, timeout: float = 10.0) -> None:
    """End a child ``subprocess.Popen``: SIGTERM, then SIGKILL after ``timeout`` s."""
    import subprocess

    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
