"""Keys never leave their node: the overlay's plan, join and assemble steps,
what each refuses, and what travels (no private key, ever).

Keys come from tunnel_fakes (no wireguard-tools needed); the tests marked
``needs wg`` run the same flow with real keys through the CLI.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from lorasync.errors import ConfigError
from lorasync.overlay import enroll, tunnel, wireguard as wg
from lorasync.overlay.enroll import parse_node_spec, plan_overlay
from tunnel_fakes import enrolled, fake_wg, public_of

needs_wg = pytest.mark.skipif(not shutil.which("wg"), reason="needs wireguard-tools "
                              "(apt-get install -y wireguard-tools)")


def nodes(*specs):
    return [parse_node_spec(s) for s in specs]


def configs(paths):
    return {p.name.split(".")[0]: json.loads(p.read_text()) for p in paths}


def _files(root: Path):
    return [p for p in root.rglob("*") if p.is_file()]


# ---------------------------------------------------------------- the plan

def test_plan_hub_first_direct_pairs_keepalive(tmp_path):
    c = configs(enrolled(tmp_path / "ov", ["n1", "hub=198.51.100.1", "n3=198.51.100.3:4000"], "hub"))
    # the hub gets the first address, the others follow in the order given
    assert [c[n]["address"] for n in ("hub", "n1", "n3")] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
    assert c["hub"]["is_hub"] and not c["n1"]["is_hub"] and c["n3"]["listen_port"] == 4000
    # one NAT'd node: every pair has an endpoint on one side, so everything is direct, no relay
    assert all(r == "direct" for cfg in c.values() for r in cfg["routes"].values())
    assert not any(cfg["relay"] for cfg in c.values())
    n1 = {p["name"]: p for p in c["n1"]["peers"]}
    assert set(n1) == {"hub", "n3"}
    assert n1["hub"]["endpoint"] == "198.51.100.1:51820" and n1["hub"]["keepalive_s"] == 25
    assert n1["hub"]["allowed_ips"] == ["10.77.0.1/32"]
    hub = {p["name"]: p for p in c["hub"]["peers"]}
    # the hub cannot reach n1 (behind NAT): no endpoint, no keepalive, it waits for n1
    assert hub["n1"]["endpoint"] is None and hub["n1"]["keepalive_s"] is None
    assert hub["n3"]["endpoint"] == "198.51.100.3:4000"
    # every node's peers carry the public key that node's own join made
    assert n1["hub"]["public_key"] == c["hub"]["public_key"] != c["n1"]["public_key"]
    assert len({cfg["public_key"] for cfg in c.values()}) == 3
    assert len({cfg["plan_id"] for cfg in c.values()}) == 1


def test_plan_nodes_behind_nat_relay_through_the_hub(tmp_path):
    c = configs(enrolled(tmp_path / "ov", ["h=192.0.2.1", "a", "b"], "h"))
    assert c["a"]["routes"] == {"h": "direct", "b": "via h"}
    assert c["h"]["routes"] == {"a": "direct", "b": "direct"}
    (hub_peer,) = c["a"]["peers"]  # a cannot reach b: only the hub is its peer
    assert hub_peer["name"] == "h" and hub_peer["relays"] == ["b"]
    assert hub_peer["allowed_ips"] == ["10.77.0.1/32", f"{c['b']['address']}/32"]
    assert c["h"]["relay"] and not c["a"]["relay"]
    assert [p["allowed_ips"] for p in c["h"]["peers"]] == [["10.77.0.2/32"], ["10.77.0.3/32"]]


@pytest.mark.parametrize("specs,hub,kw,field,hint", [
    (("h=192.0.2.1", "a"), "x", {}, "hub", "name one of the nodes"),
    (("h", "a"), "h", {}, "hub", "give its endpoint"),
    (("h=192.0.2.1", "h"), "h", {}, "node", "a name of its own"),
    (("h=192.0.2.1", "a"), "h", {"subnet": "8.8.8.0/24"}, "subnet", "private"),
    (("h=192.0.2.1", "a"), "h", {"subnet": "nonsense"}, "subnet", "IPv4"),
    (("h=10.77.0.9", "a"), "h", {}, "subnet", "endpoint"),
    (("h=192.0.2.1", "a", "b"), "h", {"subnet": "10.9.9.0/31"}, "subnet", "room for"),
    (("h=192.0.2.1", "a"), "h", {"mtu": 100}, "mtu", "between"),
    (("h=192.0.2.1", "a"), "h", {"keepalive_s": 0}, "keepalive", "seconds"),
])
def test_plan_errors_name_the_field_and_fix(specs, hub, kw, field, hint):
    with pytest.raises(ConfigError) as e:
        plan_overlay(nodes(*specs), hub, **kw)
    assert e.value.field == field and hint in e.value.fix


def test_plan_id_covers_the_content_and_each_init():
    a = plan_overlay(nodes("h=192.0.2.1", "a"), "h", nonce="n")
    assert a["plan_id"] == plan_overlay(nodes("h=192.0.2.1", "a"), "h", nonce="n")["plan_id"]
    assert a["plan_id"] != plan_overlay(nodes("h=192.0.2.1", "a"), "h")["plan_id"]  # a new init
    assert a["plan_id"] != plan_overlay(nodes("h=192.0.2.2", "a"), "h", nonce="n")["plan_id"]
    assert "public_key" not in json.dumps(a) and "private" not in json.dumps(a)


def test_init_writes_the_plan_and_one_file_per_node_and_no_key(tmp_path):
    out = tmp_path / "ov"
    paths = enroll.init_overlay(out, nodes("h=192.0.2.1", "a"), "h")
    assert [p.name for p in paths] == ["h.plan.json", "a.plan.json"]
    assert sorted(p.name for p in out.iterdir()) == ["a.plan.json", "h.plan.json", "plan.json"]
    plan = enroll.read_plan(out / "plan.json")
    for p in paths:
        mine = enroll.read_plan(p)
        assert mine["plan_id"] == plan["plan_id"] and mine["node"] == p.name.split(".")[0]
    with pytest.raises(ConfigError, match="already holds"):
        enroll.init_overlay(out, nodes("h=192.0.2.1", "a"), "h")
    # nothing is written when the plan is refused
    with pytest.raises(ConfigError):
        enroll.init_overlay(tmp_path / "bad", nodes("h", "a"), "h")
    assert not (tmp_path / "bad").exists()


def test_init_force_replaces_the_plan_and_keeps_key_directories(tmp_path):
    out = tmp_path / "ov"
    keygen, pub_of = fake_wg()
    old = enroll.init_overlay(out, nodes("h=192.0.2.1", "a"), "h")
    enroll.join_overlay(old[0], keygen=keygen, public_key_of=pub_of)  # the planner is node h
    key = (out / "h" / "private.key").read_text()
    new = enroll.init_overlay(out, nodes("h=192.0.2.1", "a", "b"), "h", force=True)
    assert not (out / "h.pub.json").exists()  # the old plan's: assemble would refuse it
    assert (out / "h" / "private.key").read_text() == key
    # joining the new plan keeps the node's key (its identity), bound to the new plan
    pub = json.loads(enroll.join_overlay(new[0], keygen=keygen, public_key_of=pub_of).read_text())
    assert pub["public_key"] == public_of(key.strip())
    assert pub["plan_id"] == enroll.read_plan(out / "plan.json")["plan_id"]


# ---------------------------------------------------------------- join, on each node

def test_join_makes_the_key_on_the_node_0600_and_a_public_file(tmp_path):
    out = tmp_path / "planner"
    plans = enroll.init_overlay(out, nodes("h=192.0.2.1", "a"), "h")
    node = tmp_path / "node-a"
    node.mkdir()
    carried = Path(shutil.copy(plans[1], node))  # what the user carries there
    keygen, pub_of = fake_wg()
    pub = enroll.join_overlay(carried, keygen=keygen, public_key_of=pub_of)
    assert pub == node / "a.pub.json"
    key = node / "a" / "private.key"
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(key.parent).st_mode) == 0o700
    raw = json.loads(pub.read_text())
    assert raw == {"kind": "lorasync-overlay-public-key", "version": 2,
                   "plan_id": enroll.read_plan(out / "plan.json")["plan_id"], "node": "a",
                   "public_key": public_of(key.read_text().strip()),
                   "private_key_file": str(key.resolve())}
    assert key.read_text().strip() not in pub.read_text()
    # joining again keeps the key: the same public file
    again = enroll.join_overlay(carried, keygen=keygen, public_key_of=pub_of)
    assert json.loads(again.read_text()) == raw
    # --dir: the key where the node wants it
    other = enroll.join_overlay(carried, tmp_path / "keys", keygen=keygen, public_key_of=pub_of)
    assert json.loads(other.read_text())["private_key_file"] == str(tmp_path / "keys" / "private.key")


def test_join_refusals(tmp_path):
    out = tmp_path / "ov"
    plans = enroll.init_overlay(out, nodes("h=192.0.2.1", "a"), "h")
    keygen, pub_of = fake_wg()

    def refused(path, **kw):
        with pytest.raises(ConfigError) as e:
            enroll.join_overlay(path, keygen=keygen, public_key_of=pub_of, **kw)
        return str(e.value)

    assert "NODE.plan.json" in refused(out / "plan.json")  # the whole plan is no node's
    assert "no such file" in refused(out / "x.plan.json")
    edited = json.loads(plans[1].read_text())
    edited["nodes"][1]["address"] = "10.77.0.9"
    (tmp_path / "e.json").write_text(json.dumps(edited))
    assert "does not match its plan id" in refused(tmp_path / "e.json")
    stranger = dict(json.loads(plans[1].read_text()), node="zed")
    (tmp_path / "z.json").write_text(json.dumps(stranger))
    assert "'zed', which is not in its plan (h, a)" in refused(tmp_path / "z.json")
    (tmp_path / "v1.json").write_text(json.dumps(dict(edited, version=1)))
    assert "another lorasync version" in refused(tmp_path / "v1.json")
    (tmp_path / "pub.json").write_text(json.dumps({"kind": "lorasync-overlay-public-key"}))
    assert "not the plan" in refused(tmp_path / "pub.json")
    # a key left readable by others is not taken over
    enroll.join_overlay(plans[1], keygen=keygen, public_key_of=pub_of)
    os.chmod(out / "a" / "private.key", 0o640)
    msg = refused(plans[1])
    assert "chmod 600" in msg and (out / "a" / "private.key").read_text().strip() not in msg
    assert "\n" not in msg


# ---------------------------------------------------------------- assemble

def _joined(tmp_path, specs=("h=192.0.2.1", "a", "b"), hub="h"):
    out = tmp_path / "ov"
    keygen, pub_of = fake_wg()
    plans = enroll.init_overlay(out, nodes(*specs), hub)
    return out, [enroll.join_overlay(p, keygen=keygen, public_key_of=pub_of) for p in plans]


def test_assemble_writes_configs_with_public_keys_only(tmp_path):
    out, pubs = _joined(tmp_path)
    paths = enroll.assemble_overlay(out)
    assert [p.name for p in paths] == ["h.tunnel.json", "a.tunnel.json", "b.tunnel.json"]
    for p, pub in zip(paths, pubs):
        cfg = tunnel.load_config(p)
        raw = json.loads(pub.read_text())
        assert cfg.public_key == raw["public_key"] and str(cfg.private_key_file) == raw["private_key_file"]
        assert cfg.plan_id == raw["plan_id"]
        tunnel.check_key_matches(cfg, fake_wg()[1])
    # explicit files do the same; assemble again overwrites
    assert enroll.assemble_overlay(out, pubs) == paths


def test_private_keys_appear_in_no_file_but_their_own(tmp_path):
    """The whole flow with a directory per machine, files carried as the user
    would: every private key is in its node's 0600 key file and nowhere else."""
    planner, keygen, pub_of = tmp_path / "planner", *fake_wg()
    machines = {n: tmp_path / f"machine-{n}" for n in ("h", "a", "b")}
    for m in machines.values():
        m.mkdir()
    plans = enroll.init_overlay(planner / "ov", nodes("h=192.0.2.1", "a", "b"), "h")
    for p in plans:
        node = p.name.split(".")[0]
        carried = Path(shutil.copy(p, machines[node]))            # planner -> node
        pub = enroll.join_overlay(carried, keygen=keygen, public_key_of=pub_of)
        shutil.copy(pub, planner / "ov")                          # node -> planner
    for cfg in enroll.assemble_overlay(planner / "ov"):
        shutil.copy(cfg, machines[cfg.name.split(".")[0]])        # planner -> node
    keys = {n: m / n / "private.key" for n, m in machines.items()}
    assert not list(planner.rglob("private.key"))
    for node, key in keys.items():
        secret = key.read_text().strip()
        holders = [f for f in _files(tmp_path) if secret in f.read_text()]
        assert holders == [key], node
        assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    for node, m in machines.items():  # and each node's own config points at its own key
        cfg = tunnel.load_config(m / f"{node}.tunnel.json")
        assert cfg.private_key_file == keys[node].resolve()
        tunnel.check_key_matches(cfg, pub_of)


def _edit(path: Path, **changes) -> Path:
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))
    return path


def _refused(out, files=None) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        enroll.assemble_overlay(out, files)
    assert "\n" not in str(e.value)
    return e.value


def test_assemble_refuses_a_file_of_another_plan(tmp_path):
    out, pubs = _joined(tmp_path)
    other, other_pubs = _joined(tmp_path / "other")
    e = _refused(out, [pubs[0], other_pubs[1], pubs[2]])
    assert e.value == str(other_pubs[1]) and "made for plan" in e.fix and "tunnel join" in e.fix


def test_assemble_refuses_a_node_not_in_the_plan_and_a_missing_node(tmp_path):
    out, pubs = _joined(tmp_path)
    _edit(pubs[2], node="zed")
    e = _refused(out)
    assert "'zed'" in e.fix and "not in the plan (h, a, b)" in e.fix
    pubs[2].unlink()
    e = _refused(out)
    assert e.field == "public keys" and e.value == "b" and "tunnel join NODE.plan.json" in e.fix


def test_assemble_refuses_two_keys_for_a_node_and_one_key_for_two(tmp_path):
    out, pubs = _joined(tmp_path)
    twin = out / "a-again.pub.json"
    shutil.copy(pubs[1], twin)
    assert enroll.assemble_overlay(out)  # the same key twice is one key
    _edit(twin, public_key=json.loads(pubs[2].read_text())["public_key"])
    e = _refused(out)
    assert "a second, different key for a" in e.fix
    twin.unlink()
    _edit(pubs[1], public_key=json.loads(pubs[2].read_text())["public_key"])
    e = _refused(out)
    assert "same key as" in e.fix and "copied between nodes" in e.fix


@pytest.mark.parametrize("change,hint", [
    ({"public_key": "not-a-key"}, "not a WireGuard key"),
    ({"private_key_file": "private.key"}, "absolute path"),
    ({"kind": "something"}, "not the NODE.pub.json"),
    ({"version": 1}, "another lorasync version"),
])
def test_assemble_refuses_a_broken_public_file(tmp_path, change, hint):
    out, pubs = _joined(tmp_path)
    _edit(pubs[1], **change)
    e = _refused(out)
    assert e.field == "public-key file" and e.value == str(pubs[1]) and hint in e.fix


def test_assemble_needs_the_plan(tmp_path):
    e = _refused(tmp_path)
    assert e.field == "--out" and "tunnel init --out" in e.fix


# ---------------------------------------------------------------- what `up` refuses

def test_up_refuses_a_config_whose_key_is_not_the_nodes(tmp_path):
    paths = enrolled(tmp_path / "ov", ["h=192.0.2.1", "a"], "h")
    h, a = (tunnel.load_config(p) for p in paths)
    _, pub_of = fake_wg()
    # a's config on h's machine (the key file there is h's): refused, naming the file and the fix
    wrong = tunnel.load_config(_edit(Path(shutil.copy(paths[1], tmp_path / "x.json")),
                                     private_key_file=str(h.private_key_file)))
    with pytest.raises(ConfigError) as e:
        tunnel.check_key_matches(wrong, pub_of)
    assert e.value.field == "private_key_file" and e.value.value == str(h.private_key_file)
    assert "not the one a's config" in e.value.fix and "tunnel join" in e.value.fix
    assert h.private_key_file.read_text().strip() not in str(e.value)


def test_up_refuses_a_missing_or_open_key(tmp_path):
    cfg = tunnel.load_config(enrolled(tmp_path / "ov", ["h=192.0.2.1", "a"], "h")[1])
    os.chmod(cfg.private_key_file, 0o644)
    with pytest.raises(ConfigError, match=f"chmod 600 {cfg.private_key_file}"):
        wg.check_key_file(cfg.private_key_file)
    cfg.private_key_file.unlink()
    with pytest.raises(ConfigError) as e:
        wg.check_key_file(cfg.private_key_file)
    assert e.value.field == "private_key_file" and "tunnel join NODE.plan.json" in e.value.fix


def test_load_config_refuses_a_node_not_in_its_plan_and_old_configs(tmp_path):
    paths = enrolled(tmp_path / "ov", ["h=192.0.2.1", "a"], "h")
    _edit(paths[1], node="zed")
    with pytest.raises(ConfigError) as e:
        tunnel.load_config(paths[1])
    assert e.value.field == "node" and "name one of the nodes (h, a)" in e.value.fix
    _edit(paths[1], node="a", public_key=json.loads(paths[0].read_text())["public_key"])
    with pytest.raises(ConfigError) as e:
        tunnel.load_config(paths[1])
    assert e.value.field == "public_key" and "assemble" in e.value.fix
    _edit(paths[0], version=1)
    with pytest.raises(ConfigError, match="generated every node's private key on one machine"):
        tunnel.load_config(paths[0])


# ---------------------------------------------------------------- the command line

def test_cli_refusals_are_one_line_exit_2(tmp_path, capsys):
    from lorasync import cli

    out, pubs = _joined(tmp_path)
    pubs[2].unlink()
    assert cli.main(["tunnel", "assemble", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "public keys" in err and "'b'" in err
    assert cli.main(["tunnel", "join", str(out / "plan.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "NODE.plan.json" in err


@needs_wg
def test_cli_flow_with_real_keys(tmp_path, capsys):
    """init, join on each 'machine', assemble: real wg keys, none printed or carried."""
    from lorasync import cli

    out = tmp_path / "ov"
    assert cli.main(["tunnel", "init", "--out", str(out), "--hub", "h=192.0.2.1",
                     "--node", "a", "--node", "b"]) == 0
    printed = capsys.readouterr().out
    assert "via h" in printed and "(behind NAT)" in printed and "tunnel join NODE.plan.json" in printed
    for n in ("h", "a", "b"):
        m = tmp_path / f"machine-{n}"
        m.mkdir()
        carried = shutil.copy(out / f"{n}.plan.json", m)
        assert cli.main(["tunnel", "join", carried]) == 0
        shutil.copy(m / f"{n}.pub.json", out)
    assert cli.main(["tunnel", "assemble", "--out", str(out)]) == 0
    printed += capsys.readouterr().out
    for n in ("h", "a", "b"):
        key = tmp_path / f"machine-{n}" / n / "private.key"
        secret = key.read_text().strip()
        assert len(secret) == 44 and secret not in printed
        assert [f for f in _files(tmp_path) if secret in f.read_text()] == [key]
        cfg = tunnel.load_config(out / f"{n}.tunnel.json")
        tunnel.check_key_matches(cfg)  # real `wg pubkey` of the key on its node
    a = tunnel.load_config(out / "a.tunnel.json")
    a.private_key_file = tmp_path / "machine-b" / "b" / "private.key"  # b's key under a's config
    with pytest.raises(ConfigError, match="not the one a's config"):
        tunnel.check_key_matches(a)


@needs_wg
def test_public_key_of_refuses_a_file_that_is_no_key(tmp_path):
    bad = tmp_path / "private.key"
    wg.write_private_key(bad, "not a key")
    with pytest.raises(ConfigError) as e:
        wg.public_key_of(bad)
    assert e.value.field == "private_key_file" and "not a key" not in str(e.value)
