"""``lorasync tunnel init/join/assemble/up`` on "real hosts" with UDP blocked: the SSH path.

Two network namespaces of an emulated cluster (``block_udp=node1``, no
overlay of the cluster's own) stand for two hosts: node0 is the overlay's
hub, node1 can send only TCP.  Each "host" keeps its tunnel state in a
directory of its own (``LORASYNC_TUNNEL_DIR``), as separate machines would.
Everything a user runs is the real command line, run inside the host's
namespace: ``tunnel init --ssh`` and ``probe-server`` on the hub, ``join``
(auto) on each, ``assemble``, ``up``, ``status``, ``down``.

Needs root, iproute2, nftables and Debian's openssh-server (installed by
.ci/run where root is available); skipped with the reason otherwise.  The
cluster is removed in ``finally``; the test checks that nothing of the
overlay is left: sshd, ssh, supervisors, tun devices, state.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import cli_env
from lorasync.emulate.cluster import Cluster, down
from lorasync.emulate.spec import parse_emulate


pytestmark = pytest.mark.netns("nft", "ssh", "ssh-keygen", "sshd", tun=True)

TAG = f"t{os.getpid() % 100000}"
NAME = f"{TAG}ssh"
IFNAME = f"lt{TAG}"
#: not /tmp: sshd (StrictModes) refuses an authorized_keys file under a world-writable directory
STATE = f"/run/lorasync/{TAG}-hosts"

_ALLREDUCE = textwrap.dedent("""
    import sys, datetime, torch, torch.distributed as dist
    rank, master = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"tcp://{master}:29511", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    t = torch.full((1 << 18,), float(rank + 1))
    dist.all_reduce(t)
    print("sum", float(t[0]), flush=True)
    dist.destroy_process_group()
""")


def _cluster(nodes: int):
    c = Cluster.up(parse_emulate(f"nodes={nodes},block_udp=node1,name={NAME}"))
    try:
        yield c
    finally:
        for i in range(nodes):
            _lorasync(c, i, "tunnel", "down", "--ifname", IFNAME, check=False)
        c.down()
        down(NAME)
        shutil.rmtree(STATE, ignore_errors=True)


_ECHO_SERVER = textwrap.dedent("""
    import socket, sys
    s = socket.socket(); s.bind((sys.argv[1], 29601)); s.listen(1)
    print("listening", flush=True)
    c, _ = s.accept()
    while data := c.recv(4096):
        c.sendall(data)
""")
_ECHO_CLIENT = textwrap.dedent("""
    import socket, sys
    c = socket.create_connection((sys.argv[1], 29601), timeout=5); c.settimeout(60)
    f = c.makefile("r")
    for line in sys.stdin:
        c.sendall(line.encode()); print(f.readline().strip(), flush=True)
""")


@pytest.fixture
def hosts():
    yield from _cluster(2)


@pytest.fixture
def hosts_and_jump():
    yield from _cluster(3)


def _env(i: int) -> dict:
    return cli_env(LORASYNC_TUNNEL_DIR=f"{STATE}/node{i}")


def _lorasync(c: Cluster, i: int, *args, check: bool = True, timeout: float = 60):
    p = subprocess.run(c.exec_argv(i, [sys.executable, "-m", "lorasync", *map(str, args)]),
                       env=_env(i), capture_output=True, text=True, timeout=timeout)
    if check:
        assert p.returncode == 0, f"{args}: {p.stdout}{p.stderr}"
    return p


def _wait_log(open_log: str, text: str, after: int = 0, seconds: float = 60) -> None:
    """Until ``text`` occurs more than ``after`` times in the log."""
    import time

    deadline = time.monotonic() + seconds
    while open(open_log).read().count(text) <= after:
        assert time.monotonic() < deadline, f"{text!r} not in {open_log}: {open(open_log).read()[-1500:]}"
        time.sleep(0.3)


def _ours_left(c: Cluster) -> list[str]:
    """Processes, devices and state files of this overlay still there."""
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if f"{STATE}/jump/".encode() in cmd:   # the test's own jump host, not the overlay's
            continue
        if STATE.encode() in cmd or IFNAME.encode() in cmd:   # e.g. wireguard-go -f IFNAME
            left.append(f"process {pid}: {cmd.replace(bytes(1), b' ').decode()[:120]}")
    for i in range(len(c.nodes)):
        links = subprocess.run(c.exec_argv(i, ["ip", "-o", "link"]), capture_output=True,
                               text=True).stdout
        left += [f"node{i}: {ln.split(':')[1].strip()}" for ln in links.splitlines()
                 if "tun10" in ln or IFNAME in ln]
        d = f"{STATE}/node{i}"
        if os.path.isdir(d):
            left += [f"node{i}: {f}" for f in os.listdir(d) if not f.endswith(".log")]
    return left


def test_join_picks_ssh_where_udp_is_blocked_and_trains_over_it(hosts, tmp_path):
    c = hosts
    hub, node = c.nodes[0], c.nodes[1]
    out = tmp_path / "overlay"
    # the hub plans the overlay and offers the SSH path on its one address (default port 443)
    p = _lorasync(c, 0, "tunnel", "init", "--out", out, "--hub", f"h={hub.outside}", "--node",
                  "n1", "--ifname", IFNAME, "--subnet", "10.79.0.0/24", "--ssh")
    assert f"sshd on {hub.outside}:443" in p.stdout
    plan = json.loads((out / "n1.plan.json").read_text())
    assert plan["ssh"] == {"host": hub.outside, "listen": hub.outside, "port": 443, "user": "root"}

    # while the nodes join, the hub answers their probes
    srv = subprocess.Popen(c.exec_argv(0, [sys.executable, "-m", "lorasync", "tunnel",
                                           "probe-server", "--out", str(out), "--seconds", "60"]),
                           env=_env(0), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "answering probes" in srv.stdout.readline()
        _lorasync(c, 0, "tunnel", "join", out / "h.plan.json")
        p = _lorasync(c, 1, "tunnel", "join", out / "n1.plan.json")
        assert "transport: SSH over TCP" in p.stdout and "got no answer" in p.stdout, p.stdout
        pub = json.loads((out / "n1.pub.json").read_text())
        assert pub["transport"] == "ssh" and pub["ssh_public_key"].startswith("ssh-ed25519 ")
        assert "BEGIN OPENSSH PRIVATE KEY" not in (out / "n1.pub.json").read_text()
        _lorasync(c, 0, "tunnel", "assemble", "--out", out)
        # the probe server still holds the SSH port: `up` says so in one line, exit 2
        p = _lorasync(c, 0, "tunnel", "up", "--config", out / "h.tunnel.json", check=False)
        assert p.returncode == 2 and "TCP port 443" in p.stderr and "in use" in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert _ours_left(c) == []
    finally:
        srv.kill()
        srv.wait()

    # the node before the hub: one line naming the hub's sshd, exit 2, nothing left behind
    p = _lorasync(c, 1, "tunnel", "up", "--config", out / "n1.tunnel.json", "--hub-timeout", "3",
                  check=False)
    assert p.returncode == 2 and f"{hub.outside}:443" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert _ours_left(c) == []

    _lorasync(c, 0, "tunnel", "up", "--config", out / "h.tunnel.json")
    p = _lorasync(c, 1, "tunnel", "up", "--config", out / "n1.tunnel.json")
    assert "on tun101" in p.stdout and "SSH to" in p.stdout, p.stdout

    # the hub's overlay address answers through the tunnel (its link-test port; no ping here)
    code = "import socket; socket.create_connection(('10.79.0.1', 51820), timeout=5).close()"
    conn = subprocess.run(c.exec_argv(1, [sys.executable, "-c", code]), capture_output=True, text=True)
    assert conn.returncode == 0, conn.stderr
    # gloo's all-reduce over the overlay: the hub's address on its stand-in interface, the
    # node's on its tun device
    ranks = [subprocess.Popen(c.exec_argv(i, [sys.executable, "-c", _ALLREDUCE, str(i), "10.79.0.1"]),
                              env=dict(_env(i), GLOO_SOCKET_IFNAME=dev), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for i, dev in ((0, IFNAME), (1, "tun101"))]
    outs = [r.communicate(timeout=90) for r in ranks]
    assert all(r.returncode == 0 for r in ranks), outs
    assert all("sum 3.0" in o for o, _ in outs), outs

    # what a user runs on each host: `tunnel launch` (torchrun) over the SSH path, the
    # rendezvous on the hub's overlay address, gloo on each node's overlay device
    out_probe = tmp_path / "probe.json"
    procs = [subprocess.Popen(c.exec_argv(i, [
        sys.executable, "-m", "lorasync", "tunnel", "launch", "--ifname", IFNAME, "--port", "29412",
        "--run-id", f"s{TAG}", "--rdzv-wait", "60", "--", "probe", "--quick", "--no-pairs",
        "--output", str(out_probe)]), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(_env(i), OMP_NUM_THREADS="1")) for i in (0, 1)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[-1500:] for o in outs]
    probe = json.loads(out_probe.read_text())
    assert probe["world_size"] == 2
    assert sorted(r["ifname"] for r in probe["ranks"]) == sorted([IFNAME, "tun101"])
    assert "rendezvous 10.79.0.1:29412 (here)" in outs[0], outs[0][-1500:]

    # ssh killed: the supervisor starts it again, and a TCP connection through the overlay
    # carries on (the tun devices stay: a drop loses packets, not connections)
    echo = subprocess.Popen(c.exec_argv(1, [sys.executable, "-c", _ECHO_SERVER, "10.79.0.2"]),
                            stdout=subprocess.PIPE, text=True)
    client = None
    try:
        assert echo.stdout.readline().strip() == "listening"
        # the client only once the server listens (started together, it could connect first)
        client = subprocess.Popen(c.exec_argv(0, [sys.executable, "-c", _ECHO_CLIENT, "10.79.0.2"]),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        client.stdin.write("before\n")
        client.stdin.flush()
        assert client.stdout.readline().strip() == "before"
        state = json.loads(open(f"{STATE}/node1/{IFNAME}.json").read())
        os.kill(state["ssh_pid"], 9)
        client.stdin.write("after\n")
        client.stdin.flush()
        assert client.stdout.readline().strip() == "after"
        state = json.loads(open(f"{STATE}/node1/{IFNAME}.json").read())
        assert state["restarts"] >= 1
        assert "ssh exited (code -9)" in open(f"{STATE}/node1/{IFNAME}.log").read()
    finally:
        for proc in (client, echo):
            if proc is not None:
                proc.kill()
                proc.wait()

    # the hub's sshd killed: its supervisor starts it again; the open session (sshd's own
    # child) carries on, and the node's next ssh logs in to the new sshd
    hub = [json.loads(open(f"{STATE}/node0/{f}").read()) for f in os.listdir(f"{STATE}/node0")
           if f.endswith(".json") and not f.startswith(".")]
    hub = next(h for h in hub if h.get("is_hub") and h.get("ssh_pid"))
    os.kill(hub["ssh_pid"], 9)
    _wait_log(open_log=hub["log"], text="sshd started again")
    state = json.loads(open(f"{STATE}/node1/{IFNAME}.json").read())
    os.kill(state["ssh_pid"], 9)
    _wait_log(open_log=f"{STATE}/node1/{IFNAME}.log", text="ssh started again (pid",
              after=state["restarts"])
    conn = subprocess.run(c.exec_argv(1, [sys.executable, "-c", code.replace("timeout=5",
                                                                               "timeout=30")]),
                          capture_output=True, text=True)
    assert conn.returncode == 0, conn.stderr

    st = _lorasync(c, 1, "tunnel", "status", "--ifname", IFNAME, "--seconds", "0.3")
    assert "transport: SSH over TCP: UDP to the hub" in st.stdout and "got no answer" in st.stdout
    st = json.loads(_lorasync(c, 1, "tunnel", "status", "--json", "--no-measure").stdout)
    assert [t["transport"] for t in st] == ["ssh"] and "UDP" in st[0]["reason"]
    st = _lorasync(c, 0, "tunnel", "status", "--no-measure")
    assert "serves n1 over SSH" in st.stdout, st.stdout
    assert "n1 joins over ssh: UDP to the hub" in st.stdout, st.stdout

    for i in (1, 0):
        p = _lorasync(c, i, "tunnel", "down")
        assert "removed" in p.stdout
    assert _ours_left(c) == []
    nft = subprocess.run(c.exec_argv(0, ["nft", "list", "tables"]), capture_output=True, text=True)
    assert IFNAME not in nft.stdout


_JUMP_SSHD = """ListenAddress {addr}:2200
HostKey {d}/jump_host.key
PidFile {d}/sshd.pid
AuthorizedKeysFile {d}/authorized_keys
AllowUsers root
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
AllowTcpForwarding yes
PermitOpen {hub}:443
PermitTTY no
X11Forwarding no
LogLevel VERBOSE
"""


def test_ssh_jump_and_a_hub_serving_both_transports(hosts_and_jump, tmp_path):
    """node1 has neither UDP nor a TCP path of its own to the hub's sshd: only
    node2, a jump host running its own sshd, reaches it.  `join --ssh-jump`
    takes the SSH path without probing; ssh's jump leg is the user's ordinary
    ssh (root's ~/.ssh, in a private mount namespace here).  node2 also joins
    the overlay, over UDP: the hub runs WireGuard and sshd and relays between
    its SSH node and its WireGuard node."""
    c = hosts_and_jump
    hub, jump = c.nodes[0], c.nodes[2]
    subprocess.run(c.exec_argv(1, ["nft", "-f", "-"]), check=True, text=True, input=(
        f"table inet {IFNAME}j {{\n  chain out {{\n    type filter hook output priority 0; "
        f"policy accept;\n    ip daddr {hub.outside} tcp dport 443 drop\n  }}\n}}\n"))
    # the jump host's sshd: root's key of node1 may forward to the hub's sshd, nothing else
    d = f"{STATE}/jump"
    home = tmp_path / "root-home"
    os.makedirs(d, mode=0o700)
    (home / ".ssh").mkdir(parents=True, mode=0o700)
    for key in (f"{d}/jump_host.key", str(home / ".ssh" / "id_ed25519")):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], check=True)
    pub = (home / ".ssh" / "id_ed25519.pub").read_text().split()
    with open(f"{d}/authorized_keys", "w") as f:
        f.write(f'restrict,port-forwarding,permitopen="{hub.outside}:443" {pub[0]} {pub[1]}\n')
    os.chmod(f"{d}/authorized_keys", 0o600)
    with open(f"{d}/sshd_config", "w") as f:
        f.write(_JUMP_SSHD.format(addr=jump.outside, d=d, hub=hub.outside))
    host_pub = " ".join(open(f"{d}/jump_host.key.pub").read().split()[:2])
    (home / ".ssh" / "known_hosts").write_text(f"[{jump.outside}]:2200 {host_pub}\n")
    (home / ".ssh" / "config").write_text(
        f"Host jump\n  HostName {jump.outside}\n  Port 2200\n  User root\n"
        f"  IdentityFile /root/.ssh/id_ed25519\n  StrictHostKeyChecking yes\n")
    for f in (home / ".ssh").iterdir():
        os.chmod(f, 0o600)
    jsshd = subprocess.Popen(c.exec_argv(2, ["/usr/sbin/sshd", "-D", "-e", "-f", f"{d}/sshd_config"]),
                             stdout=subprocess.DEVNULL, stderr=open(f"{d}/sshd.log", "w"))
    try:
        out = tmp_path / "overlay"
        _lorasync(c, 0, "tunnel", "init", "--out", out, "--hub", f"h={hub.outside}", "--node",
                  "n1", "--node", "n2", "--ifname", IFNAME, "--subnet", "10.79.0.0/24", "--ssh")
        _lorasync(c, 0, "tunnel", "join", out / "h.plan.json")
        p = _lorasync(c, 2, "tunnel", "join", out / "n2.plan.json", "--transport", "udp")
        assert "transport: WireGuard over UDP: --transport udp" in p.stdout, p.stdout
        p = _lorasync(c, 1, "tunnel", "join", out / "n1.plan.json", "--ssh-jump", "jump")
        assert "transport: SSH over TCP: --ssh-jump jump" in p.stdout, p.stdout
        _lorasync(c, 0, "tunnel", "assemble", "--out", out)
        assert json.loads((out / "n1.tunnel.json").read_text())["ssh"]["proxy_jump"] == "jump"
        # the hub in the foreground (as under systemd): WireGuard here, its sshd's
        # supervisor started once WireGuard is up, and stopped with it
        hub_err = tmp_path / "hub-foreground.err"
        fg = subprocess.Popen(c.exec_argv(0, [sys.executable, "-m", "lorasync", "tunnel", "up", "--foreground",
                                              "--config", str(out / "h.tunnel.json")]),
                              env=_env(0), stdout=subprocess.PIPE, stderr=open(hub_err, "w"), text=True)
        assert fg.stdout.readline().strip() == "ready", hub_err.read_text()
        _wait_log(str(hub_err), f"SSH path: sshd on {hub.outside}:443", seconds=10)
        # node1's root home holds its ssh config for the jump host (a private mount here)
        # (whatever else lives in /root, e.g. this Python, stays visible through a bind mount)
        old = tmp_path / "old-root"
        old.mkdir()
        up = (f"mount --bind /root {old} && mount -t tmpfs tmpfs /root && "
              f"for e in {old}/* {old}/.[!.]*; do [ -e \"$e\" ] || continue; "
              f"[ \"$(basename \"$e\")\" = .ssh ] && continue; "
              f"t=/root/$(basename \"$e\"); if [ -d \"$e\" ]; then mkdir \"$t\"; else touch \"$t\"; fi; "
              f"mount --bind \"$e\" \"$t\"; done; "
              f"cp -a {home}/.ssh /root/ && exec {sys.executable} "
              f"-m lorasync tunnel up --config {out}/n1.tunnel.json")
        p = subprocess.run(c.exec_argv(1, ["unshare", "-m", "--propagation", "private", "sh", "-c", up]),
                           env=_env(1), capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stdout + p.stderr
        # node2's wireguard-go control socket in a directory of its own: the hub's has the
        # same name (one overlay interface name, as on separate hosts)
        p = subprocess.run(c.exec_argv(2, [
            "unshare", "-m", "--propagation", "private", "sh", "-c",
            f"mount -t tmpfs tmpfs /run/wireguard && exec {sys.executable} -m lorasync tunnel up "
            f"--config {out}/n2.tunnel.json"]), env=_env(2), capture_output=True, text=True,
            timeout=60)
        assert p.returncode == 0, p.stdout + p.stderr
        code = ("import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), "
                "timeout=5).close()")
        # the hub relays between its SSH node and its WireGuard node, both ways
        for i, to in ((1, "10.79.0.3"), (2, "10.79.0.2")):
            ok = subprocess.run(c.exec_argv(i, [sys.executable, "-c", code, to, "51820"]),
                                capture_output=True, text=True)
            assert ok.returncode == 0, (i, to, ok.stderr)
        st = _lorasync(c, 0, "tunnel", "status", "--no-measure").stdout
        assert "n1 joins over ssh: --ssh-jump jump" in st and "SSH server" in st, st
        # through the jump host: the hub's overlay address answers; directly: the sshd does not
        ok = subprocess.run(c.exec_argv(1, [sys.executable, "-c", code, "10.79.0.1", "51820"]),
                            capture_output=True, text=True)
        assert ok.returncode == 0, ok.stderr
        direct = subprocess.run(c.exec_argv(1, [sys.executable, "-c", code, hub.outside, "443"]),
                                capture_output=True, text=True)
        assert direct.returncode != 0
        log = open(f"{d}/sshd.log").read()
        assert "Accepted publickey for root" in log, log
        for i in (1, 2):
            _lorasync(c, i, "tunnel", "down", "--ifname", IFNAME)
        fg.terminate()   # systemd's stop: WireGuard and the sshd go, and all they made
        assert fg.wait(timeout=30) == 0, hub_err.read_text()[-2000:]
        assert _ours_left(c) == []
        nft = subprocess.run(c.exec_argv(0, ["nft", "list", "tables"]), capture_output=True,
                             text=True)
        assert IFNAME not in nft.stdout
    finally:
        if "fg" in locals() and fg.poll() is None:
            fg.kill()
            fg.wait()
        jsshd.terminate()
        jsshd.wait(timeout=10)
