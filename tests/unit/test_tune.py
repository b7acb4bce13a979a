"""tune: recommendations, emitted script, apply (all or none) and revert on fake trees."""

import json
import os
import shutil

import pytest

from lorasync import cli
from lorasync.errors import ConfigError, EnvironmentProblem
from lorasync.netdiag import tune
from lorasync.netdiag.hostinfo import HostInfo
from lorasync.plan.net import Link
from lorasync.units import fmt_rate

HOSTS = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hosts")
WAN = Link(rate_Bps=1e9 / 8, rtt_s=40e-3, source="given")  # BDP 5 MB: 16 MiB buffers


@pytest.fixture
def stock(tmp_path):
    """A writable copy of the untuned host, in the initial netns."""
    root = tmp_path / "host"
    shutil.copytree(os.path.join(HOSTS, "loopback-hostname"), root)
    return str(root)


@pytest.fixture
def child_ns(stock):
    """The same host seen from inside a network namespace: another netns
    inode, net.core.* read-only, netdev_max_backlog absent (as on Linux 6.x),
    bbr not allowed to namespaces."""
    with open(os.path.join(stock, "proc/self/ns/net"), "w") as f:
        f.write("net:[4026532999]\n")
    for k in ("rmem_max", "wmem_max", "rmem_default", "wmem_default"):
        os.chmod(os.path.join(stock, "proc/sys/net/core", k), 0o444)
    os.unlink(os.path.join(stock, "proc/sys/net/core/netdev_max_backlog"))
    return stock


def values(root):
    h = HostInfo(root)
    return {k: h.sysctl(k) for k in tune.SYSCTL_SCOPE}


# The spellings are tested once, for every command, in test_units.py; here
# tune's own: the field names, bits/s, a unit always required.

def _rate_bps(text):
    return tune.link_from_options(HostInfo(os.path.join(HOSTS, "good")), text, "1ms", None).rate_bps


def _rtt_s(text):
    return tune.link_from_options(HostInfo(os.path.join(HOSTS, "good")), "1gbit", text, None).rtt_s


@pytest.mark.parametrize("text,bps", [("100mbit", 100e6), ("10gbit", 10e9), ("125MB/s", 1e9)])
def test_parse_rate(text, bps):
    assert _rate_bps(text) == pytest.approx(bps)


@pytest.mark.parametrize("text", ["100", "fast", "-1mbit", "0mbit", "10 furlongs", "12.5mbps"])
def test_parse_rate_rejects(text):
    with pytest.raises(ConfigError, match="--rate"):
        _rate_bps(text)


def test_parse_duration_and_tc_rate():
    assert _rtt_s("40ms") == pytest.approx(0.04)
    with pytest.raises(ConfigError, match="--rtt"):
        _rtt_s("40")
    with pytest.raises(ConfigError, match="--rtt"):
        _rtt_s("-1ms")
    tc = lambda bps: fmt_rate(bps, "tc", unit="bit")  # noqa: E731  (what doctor's advice writes)
    assert tc(10e9) == "10gbit" and tc(100e6) == "100mbit" and tc(1.5e6) == "1.5mbit"
    for bps in (10e9, 100e6, 1.5e6, 123e3):  # what the advice writes, --rate reads back
        assert _rate_bps(tc(bps)) == pytest.approx(bps, rel=1e-3)


def test_link_options_one_source():
    host = HostInfo(os.path.join(HOSTS, "good"))
    assert tune.link_from_options(host, None, None, None) is None
    with pytest.raises(ConfigError, match="--from-probe"):
        tune.link_from_options(host, "1gbit", None, "probe.json")
    part = tune.link_from_options(host, "1gbit", None, None)
    assert part.rtt_s == tune.default_link(host).rtt_s and part.source.startswith("partly")


def test_scope_table_matches_what_the_kernel_does_here():
    assert tune.SYSCTL_SCOPE["net.core.rmem_max"][0] == "global"
    assert tune.SYSCTL_SCOPE["net.ipv4.tcp_rmem"][0] == "netns"
    recs = tune.recommend(HostInfo(os.path.join(HOSTS, "good")), Link(rate_Bps=100e9 / 8, rtt_s=0.1, source="given"))
    assert {r.key for r in recs} <= set(tune.SYSCTL_SCOPE)


def test_recommendations_sized_for_bdp(stock):
    recs = {r.key: r for r in tune.recommend(HostInfo(stock), WAN)}
    assert tune.buffer_target(WAN) == 16 << 20
    assert recs["net.ipv4.tcp_rmem"].recommended == "4096 131072 16777216"
    assert recs["net.ipv4.tcp_wmem"].recommended == "4096 16384 16777216"
    assert recs["net.core.rmem_max"].recommended == str(16 << 20)
    assert recs["net.ipv4.tcp_slow_start_after_idle"].recommended == "0"
    assert recs["net.ipv4.tcp_mtu_probing"].recommended == "1"
    assert recs["net.ipv4.tcp_congestion_control"].recommended == "bbr"
    assert "net.core.netdev_max_backlog" not in recs  # only at >= 10 Gbit/s
    assert all(r.change and r.applicable for r in recs.values())
    assert "2 x BDP" in recs["net.ipv4.tcp_rmem"].reason


def test_never_lowers_and_small_links_need_little():
    good = HostInfo(os.path.join(HOSTS, "good"))  # 64 MiB buffers already
    recs = tune.recommend(good, Link(rate_Bps=100e6 / 8, rtt_s=1e-3, source="given"))
    assert not any(r.change for r in recs)
    assert all(r.recommended.split()[-1] == r.current.split()[-1] for r in recs if r.key.endswith("mem_max"))


def test_huge_bdp_capped():
    assert tune.buffer_target(Link(rate_Bps=400e9 / 8, rtt_s=0.2, source="given")) == 1 << 30


def test_netns_detection(stock, child_ns):
    ns = HostInfo(child_ns).netns()
    assert ns.initial is False and ns.inode == 4026532999


def test_in_child_ns_only_per_namespace_settings_apply(child_ns):
    recs = {r.key: r for r in tune.recommend(HostInfo(child_ns), Link(rate_Bps=10e9 / 8, rtt_s=40e-3, source="given"))}
    for key in ("net.core.rmem_max", "net.core.wmem_max", "net.core.netdev_max_backlog"):
        assert recs[key].change and not recs[key].applicable and "on the host" in recs[key].note
    assert recs["net.core.netdev_max_backlog"].current is None
    for key in ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem", "net.ipv4.tcp_slow_start_after_idle"):
        assert recs[key].applicable
    cc = recs["net.ipv4.tcp_congestion_control"]  # bbr not in tcp_allowed_congestion_control
    assert cc.change and not cc.applicable and "allowed" in cc.note


def test_emit_script(child_ns):
    link = Link(rate_Bps=10e9 / 8, rtt_s=40e-3, source="given")
    text = tune.emit_script(tune.recommend(HostInfo(child_ns), link), link)
    lines = text.splitlines()
    assert lines[0] == "#!/bin/sh" and "set -e" in lines
    assert "sysctl -w net.ipv4.tcp_rmem='4096 131072 134217728'  # was 4096 131072 6291456" in lines
    assert "sysctl -w net.ipv4.tcp_slow_start_after_idle=0  # was 1" in lines
    assert any(ln.startswith("# sysctl -w net.core.rmem_max=134217728") and "host" in ln for ln in lines)
    assert not any(ln.startswith("sysctl -w net.core") for ln in lines)
    nothing = tune.emit_script(tune.recommend(HostInfo(os.path.join(HOSTS, "good")), WAN), WAN)
    assert "nothing to change" in nothing


def test_apply_then_revert_restores_everything(child_ns, tmp_path):
    before = values(child_ns)
    backup = str(tmp_path / "b" / "backup.json")
    host = HostInfo(child_ns)
    res = tune.apply(host, tune.recommend(host, Link(rate_Bps=10e9 / 8, rtt_s=40e-3, source="given")), backup)
    changed = {c["key"] for c in res["changed"]}
    assert changed == {"net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem", "net.ipv4.tcp_slow_start_after_idle",
                       "net.ipv4.tcp_mtu_probing"}
    assert {s["key"] for s in res["skipped"]} >= {"net.core.rmem_max", "net.core.netdev_max_backlog"}
    after = values(child_ns)
    assert after["net.ipv4.tcp_rmem"] == "4096 131072 134217728"
    assert after["net.core.rmem_max"] == before["net.core.rmem_max"]  # global: untouched
    saved = json.load(open(backup))
    assert saved["netns_inode"] == 4026532999 and saved["values"]["net.ipv4.tcp_rmem"] == "4096 131072 6291456"
    # a second apply with other targets keeps the first saved (original) values
    host = HostInfo(child_ns)
    tune.apply(host, tune.recommend(host, Link(rate_Bps=100e9 / 8, rtt_s=0.1, source="given")), backup)
    assert json.load(open(backup))["values"]["net.ipv4.tcp_rmem"] == "4096 131072 6291456"
    res = tune.revert(HostInfo(child_ns), backup)
    assert {r["key"] for r in res["restored"]} == changed
    assert values(child_ns) == before
    assert not os.path.exists(backup)


def test_apply_is_all_or_none(stock, tmp_path):
    before = values(stock)
    backup = str(tmp_path / "backup.json")
    host = HostInfo(stock)
    calls = []

    def flaky(path, value):
        calls.append(path)
        if len(calls) == 3:
            raise PermissionError(13, "Permission denied")
        with open(path, "w") as f:
            f.write(value + "\n")

    with pytest.raises(EnvironmentProblem, match="put back the 2 value"):
        tune.apply(host, tune.recommend(host, WAN), backup, writer=flaky)
    assert values(stock) == before
    assert not os.path.exists(backup)


def test_apply_detects_value_not_taking(stock, tmp_path):
    """The kernel may accept a write and keep another value (e.g. clamp it)."""
    before = values(stock)
    host = HostInfo(stock)

    def clamps(path, value):
        with open(path, "w") as f:
            f.write(("999" if path.endswith("tcp_mtu_probing") and value == "1" else value) + "\n")

    with pytest.raises(EnvironmentProblem, match="tcp_mtu_probing.*read back '999'"):
        tune.apply(host, tune.recommend(host, WAN), str(tmp_path / "b.json"), writer=clamps)
    assert values(stock) == before


def test_revert_refuses_other_namespace_and_missing_backup(stock, tmp_path):
    backup = str(tmp_path / "backup.json")
    host = HostInfo(stock)
    tune.apply(host, tune.recommend(host, WAN), backup)
    with open(os.path.join(stock, "proc/self/ns/net"), "w") as f:
        f.write("net:[4026532000]\n")
    with pytest.raises(EnvironmentProblem, match="taken in network namespace 4026531833"):
        tune.revert(HostInfo(stock), backup)
    with pytest.raises(EnvironmentProblem, match="no backup"):
        tune.revert(HostInfo(stock), str(tmp_path / "none.json"))


def test_default_backup_is_per_namespace(stock, child_ns):
    path = tune.default_backup_path(HostInfo(child_ns))
    assert path == os.path.join(child_ns, "var/lib/lorasync/tune-backup-netns-4026532999.json")


def test_apply_needs_root_on_the_real_host(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(EnvironmentProblem, match="needs root"):
        tune.apply(HostInfo("/"), [], "/nonexistent/backup.json")


def test_link_from_probe(tmp_path):
    p = tmp_path / "probe.json"
    p.write_text(json.dumps({"model": {"bandwidth_Bps": 12.5e6, "latency_s": 1e-4},
                             "pairs": [{"latency_s": 0.02}, {"latency_s": 0.021}, {"latency_s": 0.019}]}))
    link = tune.link_from_probe(str(p))
    assert link.rate_bps == pytest.approx(100e6) and link.rtt_s == pytest.approx(0.04)
    p.write_text("{}")
    with pytest.raises(ConfigError, match="--from-probe"):
        tune.link_from_probe(str(p))


def test_default_link_uses_interface_speed():
    link = tune.default_link(HostInfo(os.path.join(HOSTS, "good")))
    assert link.rate_bps == 10e9 and link.rtt_s == 1e-3 and "assumed" in link.source


def test_cli_check_apply_revert(child_ns, tmp_path, capsys):
    backup = str(tmp_path / "cli-backup.json")
    before = values(child_ns)
    assert cli.main(["tune", "--root", child_ns, "--rate", "10gbit", "--rtt", "40ms", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["netns"]["initial"] is False and data["link"]["bdp_bytes"] == pytest.approx(50e6)
    assert cli.main(["tune", "--root", child_ns, "--rate", "10gbit", "--rtt", "40ms", "--apply",
                     "--backup", backup]) == 0
    out = capsys.readouterr().out
    assert "changed net.ipv4.tcp_rmem" in out and "not changed net.core.rmem_max" in out
    assert cli.main(["tune", "--root", child_ns, "--revert", "--backup", backup]) == 0
    assert "restored net.ipv4.tcp_rmem" in capsys.readouterr().out
    assert values(child_ns) == before
    assert cli.main(["tune", "--root", child_ns, "--revert", "--backup", backup]) == 2
    assert cli.main(["tune", "--root", child_ns, "--revert", "--rate", "1gbit"]) == 2
    assert cli.main(["tune", "--root", child_ns, "--emit", "--rate", "10gbit", "--rtt", "40ms"]) == 0
    assert capsys.readouterr().out.startswith("#!/bin/sh")
