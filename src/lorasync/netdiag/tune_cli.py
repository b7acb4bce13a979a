"""Check, emit, apply or revert TCP settings sized for the training link.

    lorasync tune --rate 100mbit --rtt 40ms              # --check: current, recommended, why
    lorasync tune --from-probe probe.json --emit > tune.sh
    sudo .venv/bin/lorasync tune --rate 10gbit --rtt 2ms --apply  # all or nothing, with a backup
    sudo .venv/bin/lorasync tune --revert                         # back to the values before --apply

Inside a network namespace (``ip netns exec NS lorasync tune --apply``)
only the per-namespace settings change; host-global ones are listed with
the command to run on the host. The backup (default
/var/lib/lorasync/tune-backup-netns-INODE.json) is per namespace.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from lorasync.errors import ConfigError

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    mode = p.add_mutually_exclusive_group()
    for flag, help_text in (("--check", "show current and recommended values (default)"),
                            ("--emit", "print a sysctl script making exactly the recommended changes"),
                            ("--apply", "make the changes (root); all or none; saves a backup"),
                            ("--revert", "restore the values saved by --apply (root)")):
        mode.add_argument(flag, dest="mode", action="store_const", const=flag[2:], help=help_text)
    p.set_defaults(mode="check")
    p.add_argument("--rate", default=None, help="link rate, e.g. 100mbit, 10gbit, 1Gb/s")
    p.add_argument("--rtt", default=None, help="round-trip time, e.g. 40ms, 200us")
    p.add_argument("--from-probe", default=None, metavar="FILE",
                   help="rate and RTT measured by `lorasync probe --output FILE`")
    p.add_argument("--backup", default=None, metavar="PATH",
                   help="backup file for --apply/--revert (default /var/lib/lorasync/tune-backup-netns-INODE.json)")
    p.add_argument("--root", default="/", metavar="DIR",
                   help="operate on a fake tree under DIR (tests) instead of /proc/sys")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _link(args, host):
    from lorasync.netdiag.tune import default_link, link_from_options

    return (link_from_options(host, args.rate, args.rtt, args.from_probe)
            or default_link(host))


def _table(recs) -> str:
    rows = [("setting", "scope", "current", "recommended", "")]
    for r in recs:
        state = "ok" if not r.change else ("change" if r.applicable else "cannot here")
        rows.append((r.key, r.scope, r.current if r.current is not None else "(not visible)",
                     r.recommended, state))
    w = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(f"{c:<{w[i]}}" if i < 4 else c for i, c in enumerate(row)).rstrip() for row in rows]
    lines.append("")
    for r in recs:
        if r.change:
            lines.append(f"{r.key}: {r.reason}" + (f"\n    not applied here: {r.note}" if r.note else ""))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from lorasync.netdiag.hostinfo import HostInfo
    from lorasync.netdiag import tune

    if not os.path.isdir(args.root):
        raise ConfigError("--root", args.root, "not a directory")
    if args.mode == "revert" and (args.rate or args.rtt or args.from_probe):
        raise ConfigError("--revert", True, "takes no --rate/--rtt/--from-probe: it restores the backup")
    host = HostInfo(root=args.root)
    ns = host.netns()
    if args.mode == "revert":
        res = tune.revert(host, args.backup)
        if args.json:
            json.dump(res, sys.stdout, indent=1)
            sys.stdout.write("\n")
        else:
            for c in res["restored"]:
                print(f"restored {c['key']}: {c['from']} -> {c['to']}")
            if not res["restored"]:
                print("nothing to restore: every saved value is already in place")
            print(f"removed backup {res['backup']}")
        return 0
    link = _link(args, host)
    recs = tune.recommend(host, link)
    if args.mode == "emit":
        sys.stdout.write(tune.emit_script(recs, link))
        return 0
    if args.mode == "check":
        if args.json:
            json.dump({"link": {"rate_bps": link.rate_bps, "rtt_s": link.rtt_s, "bdp_bytes": link.bdp_bytes,
                                "source": link.source},
                       "netns": {"inode": ns.inode, "initial": ns.initial, "how": ns.how},
                       "settings": [r.to_dict() for r in recs],
                       "memory": [a.to_dict() for a in tune.memory_advice(host)]}, sys.stdout, indent=1)
            sys.stdout.write("\n")
        else:
            where = {True: "initial network namespace", False: "a non-initial network namespace",
                     None: "an unknown network namespace"}[ns.initial]
            print(f"sized for {link.describe()}; in {where}")
            print(_table(recs))
            for a in tune.memory_advice(host):   # advice only: --apply never sets these
                print(f"{a.check}: {a.found}" + (f"\n  why: {a.why}" if a.severity != "ok" else "")
                      + (f"\n  fix: {a.fix}" if a.fix and a.severity != "ok" else ""))
        return 0
    res = tune.apply(host, recs, args.backup)
    if args.json:
        json.dump(res, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    for c in res["changed"]:
        print(f"changed {c['key']}: {c['from']} -> {c['to']}")
    for s in res["skipped"]:
        print(f"not changed {s['key']} (wanted {s['recommended']}): {s['why']}")
    if res["changed"]:
        print(f"backup of the previous values: {res['backup']} (undo with: lorasync tune --revert"
              + (f" --backup {res['backup']})" if args.backup else ")"))
    else:
        print("nothing to change here")
    return 0
