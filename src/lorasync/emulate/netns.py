"""The host side of an emulated cluster: the checks for root and iproute2,
``ip``/``tc`` commands, a cluster's namespaces (``lsync-NAME-...``) and the
processes inside them or serving it (its delay forwarders), and stopping
process trees.

Knows how namespaces and processes are named and found, not what a cluster
is built of (:mod:`lorasync.emulate.cluster`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Sequence

from lorasync.errors import EnvironmentProblem
from lorasync.hostops import as_root, pid_alive, require_root

__all__ = [
    "PREFIX",
    "descendants",
    "forwarder_pids",
    "kill",
    "ns_names",
    "pids_in_netns",
    "require_host",
    "run",
]

#: every namespace of a cluster is PREFIX-NAME-...
PREFIX = "lsync"


def require_host(need_tun: bool = False) -> None:
    """Root, ``ip`` and ``tc``, and with ``need_tun`` /dev/net/tun, or ``EnvironmentProblem``."""
    require_root("an emulated cluster needs root (network namespaces, tc)",
                 f"run as root, e.g. {as_root('cluster up ...')}")
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            raise EnvironmentProblem(f"'{tool}' not found: install iproute2 (apt-get install iproute2)")
    if need_tun and not os.path.exists("/dev/net/tun"):
        raise EnvironmentProblem("delay/loss needs /dev/net/tun (the kernel has no netem here "
                                 "and the delay link is a TUN forwarder): load the tun module")


def run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run ``argv`` (captured); with ``check``, a failure is an ``EnvironmentProblem``
    naming the command and the last line it printed."""
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        raise EnvironmentProblem(f"`{' '.join(argv)}` failed: {msg[-1] if msg else proc.returncode}")
    return proc


def ns_names(name: str | None) -> list[str]:
    """Namespaces of cluster ``name`` (all lorasync clusters when None)."""
    out = run(["ip", "netns", "list"], check=False).stdout
    pat = re.compile(rf"^{PREFIX}-{re.escape(name) if name else '[A-Za-z0-9_]+'}-(hub|node\d+|nat\d+)$")
    return [line.split()[0] for line in out.splitlines() if line.strip() and pat.match(line.split()[0])]


def pids_in_netns(ns: str) -> list[int]:
    """Every process inside namespace ``ns``."""
    try:
        st = os.stat(f"/run/netns/{ns}")
    except OSError:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            s = os.stat(f"/proc/{entry}/ns/net")
        except OSError:
            continue
        if (s.st_dev, s.st_ino) == (st.st_dev, st.st_ino):
            pids.append(int(entry))
    return pids


def forwarder_pids(name: str | None) -> list[int]:
    """The delay forwarders of cluster ``name`` (of every cluster when None)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"lorasync.emulate.delaylink" not in argv or b"--cluster" not in argv:
            continue
        owner = argv[argv.index(b"--cluster") + 1:][:1]
        if name is None or owner == [name.encode()]:
            pids.append(int(entry))
    return pids


def _ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            pid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def kill(pids: Sequence[int], grace: float = 2.0) -> None:
    """SIGTERM, then SIGKILL what is left after ``grace`` seconds."""
    pids = [p for p in set(pids) if p not in _ancestors()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 2.0)
        while time.monotonic() < deadline:
            pids = [p for p in pids if pid_alive(p)]
            if not pids:
                return
            time.sleep(0.02)


def descendants(roots: Sequence[int]) -> set[int]:
    """Every process below ``roots`` in the process tree, whatever its session."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), list(roots)
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out
