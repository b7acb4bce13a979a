"""TCP settings for a training link: recommend, emit, apply (all or none), revert.

Recommendations are sized for the link's bandwidth-delay product (BDP =
rate x RTT): a TCP flow cannot carry more than one window per round trip,
and Linux allots roughly half of a socket buffer to the window, so the
buffer maximum must reach about 2 x BDP or a long link is never filled.
Nothing is ever lowered: a value already at or above its target is left
alone.

Which sysctls belong to a network namespace and which are host-global
matters twice: ``tune --apply`` run with ``ip netns exec`` must change only
what is per namespace (a global write would change the host), and ``doctor``
must say where a fix has to be made. :data:`SYSCTL_SCOPE` is that table.
It was verified on Linux 6.18 by writing each key in a fresh namespace and
reading it back in the initial one; at run time :func:`recommend` also
checks writability, so a kernel that differs shows up as "read-only here".
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Callable

from lorasync.errors import ConfigError, EnvironmentProblem
from lorasync.hostops import as_root, require_root
from lorasync.netdiag.hostinfo import HostInfo
from lorasync.plan.net import Link, probe_field, probe_number
from lorasync.units import fmt_bytes, parse_duration, parse_rate_bps

__all__ = [
    "SYSCTL_SCOPE",
    "SysctlAdvice",
    "link_from_options",
    "link_from_probe",
    "link_from_probe_data",
    "default_link",
    "recommend",
    "emit_script",
    "apply",
    "revert",
    "default_backup_path",
    "MemoryAdvice",
    "memory_advice",
]

# key -> (scope, what we saw / why). "netns": each network namespace has its
# own value (a new namespace starts from the kernel default or a copy of
# init_net's). "global": one value for the host; a non-initial namespace sees
# it read-only (rmem/wmem_*) or not at all (netdev_max_backlog).
SYSCTL_SCOPE: dict[str, tuple[str, str]] = {
    "net.core.rmem_max": ("global", "one kernel variable; read-only inside a netns (6.x)"),
    "net.core.wmem_max": ("global", "one kernel variable; read-only inside a netns (6.x)"),
    "net.core.rmem_default": ("global", "read-only inside a netns (6.x)"),
    "net.core.wmem_default": ("global", "read-only inside a netns (6.x)"),
    "net.core.netdev_max_backlog": ("global", "exists in the initial netns only"),
    "net.ipv4.tcp_rmem": ("netns", "per netns since 4.15"),
    "net.ipv4.tcp_wmem": ("netns", "per netns since 4.15"),
    "net.ipv4.tcp_congestion_control": (
        "netns", "per netns since 4.15; a non-initial netns may only pick "
                 "net.ipv4.tcp_allowed_congestion_control"),
    "net.ipv4.tcp_slow_start_after_idle": ("netns", "per netns since 4.15"),
    "net.ipv4.tcp_mtu_probing": ("netns", "per netns since 4.10"),
}

_MIB = 1 << 20
_MIN_BUF = 4 * _MIB  # below this, autotuning defaults are already enough
_MAX_BUF = 1 << 30  # beyond this, memory pressure hurts more than the window helps


@dataclass
class SysctlAdvice:
    """What ``tune`` recommends for one sysctl, and whether it can apply it here."""

    key: str
    current: str | None  # None: not visible here
    recommended: str
    reason: str
    severity: str  # how doctor rates a mismatch: "warn" or "info"
    scope: str  # "netns" or "global"
    change: bool  # recommended differs from current
    applicable: bool  # tune --apply may change it here
    note: str = ""  # why it cannot be applied here, or what else to know

    def to_dict(self) -> dict:
        return asdict(self)


# -- which link --------------------------------------------------------------
def link_from_probe(path: str) -> Link:
    """Rate and RTT from ``lorasync probe --output FILE``, every field checked
    and held to what a link can be (:func:`lorasync.plan.net.check_link`)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except RecursionError:
        raise ConfigError("--from-probe", path, "JSON nested too deeply: need the JSON written "
                          "by `lorasync probe --output`") from None
    except (OSError, ValueError) as exc:
        raise ConfigError("--from-probe", path, f"need the JSON written by `lorasync probe "
                          f"--output` ({exc})") from None
    try:
        return link_from_probe_data(data, f"probe {path}", strict=True)
    except ConfigError as exc:   # name the file too
        raise ConfigError(f"--from-probe {path}: {exc.field}", exc.value, exc.fix) from None


def link_from_probe_data(data: dict, source: str = "measured by the probe", *,
                         strict: bool = False) -> Link:
    """The group's fitted bandwidth, and as RTT twice the median over pairs of
    each pair's *base* one-way latency (its fastest ping-pong: the BDP is set
    by the path, not by queueing or a busy CPU); the fitted per-message
    latency when the probe had no pairs.  A field of the wrong type is a
    ConfigError naming it; ``strict`` (a file) also refuses values no link has."""
    if not isinstance(data, dict):
        raise ConfigError("probe", type(data).__name__, "need the JSON object written by "
                          "`lorasync probe --output`")
    model = probe_field(data, "model", dict, "an object {bandwidth_Bps, latency_s}")
    if not model:
        raise ConfigError("probe.model", model, "the probe fitted no model (it needs 2 ranks "
                          "or more): re-run `lorasync probe --output` across the nodes")
    bw = probe_number(model, "bandwidth_Bps", "probe.model", kind="bandwidth", strict=strict)
    if not bw:
        raise ConfigError("probe.model.bandwidth_Bps", bw, "needs a bandwidth > 0: re-run "
                          "`lorasync probe --output`")
    lats = []
    for i, p in enumerate(probe_field(data, "pairs", list, "a list of pair records") or []):
        if not isinstance(p, dict):
            raise ConfigError(f"probe.pairs[{i}]", p, "give a pair record {src, dst, latency_s}"
                              ", as `lorasync probe --output` writes")
        lat = (probe_number(p, "latency_min_s", f"probe.pairs[{i}]", False, kind="latency",
                            strict=strict)
               or probe_number(p, "latency_s", f"probe.pairs[{i}]", False, kind="latency",
                               strict=strict))
        if lat:
            lats.append(lat)
    lats.sort()
    one_way = lats[len(lats) // 2] if lats else \
        probe_number(model, "latency_s", "probe.model", kind="latency", strict=strict)
    return Link(rate_Bps=bw, rtt_s=max(2 * one_way, 1e-6), source=source)


def default_link(host: HostInfo) -> Link:
    """What to size for when nothing was given or measured: the fastest
    candidate interface's speed (1 Gbit/s if no driver says) and a LAN RTT."""
    speeds = [i.speed_mbps for i in host.candidate_interfaces() if i.speed_mbps]
    rate = max(speeds) * 1e6 if speeds else 1e9
    return Link(rate_Bps=rate / 8, rtt_s=1e-3,
                source="assumed: interface speed and 1 ms RTT; pass --rate/--rtt or --from-probe")


def link_from_options(host: HostInfo, rate: str | None, rtt: str | None,
                      from_probe: str | None) -> Link | None:
    """The link ``--rate``/``--rtt`` or ``--from-probe`` describe (what is not
    given, assumed as :func:`default_link`), or None when none is given."""
    given_rate, given_rtt = rate is not None, rtt is not None
    if from_probe:
        if given_rate or given_rtt:
            raise ConfigError("--from-probe", from_probe, "give either --from-probe or --rate/--rtt")
        return link_from_probe(from_probe)
    if not (given_rate or given_rtt):
        return None
    base = default_link(host)
    return Link(rate_Bps=parse_rate_bps(rate, "--rate") / 8 if given_rate else base.rate_Bps,
                rtt_s=parse_duration(rtt, "--rtt") if given_rtt else base.rtt_s,
                source="given" if given_rate and given_rtt else "partly given, rest assumed")


# -- recommendations -----------------------------------------------------------
def _pow2_at_least(n: float) -> int:
    p = 1
    while p < n:
        p <<= 1
    return p


def buffer_target(link: Link) -> int:
    return int(min(max(_pow2_at_least(2 * link.bdp_bytes), _MIN_BUF), _MAX_BUF))


def recommend(host: HostInfo, link: Link) -> list[SysctlAdvice]:
    """Current vs recommended value and the reason, for every setting we tune."""
    ns = host.netns()
    in_child_ns = ns.initial is not True  # unknown counts as child: never touch the host
    target = buffer_target(link)
    bdp = fmt_bytes(link.bdp_bytes, binary=True)
    recs: list[SysctlAdvice] = []

    def add(key: str, recommended: str, reason: str, severity: str, note: str = ""):
        current = host.sysctl(key)
        scope = SYSCTL_SCOPE[key][0]
        change = current is None or current.split() != recommended.split()
        applicable, why = True, note
        if scope == "global" and in_child_ns:
            applicable = False
            why = (f"global setting: from inside a network namespace this would change the host; "
                   f"run `sysctl -w {key}={_shell_value(recommended)}` on the host")
        elif not host.sysctl_writable(key):
            applicable = False
            why = "not writable here" if current is not None else "not present here"
            if scope == "netns" and in_child_ns and current is not None:
                why += " (expected per-namespace on this kernel; check SYSCTL_SCOPE)"
        recs.append(SysctlAdvice(key, current, recommended, reason, severity, scope,
                                   change, applicable and change, why if change else ""))

    for key, what in (("net.core.rmem_max", "receive"), ("net.core.wmem_max", "send")):
        cur = _int(host.sysctl(key))
        add(key, str(max(cur or 0, target)),
            f"caps the {what} buffer a program sets with SO_{'RCV' if what == 'receive' else 'SND'}BUF; "
            f"{fmt_bytes(target, binary=True)} covers 2 x BDP ({bdp})", "info")
    for key, what in (("net.ipv4.tcp_rmem", "receive"), ("net.ipv4.tcp_wmem", "send")):
        cur = (host.sysctl(key) or "4096 131072 6291456").split()
        lo, mid, hi = (int(x) for x in cur[:3])
        add(key, f"{lo} {mid} {max(hi, target)}",
            f"autotuning grows the {what} window up to the third value; below 2 x BDP ({bdp}) "
            f"a single flow cannot fill the link", "warn")
    add("net.ipv4.tcp_slow_start_after_idle", "0",
        "gradient syncs come in bursts separated by compute; with 1 the window collapses after "
        "every idle gap longer than the retransmit timeout and each sync restarts slow start", "warn")
    add("net.ipv4.tcp_mtu_probing", "1",
        "finds a smaller path MTU when large packets are silently dropped (tunnels, MTU mismatch) "
        "instead of stalling the connection", "info")
    avail = (host.sysctl("net.ipv4.tcp_available_congestion_control") or "").split()
    allowed = (host.sysctl("net.ipv4.tcp_allowed_congestion_control") or "").split()
    cur_cc = host.sysctl("net.ipv4.tcp_congestion_control")
    if "bbr" in avail:
        note = ""
        if in_child_ns and allowed and "bbr" not in allowed:
            note = "bbr is not in tcp_allowed_congestion_control, so a namespace cannot select it"
        add("net.ipv4.tcp_congestion_control", "bbr",
            "model-based: keeps a long or lossy link full where cubic halves its window on every "
            "drop (policers and tbf shapers drop)", "info", note)
        if note and recs[-1].change:
            recs[-1].applicable = False
            recs[-1].note = note
    elif cur_cc:
        add("net.ipv4.tcp_congestion_control", cur_cc,
            "bbr is not loaded (`modprobe tcp_bbr` to offer it); keeping the current one", "info")
    if link.rate_bps >= 10e9:
        cur = _int(host.sysctl("net.core.netdev_max_backlog"))
        add("net.core.netdev_max_backlog", str(max(cur or 0, 30000)),
            "at 10 Gbit/s and above bursts overflow the default 1000-packet input backlog", "info")
    return recs


@dataclass
class MemoryAdvice:
    """What huge pages and locked memory do for this host's training traffic.

    Advice only: ``tune --apply`` never changes them (reserving huge pages
    takes memory from everything else, and only software that asks for them
    uses them)."""

    check: str  # "hugepages" | "memlock"
    severity: str  # ok | info | warn
    found: str
    why: str = ""
    fix: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


_GIB = 1 << 30


def memory_advice(host: HostInfo) -> list[MemoryAdvice]:
    """Huge pages and RLIMIT_MEMLOCK, judged by whether RDMA is present.

    Over TCP (gloo, NCCL's socket transport) data goes through kernel socket
    buffers, ordinary pages the application never maps: huge pages change
    nothing.  RDMA registers (pins) the buffers it sends from and the HCA keeps
    one address translation per page, so large pinned buffers on 4 KiB pages
    need 512x the entries of 2 MiB ones; registration also counts against
    RLIMIT_MEMLOCK, which breaks it outright when small.
    """
    hp = host.hugepages()
    ports = host.ib_ports()
    size_kib = hp["size_kib"] or 2048
    reserved = (hp["total"] or 0) * size_kib * 1024
    pool = (f"{hp['total']} x {fmt_bytes(size_kib * 1024, binary=True)} reserved "
            f"({fmt_bytes(reserved, binary=True)}, {hp['free']} free)" if reserved else "none reserved")
    if not ports:
        return [MemoryAdvice(
            "hugepages", "ok" if not reserved else "info",
            f"no RDMA devices: huge pages do nothing for this job's network traffic (huge pages: {pool})",
            "gloo and NCCL's socket transport send through kernel socket buffers, ordinary pages the "
            "program never maps, so huge pages speed up neither the copies nor the link; they matter for "
            "RDMA memory registration and large pinned buffers",
            "" if not reserved else "nothing to do for training; reserved pages that stay free are memory "
            "nothing else can use: release them (sysctl -w vm.nr_hugepages=0) only if no other program "
            "on this host maps them")]
    devs = ", ".join(sorted({p.device for p in ports}))
    out = []
    limit = host.memlock_limit()
    if limit is not None and limit != -1 and limit < 64 * _GIB:
        out.append(MemoryAdvice(
            "memlock", "warn", f"RDMA devices ({devs}) and locked memory limited to "
            f"{fmt_bytes(limit, binary=True)} (ulimit -l)",
            "registering a buffer for RDMA pins it and counts against RLIMIT_MEMLOCK: NCCL's IB "
            "transport and large pinned buffers fail to register ('ibv_reg_mr failed', 'Cannot "
            "allocate memory') or NCCL falls back to sockets",
            "ulimit -l unlimited   # in the job's shell; for good: '* - memlock unlimited' in "
            "/etc/security/limits.conf, or --ulimit memlock=-1 for a container"))
    elif limit is not None:
        out.append(MemoryAdvice("memlock", "ok", "locked memory (ulimit -l) is "
                                + ("unlimited" if limit == -1 else fmt_bytes(limit, binary=True))
                                + ": RDMA registration is not limited by it"))
    thp = hp["thp"]
    why = ("RDMA registration pins buffers and the HCA keeps one translation per page: large pinned "
           "buffers (NCCL's, a CPU offload's pinned host memory) on 4 KiB pages need 512x the entries "
           "of 2 MiB pages, which can overflow the HCA's translation cache and slow registration; "
           "TCP traffic gains nothing from huge pages")
    if thp == "never":
        out.append(MemoryAdvice(
            "hugepages", "info", f"RDMA devices ({devs}) and transparent huge pages off (never); "
            f"huge pages: {pool}", why,
            "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled   # programs that ask get huge "
            "pages, nothing else changes; reserve vm.nr_hugepages only where the RDMA stack is "
            "configured to use them"))
    else:
        out.append(MemoryAdvice(
            "hugepages", "ok", f"RDMA devices ({devs}); transparent huge pages "
            f"{thp or 'unknown'}: large pinned buffers can be backed by huge pages (huge pages: {pool})",
            why, "nothing to set: reserve vm.nr_hugepages only where the RDMA stack is configured "
            "to use them"))
    return out


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _shell_value(v: str) -> str:
    return f"'{v}'" if " " in v else v


# -- emit ------------------------------------------------------------------------
def emit_script(recs: list[SysctlAdvice], link: Link) -> str:
    """A sh script of ``sysctl -w`` lines making exactly the changes ``apply``
    would make here; changes that cannot be made here are comments."""
    lines = ["#!/bin/sh",
             f"# lorasync tune --emit: sized for {link.describe()}",
             "# Run as root. To keep across reboots, put the KEY=VALUE parts in "
             "/etc/sysctl.d/90-lorasync.conf.",
             "set -e"]
    todo = [r for r in recs if r.change]
    if not todo:
        lines.append("# nothing to change: every setting already meets its target")
    for scope, title in (("netns", "per network namespace: changes the namespace this runs in"),
                         ("global", "host-global: from inside a namespace, run these on the host")):
        part = [r for r in todo if r.scope == scope]
        if part:
            lines.append(f"# {title}")
            for r in part:
                was = r.current if r.current is not None else "not visible here"
                if r.applicable:
                    lines.append(f"sysctl -w {r.key}={_shell_value(r.recommended)}  # was {was}")
                else:  # what --apply would skip here; left for the user to run where it belongs
                    why = "host-global, run it on the host" if r.scope == "global" else r.note
                    lines.append(f"# sysctl -w {r.key}={_shell_value(r.recommended)}  # was {was}; "
                                 f"not here: {why}")
    return "\n".join(lines) + "\n"


# -- apply / revert ------------------------------------------------------------------
Writer = Callable[[str, str], None]


def _write_file(path: str, value: str) -> None:
    with open(path, "w", encoding="utf-8") as f:  # /proc/sys wants one write
        f.write(value + "\n")


def default_backup_path(host: HostInfo) -> str:
    """One backup per network namespace, so a namespace run never clobbers the host's."""
    ns = host.netns()
    tag = f"netns-{ns.inode}" if ns.inode is not None else "netns-unknown"
    return host.path(f"var/lib/lorasync/tune-backup-{tag}.json")


def _require_root(host: HostInfo, what: str) -> None:
    if not host.fake:   # a fake root (--root DIR) is the caller's own files
        require_root(f"tune {what} writes /proc/sys and needs root",
                     f"run it as root, e.g. {as_root('tune ' + what + ' ...')} "
                     "(or use --emit and apply the script yourself)")


def _save_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".tune-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def _write_all(host: HostInfo, changes: list[tuple[str, str, str]], writer: Writer) -> None:
    """Write (key, old, new) in order; on any failure put back what was
    written and raise, so either every change is made or none is."""
    done: list[tuple[str, str, str]] = []
    try:
        for key, old, new in changes:
            writer(host.sysctl_path(key), new)
            done.append((key, old, new))
            got = host.sysctl(key)
            if got is None or got.split() != new.split():
                raise OSError(f"read back {got!r}")
    except OSError as exc:
        failed = [f"{k}: {e}" for k, o, _n in reversed(done) if o is not None
                  for e in _try_write(host, k, o, writer)]
        msg = (f"writing {key}={new!r} failed ({exc}); put back the {len(done)} value(s) already "
               f"written, so nothing changed")
        if failed:
            msg += "; could NOT restore: " + "; ".join(failed)
        raise EnvironmentProblem(msg) from exc


def _try_write(host: HostInfo, key: str, value: str, writer: Writer) -> list[str]:
    try:
        writer(host.sysctl_path(key), value)
        return []
    except OSError as exc:
        return [str(exc)]


def apply(host: HostInfo, recs: list[SysctlAdvice], backup: str | None = None, *,
          writer: Writer = _write_file) -> dict:
    """Make every applicable recommended change, or none.

    The previous values go to the backup file *before* the first write, so a
    crash midway can still be reverted; a second ``apply`` keeps the values
    first saved, so ``revert`` always goes back to the state before tuning.
    Returns {"changed": [...], "skipped": [...], "backup": path}.
    """
    _require_root(host, "--apply")
    backup = backup or default_backup_path(host)
    todo = [r for r in recs if r.change and r.applicable]
    skipped = [{"key": r.key, "recommended": r.recommended, "why": r.note}
               for r in recs if r.change and not r.applicable]
    if not todo:
        return {"changed": [], "skipped": skipped, "backup": None}
    ns = host.netns()
    old_backup = None
    data = {"created": time.time(), "netns_inode": ns.inode, "netns_initial": ns.initial,
            "root": host.root, "values": {}}
    if os.path.exists(backup):
        with open(backup, encoding="utf-8") as f:
            old_backup = json.load(f)
        _check_same_netns(host, old_backup, backup)
        data = dict(old_backup, values=dict(old_backup.get("values", {})))
    for r in todo:
        data["values"].setdefault(r.key, r.current)
    _save_json(backup, data)
    try:
        _write_all(host, [(r.key, r.current, r.recommended) for r in todo], writer)
    except EnvironmentProblem:
        if old_backup is None:
            os.unlink(backup)
        else:
            _save_json(backup, old_backup)
        raise
    return {"changed": [{"key": r.key, "from": r.current, "to": r.recommended} for r in todo],
            "skipped": skipped, "backup": backup}


def _check_same_netns(host: HostInfo, data: dict, path: str) -> None:
    here = host.netns().inode
    there = data.get("netns_inode")
    if here is not None and there is not None and here != there:
        raise EnvironmentProblem(
            f"backup {path} was taken in network namespace {there}, this is {here}: run inside "
            f"that namespace (ip netns exec NAME lorasync tune ...) or pass that namespace's --backup")


def revert(host: HostInfo, backup: str | None = None, *, writer: Writer = _write_file) -> dict:
    """Restore every value saved by :func:`apply` (all or none), then delete the backup."""
    _require_root(host, "--revert")
    backup = backup or default_backup_path(host)
    try:
        with open(backup, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise EnvironmentProblem(f"no backup at {backup}: nothing was applied here "
                                 f"(or pass --backup PATH used with --apply)") from None
    except ValueError as exc:
        raise EnvironmentProblem(f"backup {backup} is not valid JSON ({exc})") from exc
    _check_same_netns(host, data, backup)
    changes = []
    for key, old in data.get("values", {}).items():
        if old is None:
            continue
        cur = host.sysctl(key)
        if cur is None:
            raise EnvironmentProblem(f"cannot restore {key}={old!r}: it does not exist here")
        if cur.split() != old.split():
            changes.append((key, cur, old))
    _write_all(host, changes, writer)
    os.unlink(backup)
    return {"restored": [{"key": k, "from": c, "to": o} for k, c, o in changes], "backup": backup}
