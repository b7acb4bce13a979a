"""Hold a run's ranks to a share of this host's cores (a Linux CPU cgroup).

An emulated cluster runs every node on the same cores.  Its helper
processes (the overlay's wireguard-go, ssh and sshd) then take CPU time from
the ranks, which real nodes would not: there each node has its own cores, and
on GPU nodes the ranks compute on the GPU while the tunnel runs on idle
cores.  A bench that compares a path through the overlay with the direct
link can hold the ranks of *every* run (direct ones too) to the same number
of cores, so that the helpers run in what is left and the two runs differ
only in their network path.

:func:`cpu_cap` makes one cgroup (v1 ``cpu`` or v2 with the ``cpu``
controller), sets its quota and removes it again; ``enter`` is the
``preexec_fn`` that puts a child process (and everything it starts) into it.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Iterator

from lorasync.errors import ConfigError, EnvironmentProblem

PERIOD_US = 100_000
PREFIX = "lorasync-"


def _mounts(mountinfo: str = "/proc/self/mountinfo") -> list[tuple[str, str, set[str]]]:
    """(mount point, fs type, super options) of every cgroup mount."""
    out = []
    try:
        text = Path(mountinfo).read_text()
    except OSError:
        return out
    for line in text.splitlines():
        pre, _, post = line.partition(" - ")
        fields, tail = pre.split(), post.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        out.append((fields[4].replace("\\040", " "), tail[0], set(tail[2].split(","))))
    return out


def hierarchy(mountinfo: str = "/proc/self/mountinfo") -> tuple[Path, str] | None:
    """(root directory, "v1" or "v2") of a hierarchy that can cap CPU, or None.
    v1's ``cpu`` controller first (on a hybrid host v2 usually has no
    controllers); else a v2 mount that offers ``cpu``."""
    mounts = _mounts(mountinfo)
    for point, kind, opts in mounts:
        if kind == "cgroup" and "cpu" in opts:
            return Path(point), "v1"
    for point, kind, _ in mounts:
        if kind == "cgroup2":
            try:
                controllers = (Path(point) / "cgroup.controllers").read_text().split()
            except OSError:
                continue
            if "cpu" in controllers:
                return Path(point), "v2"
    return None


def _name(tag: str) -> str:
    return PREFIX + re.sub(r"[^A-Za-z0-9_.-]", "_", tag)


class Cap:
    """A made cgroup: ``enter`` (a ``preexec_fn``) moves the calling process into it."""

    def __init__(self, path: Path, cores: float):
        self.path, self.cores = path, cores
        self._procs = str(path / "cgroup.procs")

    def enter(self) -> None:
        with open(self._procs, "w") as f:
            f.write(str(os.getpid()))


@contextlib.contextmanager
def cpu_cap(cores: float, tag: str) -> Iterator[Cap]:
    """A cgroup that holds its processes to ``cores`` CPUs (CFS quota over a
    100 ms period), named ``lorasync-TAG``; removed on exit, its remaining
    processes moved back to the root first."""
    if not (cores > 0):
        raise ConfigError("cpu cap", cores, "give a positive number of cores, e.g. 1.75")
    ncpu = os.cpu_count() or 1
    if cores > ncpu:
        raise ConfigError("cpu cap", cores, f"this host has {ncpu} cores; give at most {ncpu}")
    h = hierarchy()
    if h is None:
        raise EnvironmentProblem("no CPU cgroup to hold the ranks to a share of the cores: this needs "
                                 "Linux cgroups with the cpu controller (v1 'cpu', or v2 offering 'cpu') "
                                 "mounted under /sys/fs/cgroup; run without the cap")
    root, kind = h
    path = root / _name(tag)
    quota = int(cores * PERIOD_US)
    try:
        path.mkdir(exist_ok=True)
        if kind == "v1":
            (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            sub = root / "cgroup.subtree_control"
            if "cpu" not in sub.read_text().split():
                sub.write_text("+cpu")
            (path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
    except OSError as exc:
        remove(path, root)
        raise EnvironmentProblem(f"could not set up the CPU cgroup {path}: {exc} (this needs root)") from exc
    try:
        yield Cap(path, cores)
    finally:
        remove(path, root)


def remove(path: Path, root: Path) -> bool:
    """Move what still runs in ``path`` to ``root`` and remove the cgroup."""
    if not path.is_dir():
        return False
    try:
        pids = (path / "cgroup.procs").read_text().split()
    except OSError:
        pids = []
    for pid in pids:
        try:
            (root / "cgroup.procs").write_text(pid)
        except OSError:
            pass  # exited meanwhile
    try:
        path.rmdir()
        return True
    except OSError:
        return False


def leftovers(tag: str | None = None) -> list[str]:
    """Remove the caps a stopped run left (``tag``: that one; None: every
    ``lorasync-*`` cap); returns what was removed."""
    h = hierarchy()
    if h is None:
        return []
    root, _ = h
    names = [_name(tag)] if tag is not None else [p.name for p in root.glob(PREFIX + "*")]
    return [str(root / n) for n in names if remove(root / n, root)]
