"""The overlay's node specs, config loading, keys, `wg show` parsing and supervision
decisions: pure logic.

Keys come from a fake generator here (tunnel_fakes; no wireguard-tools needed);
one test checks the real `wg genkey` where it is installed.  The plan, join and
assemble steps are in test_tunnel_keys.py.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat

import pytest

from lorasync.errors import ConfigError, EnvironmentProblem
from lorasync.overlay import preflight, supervisor, tunnel, wireguard as wg
from lorasync.emulate.nat import ruleset as nat_ruleset
from lorasync.overlay.enroll import parse_node_spec
from lorasync.overlay.wgsupervisor import supervise_step
from tunnel_fakes import enrolled


# ---------------------------------------------------------------- node specs

@pytest.mark.parametrize("text,name,endpoint,port", [
    ("node1", "node1", None, 51820),
    ("hub=203.0.113.5", "hub", "203.0.113.5:51820", 51820),
    ("b=example.org:4000", "b", "example.org:4000", 4000),
    ("v6=[2001:db8::1]:51821", "v6", "[2001:db8::1]:51821", 51821),
])
def test_parse_node_spec(text, name, endpoint, port):
    n = parse_node_spec(text)
    assert (n.name, n.endpoint, n.listen_port) == (name, endpoint, port)


@pytest.mark.parametrize("text,field", [("a=host:0", "node a"), ("a=host:99999", "node a"),
                                        ("a=", "node a"), ("bad name=1.2.3.4", "node"),
                                        ("a=host:port", "node a")])
def test_parse_node_spec_errors(text, field):
    with pytest.raises(ConfigError) as e:
        parse_node_spec(text)
    assert e.value.field == field and e.value.fix


# ---------------------------------------------------------------- one node's config

def test_load_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        tunnel.load_config(tmp_path / "missing.json")
    (tmp_path / "t.json").write_text("{\"version\": 9}")
    with pytest.raises(ConfigError, match="tunnel assemble"):
        tunnel.load_config(tmp_path / "t.json")
    paths = enrolled(tmp_path / "ov", ["h=192.0.2.1", "a"], "h")
    raw = json.loads(paths[0].read_text())
    raw["ifname"] = "a-name-far-too-long"
    paths[0].write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as e:
        tunnel.load_config(paths[0])
    assert e.value.field == "ifname"


def test_cli_init_bad_input(capsys, tmp_path):
    from lorasync import cli

    assert cli.main(["tunnel", "init", "--out", str(tmp_path / "x"), "--hub", "h"]) == 2
    assert "--hub" in capsys.readouterr().err
    assert cli.main(["tunnel", "init", "--out", str(tmp_path / "x"), "--hub", "h=1.2.3.4",
                     "--mtu", "big", "--node", "a"]) == 2
    assert "--mtu" in capsys.readouterr().err


# ---------------------------------------------------------------- keys and tools

@pytest.mark.skipif(not shutil.which("wg"), reason="needs wireguard-tools (apt-get install -y wireguard-tools)")
def test_generate_keypair_with_wg():
    import subprocess

    priv, pub = wg.generate_keypair()
    assert len(priv) == len(pub) == 44 and priv != pub
    assert subprocess.run(["wg", "pubkey"], input=priv, capture_output=True, text=True).stdout.strip() == pub


def test_check_key_file(tmp_path):
    key = tmp_path / "private.key"
    wg.write_private_key(key, "K" * 43 + "=")
    wg.check_key_file(key)
    os.chmod(key, 0o644)
    with pytest.raises(ConfigError) as e:
        wg.check_key_file(key)
    assert e.value.field == "private_key_file" and f"chmod 600 {key}" in e.value.fix
    assert "K" * 10 not in str(e.value)
    with pytest.raises(ConfigError, match="no such file"):
        wg.check_key_file(tmp_path / "none")
    with pytest.raises(FileExistsError):  # never overwrites (or widens) an existing key
        wg.write_private_key(key, "x")


def test_write_private_key_ignores_umask(tmp_path):
    old = os.umask(0)
    try:
        wg.write_private_key(tmp_path / "k", "secret")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "k").st_mode) == 0o600


def test_missing_tools_name_the_install_command(monkeypatch):
    monkeypatch.setattr(wg.shutil, "which", lambda t: None if t == "wireguard-go" else "/usr/bin/" + t)
    with pytest.raises(EnvironmentProblem) as e:
        wg.require_tools()
    assert "wireguard-go not found" in str(e.value) and wg.INSTALL_HINT in str(e.value)
    monkeypatch.setattr(wg.shutil, "which", lambda t: None if t == "nft" else "/usr/bin/" + t)
    wg.require_tools()
    with pytest.raises(EnvironmentProblem, match="apt-get install -y nftables"):
        wg.require_tools(need_nft=True)


# ---------------------------------------------------------------- wg show dump

DUMP = ("SECRETPRIVATEKEYaaaaaaaaaaaaaaaaaaaaaaaaaaa=\tHUBPUBLICKEYbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb=\t51820\toff\n"
        "PEER1cccccccccccccccccccccccccccccccccccccc=\t(none)\t10.213.0.2:51820\t10.77.0.2/32\t1796153584\t180\t92\toff\n"
        "PEER2dddddddddddddddddddddddddddddddddddddd=\t(none)\t(none)\t10.77.0.3/32,10.77.0.4/32\t0\t0\t0\t25\n")


def test_parse_dump_drops_the_private_key():
    st = wg.parse_dump(DUMP)
    assert st.public_key.startswith("HUBPUBLIC") and st.listen_port == 51820
    assert "SECRET" not in repr(st)
    p1, p2 = st.peers
    assert (p1.endpoint, p1.allowed_ips, p1.latest_handshake, p1.rx_bytes, p1.tx_bytes, p1.keepalive_s) \
        == ("10.213.0.2:51820", ["10.77.0.2/32"], 1796153584, 180, 92, None)
    assert p1.handshake_age(1796153584 + 12) == 12
    assert p2.endpoint is None and p2.allowed_ips == ["10.77.0.3/32", "10.77.0.4/32"]
    assert p2.handshake_age() is None and p2.keepalive_s == 25
    assert st.peer(p2.public_key) is p2 and st.peer("nope") is None


@pytest.mark.parametrize("text", ["", "only\tthree\tfields\n",
                                  DUMP.splitlines()[0] + "\nPEER\t(none)\tx\n"])
def test_parse_dump_malformed_never_echoes_the_text(text):
    with pytest.raises(ValueError) as e:
        wg.parse_dump(text)
    assert "SECRET" not in str(e.value) and "wg show dump" in str(e.value)


# ---------------------------------------------------------------- supervision

def _peers():
    return [{"name": "hub", "public_key": "H", "endpoint": "hub.example:51820", "address": "10.77.0.1",
             "allowed_ips": ["10.77.0.1/32"]},
            {"name": "natted", "public_key": "N", "endpoint": None, "address": "10.77.0.3",
             "allowed_ips": ["10.77.0.3/32"]}]


def _state(hub_hs, nat_hs):
    return wg.DeviceState("ME", 51820, [wg.PeerState("H", "1.2.3.4:51820", [], hub_hs, 0, 0, 25),
                                        wg.PeerState("N", None, [], nat_hs, 0, 0, None)])


def test_supervise_step_backoff_and_recovery():
    tracks, t0 = {}, 1000.0
    # just started: no handshake yet is fine within the grace period
    assert supervise_step(_peers(), _state(0, 0), t0 + 2, t0, tracks, stale_s=180) == []
    acts = supervise_step(_peers(), _state(0, 0), t0 + 11, t0, tracks, stale_s=180)
    assert [(a.kind, a.peer) for a in acts] == [("rehandshake", "hub"), ("silent", "natted")]
    assert "re-resolving hub.example:51820" in acts[0].message and acts[0].next_in == 1
    # backoff: 1, 2, 4 s between tries while it stays stale; the NAT'd peer is logged once
    times, now = [], t0 + 11
    while len(times) < 4:
        now += 0.5
        for a in supervise_step(_peers(), _state(0, 0), now, t0, tracks, stale_s=180):
            assert a.kind == "rehandshake"
            times.append((now, a.next_in))
    assert [n for _, n in times] == [2, 4, 8, 16]
    assert [b - a for (a, _), (b, _) in zip(times, times[1:])] == [2.0, 4.0, 8.0]
    # a handshake: recovered (logged with the attempts), counters reset
    acts = supervise_step(_peers(), _state(int(now) - 3, int(now) - 1), now, t0, tracks, stale_s=180)
    assert {a.kind for a in acts} == {"recovered", "back"} and "after 5 attempt(s)" in acts[0].message
    assert tracks["hub"].attempts == 0
    # a handshake older than stale_s is stale again
    acts = supervise_step(_peers(), _state(int(now) - 3, int(now) - 1), now + 200, t0, tracks, stale_s=180)
    assert acts[0].kind == "rehandshake" and "s old" in acts[0].message


def test_backoff_is_capped():
    tracks, t0 = {}, 0.0
    delays, now = [], 20.0
    while now < 2000:
        for a in supervise_step(_peers()[:1], _state(0, 0), now, t0, tracks, stale_s=180):
            delays.append(a.next_in)
        now += 1
    assert max(delays) == 60 and delays[:3] == [1, 2, 4]


# ---------------------------------------------------------------- host checks

def _cfg(tmp_path, **kw):
    return tunnel.load_config(enrolled(tmp_path / "ov", ["h=192.0.2.1", "a"], "h", **kw)[1])


def test_address_clash(tmp_path):
    cfg = _cfg(tmp_path)  # 10.77.0.2/24
    preflight.check_address_clash(cfg, [("lo", "127.0.0.1/8"), ("eth0", "192.168.1.5/24")])
    for cidr in ("10.77.0.9/24", "10.0.0.1/8", "10.77.0.2/32"):
        with pytest.raises(ConfigError) as e:
            preflight.check_address_clash(cfg, [("eth1", cidr)])
        assert e.value.field == "address" and "eth1" in e.value.fix and "--subnet" in e.value.fix


def test_port_in_use_names_the_fix():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", 0))
    port = s.getsockname()[1]
    try:
        with pytest.raises(ConfigError) as e:
            preflight.check_port_free(port)
        assert e.value.field == "listen_port" and f"sport = :{port}" in e.value.fix
    finally:
        s.close()
    preflight.check_port_free(port)


def test_overlay_mtu_from_path_mtu():
    assert wg.overlay_mtu([(1500, False)]) == 1440
    assert wg.overlay_mtu([(1500, False), (1500, True)]) == 1420
    assert wg.overlay_mtu([(65000, False)]) == 64940
    assert wg.overlay_mtu([(1300, False)]) == 1280  # never below IPv6's minimum
    assert wg.overlay_mtu([]) == 1420
    assert wg.path_mtu("127.0.0.1", 9) >= 65535  # loopback's, from the kernel


def test_configured_mtu_wins(tmp_path):
    assert preflight.choose_mtu(_cfg(tmp_path, mtu=1380)) == 1380


def test_rulesets():
    relay = wg.relay_ruleset("lsync0")
    assert "table inet lsync_lsync0" in relay and "hook forward" in relay
    assert 'iifname "lsync0" oifname != "lsync0" drop' in relay
    nat = nat_ruleset("lan", "wan")
    assert 'oifname "wan" masquerade' in nat and "policy drop" in nat
    assert 'iifname "wan" oifname "lan" ct state established,related accept' in nat


def test_status_format_marks_relayed_pairs():
    from lorasync.overlay.cli import format_status

    st = [{"ifname": "lsync0", "node": "a", "address": "10.77.0.2", "prefixlen": 24, "mtu": 1440,
           "listen_port": 51820, "hub": "h", "is_hub": False, "netns": None, "supervisor_alive": True,
           "supervisor_pid": 7, "restarts": 1, "error": None,
           "peers": [{"name": "h", "address": "10.77.0.1", "route": "direct", "relayed": False,
                      "endpoint": "192.0.2.1:51820", "handshake_age_s": 4.2, "rx_bytes": 2_500_000,
                      "tx_bytes": 1200, "rtt_s": 0.0211, "rate_bps": 95.1e6},
                     {"name": "b", "address": "10.77.0.3", "route": "via h", "relayed": True,
                      "endpoint": "192.0.2.1:51820", "handshake_age_s": 4.2, "rx_bytes": 2_500_000,
                      "tx_bytes": 1200, "measure_error": "timed out"}]}]
    text = format_status(st)
    assert "4 s ago" in text and "2.5 MB" in text and "21.10 ms" in text and "95.1 Mbit/s" in text
    assert "via h" in text and "(hub's)" in text and "unreachable" in text and "restarts 1" in text


# ---------------------------------------------------------------- down: only our own processes


def test_down_signals_only_a_supervisor_and_wireguard_go_of_its_own(tmp_path, monkeypatch):
    """A stale state file names PIDs the system may have given to other
    processes: `down` leaves those alone and stops only what is ours."""
    import subprocess
    import sys

    from lorasync.hostops import pid_alive

    monkeypatch.setattr(supervisor, "TUNNELS_DIR", tmp_path)
    monkeypatch.setattr(tunnel, "leftovers", lambda ifname, netns: [])
    sleep = "import time; time.sleep(60)"
    procs = {
        # unrelated processes that took the PIDs over, one naming wireguard-go in its args
        "other": subprocess.Popen([sys.executable, "-c", sleep]),
        "other_wg": subprocess.Popen([sys.executable, "-c", sleep, "wireguard-go", "lsx0"]),
        "wg_other_if": subprocess.Popen(["wireguard-go", "-c", sleep, "lsy0"],
                                        executable=sys.executable),
        # ours: the supervisor `up` starts and its wireguard-go
        "sup": subprocess.Popen([sys.executable, "-c", sleep, "-m", "lorasync.overlay.tunnel",
                                 "supervise", "cfg.json"]),
        "wg": subprocess.Popen(["wireguard-go", "-c", sleep, "-f", "lsx0"],
                               executable=sys.executable),
    }
    try:
        stale = {"ifname": "lsx0", "pid": procs["other"].pid, "wg_pid": procs["other_wg"].pid}
        (tmp_path / "lsx0.json").write_text(json.dumps(stale))
        assert tunnel.down("lsx0") == [f"state {tmp_path / 'lsx0.json'}"]
        assert tunnel.down_one({"ifname": "lsx0", "pid": None,
                                "wg_pid": procs["wg_other_if"].pid}) == []
        assert all(pid_alive(p.pid) for p in procs.values())
        ours = {"ifname": "lsx0", "pid": procs["sup"].pid, "wg_pid": procs["wg"].pid}
        assert tunnel.down_one(ours) == [f"supervisor {procs['sup'].pid}",
                                         f"wireguard-go {procs['wg'].pid}"]
        for name in ("sup", "wg"):
            assert procs[name].wait(10) is not None
        assert all(pid_alive(procs[n].pid) for n in ("other", "other_wg", "wg_other_if"))
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


# ---------------------------------------------------------------- the supervisor both transports share


def test_base_supervisor_restarts_after_the_transports_delay(tmp_path, monkeypatch):
    """The loop both supervisors run: an exited daemon is logged once, started
    again after the delay the transport names (a failed start: when it says),
    and stop() takes down the state file with what the transport releases."""
    import subprocess
    import sys

    monkeypatch.setattr(supervisor, "TUNNELS_DIR", tmp_path)

    class Fake(supervisor.BaseSupervisor):
        def __init__(self):
            super().__init__("lsx9", interval=0.01)
            self.calls = []

        def _start(self):
            self.proc = subprocess.Popen([sys.executable, "-c", "pass"])

        def state(self):
            return {"ifname": self.name, "restarts": self.restarts}

        def up_message(self):
            return "up"

        def _exited(self, now):
            self.calls.append("exited")
            self.event("daemon exited")
            return 0.02

        def _restart(self, now):
            self.calls.append("restart")
            if self.calls.count("restart") == 1:
                return now + 0.02   # the first try fails: again in 0.02 s, not logged as an exit
            self._start()
            self.restarts += 1
            self._save_state()
            if self.restarts == 2:
                self.request_stop()
            return None

        def _release(self):
            self.calls.append("release")

    s = Fake()
    s.start()
    assert json.loads((tmp_path / "lsx9.json").read_text()) == {"ifname": "lsx9", "restarts": 0}
    s.run()
    assert s.calls == ["exited", "restart", "restart", "exited", "restart"]
    assert json.loads((tmp_path / "lsx9.json").read_text())["restarts"] == 2
    s.stop()
    assert s.calls[-1] == "release" and not (tmp_path / "lsx9.json").exists()
    log = (tmp_path / "lsx9.log").read_text().splitlines()
    assert [ln.split(" ", 2)[2] for ln in log] == ["up", "daemon exited", "daemon exited"]
    assert [st["ifname"] for st in supervisor.states()] == []
