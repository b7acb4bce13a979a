"""The listening TCP sockets of a process tree, from /proc (each process's own
network namespace: an emulated node's sockets are read in its namespace)."""

from __future__ import annotations

import ipaddress
import os
import time


def descendants(root: int) -> set[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = set(), [root]
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo += children.get(p, [])
    return out


def _listen_table(pid: int) -> dict[int, tuple[str, int]]:
    """{socket inode: (address, port)} of the listening sockets in ``pid``'s netns."""
    out = {}
    for name, v6 in (("tcp", False), ("tcp6", True)):
        try:
            with open(f"/proc/{pid}/net/{name}") as fh:
                lines = fh.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) < 10 or f[3] != "0A":
                continue
            hexaddr, _, hexport = f[1].partition(":")
            raw = bytes.fromhex(hexaddr)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            addr = str(ipaddress.IPv6Address(raw) if v6 else ipaddress.IPv4Address(raw))
            out[int(f[9])] = (addr, int(hexport, 16))
    return out


def listening(root: int) -> set[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket the tree of ``root`` holds."""
    found = set()
    for pid in descendants(root):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        inodes = set()
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
        if not inodes:
            continue
        for inode, (addr, port) in _listen_table(pid).items():
            if inode in inodes:
                found.add((pid, addr, port))
    return found


def watch(proc, seconds: float, every: float = 0.5) -> set[tuple[int, str, int]]:
    """Every listener the tree of ``proc`` (a Popen) held while it ran (at most ``seconds``)."""
    seen: set = set()
    deadline = time.monotonic() + seconds
    while proc.poll() is None and time.monotonic() < deadline:
        seen |= listening(proc.pid)
        time.sleep(every)
    return seen


def wildcard(addr: str) -> bool:
    return ipaddress.ip_address(addr).is_unspecified
