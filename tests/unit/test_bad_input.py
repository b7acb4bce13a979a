"""Bad input gets one line naming the field, the value and the fix, exit 2,
before any worker starts, and nothing written: every case the issue found,
run through ``lorasync.cli.main`` in this process (tests/unit/_bad_input.py
stands in for torchrun and the tunnel, so nothing is started)."""

from __future__ import annotations

import json
import math

import pytest

from _bad_input import (Guard, Reached, probe_json, refused, run, tunnel_configs,
                        write_json)
from lorasync.config import CommConfig, DataConfig, load_config, parse_endpoint, parse_options
from lorasync.errors import ConfigError, DataError
from lorasync.netdiag import tune
from lorasync.overlay import supervisor, tunnel
from lorasync.plan.linkfit import fit_sweep
from lorasync.plan.net import net_from_probe
from lorasync.train.data import read_jsonl

TINY = ["train", "--model", "tiny", "--no-progress", "--max-steps", "2"]


@pytest.fixture
def guard(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    return Guard(monkeypatch)


def rows(path, n=40):
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "completion": f"c{i}"}) + "\n"
                            for i in range(n)))
    return path


# ---------------------------------------------------------------- train: flags and files

def test_rdzv_endpoint_port_out_of_range(guard, tmp_path, capsys):
    refused(capsys, tmp_path, TINY + ["--rdzv-endpoint", "host:99999", "--output-dir", "r"],
            "run.rdzv_endpoint", "'host:99999'", "between 1 and 65535")


def test_rdzv_endpoint_of_probe_is_checked_before_torchrun(guard, tmp_path, capsys):
    refused(capsys, tmp_path, ["probe", "--nnodes", "2", "--rdzv-endpoint", "host:99999",
                               "--output", "p.json"],
            "--rdzv-endpoint", "'host:99999'", "between 1 and 65535")


@pytest.mark.parametrize("text, ok", [
    ("10.0.0.1:29400", ("10.0.0.1", 29400)), ("[fd00::1]:29400", ("fd00::1", 29400)),
    ("node0:1", ("node0", 1)), ("host:99999", None), ("host:0", None), ("host", None),
    (":29400", None), ("fd00::1:29400", None), ("host:２９４００", None), ("a b:1", None),
])
def test_parse_endpoint(text, ok):
    if ok:
        assert parse_endpoint(text) == ok
    else:
        with pytest.raises(ConfigError) as e:
            parse_endpoint(text, "run.rdzv_endpoint")
        assert e.value.field == "run.rdzv_endpoint" and e.value.value == text


def test_jsonl_with_invalid_utf8(guard, tmp_path, capsys):
    (tmp_path / "d.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "\xff\xfe"}\n')
    refused(capsys, tmp_path, TINY + ["--data", "d.jsonl", "--output-dir", "r"],
            "d.jsonl:2", "not UTF-8", "0xff", "save the file as UTF-8")


def test_jsonl_nested_200k_levels(guard, tmp_path, capsys):
    (tmp_path / "d.jsonl").write_text("[" * 200_000 + "]" * 200_000 + "\n")
    refused(capsys, tmp_path, TINY + ["--data", "d.jsonl", "--output-dir", "r"],
            "d.jsonl:1", "nested too deeply")


@pytest.mark.parametrize("line, needle", [
    ('{"text": "a\\ud800b"}', "unpaired UTF-16 surrogate"),
    ('{"text": ' + "1" * 5000 + "}", "not usable JSON"),
    ('{"messages": [{"role": "assistant", "content": "\\udfff"}]}', "messages[0].content"),
])
def test_jsonl_rows_no_tokenizer_can_take(tmp_path, line, needle):
    p = tmp_path / "d.jsonl"
    p.write_text(line + "\n")
    with pytest.raises(DataError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        read_jsonl(str(p))


def test_jsonl_with_a_bom_is_read(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"text": "a"}\n')
    assert read_jsonl(str(p)) == [{"text": "a"}]


def test_comm_opt_that_is_no_yaml_value(guard, tmp_path, capsys):
    refused(capsys, tmp_path, TINY + ["--comm-opt", "period=[1", "--output-dir", "r"],
            "comm.options.period", "'[1'", "period=8")


@pytest.mark.parametrize("pairs, field", [
    (["=8"], "comm.options"), (["period"], "comm.options"),
    (["period=" + "[" * 5000], "comm.options.period"), (["period=!!python/tuple [1]"],
                                                         "comm.options.period"),
    (["period=" + "1" * 5000], "comm.options.period"), (["period=2020-13-45"],
                                                        "comm.options.period"),
    (["period=\x1f"], "comm.options.period"),
])
def test_parse_options_errors(pairs, field):
    with pytest.raises(ConfigError) as e:
        parse_options(pairs)
    assert e.value.field == field


def test_misspelt_strategy_option_fails_in_the_launcher_once(guard, tmp_path, capsys):
    line = refused(capsys, tmp_path, TINY + ["--comm", "local", "--comm-opt", "perod=8",
                                             "--output-dir", "r"],
                   "perod", "did you mean 'period'")
    assert guard.launches == 0, line


def test_strategy_option_out_of_range_is_a_config_error():
    with pytest.raises(ConfigError, match="local.period"):
        CommConfig(strategy="local", options={"period": 0})
    with pytest.raises(ConfigError, match="comm.options.ratio"):
        CommConfig(strategy="topk", options={"ratio": 10 ** 400})


def test_lora_targets_that_match_no_module(guard, tmp_path, capsys):
    line = refused(capsys, tmp_path, TINY + ["--lora-targets", "q,v", "--output-dir", "r"],
                   "lora.targets", "'q'", "q_proj", "v_proj")
    assert guard.launches == 0, line


def test_lora_targets_that_name_no_linear_layer(guard, tmp_path, capsys):
    refused(capsys, tmp_path, TINY + ["--lora-targets", "q_proj,self_attn", "--output-dir", "r"],
            "lora.targets", "'self_attn'")


def test_flat_only_strategy_with_hierarchy_node(guard, tmp_path, capsys):
    refused(capsys, tmp_path, TINY + ["--comm", "onebit", "--hierarchy", "node",
                                      "--output-dir", "r"], "comm.hierarchy", "flat")


def test_eval_data_with_the_demo_task(guard, tmp_path, capsys):
    rows(tmp_path / "e.jsonl")
    refused(capsys, tmp_path, TINY + ["--eval-data", "e.jsonl", "--output-dir", "r"],
            "data.eval_path", "'e.jsonl'", "held-out split")


def test_eval_data_that_is_the_training_file(guard, tmp_path, capsys):
    rows(tmp_path / "d.jsonl")
    (tmp_path / "sub").mkdir()
    refused(capsys, tmp_path, TINY + ["--data", "d.jsonl", "--eval-data", "sub/../d.jsonl",
                                      "--output-dir", "r"],
            "data.eval_path", "measures nothing", "held-out")


def test_missing_eval_file_is_named_as_eval_data(guard, tmp_path, capsys):
    rows(tmp_path / "d.jsonl")
    refused(capsys, tmp_path, TINY + ["--data", "d.jsonl", "--eval-data", "nope.jsonl",
                                      "--output-dir", "r"], "data.eval_path", "nope.jsonl")


def test_output_dir_that_is_a_file(guard, tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    refused(capsys, tmp_path, TINY + ["--output-dir", "f/run"], "--output-dir", "f/run")
    refused(capsys, tmp_path, TINY + ["--output-dir", "f"], "--output-dir", "is a file")


@pytest.mark.parametrize("text, field", [
    (b"train: {lr: .nan}\n", "train.lr"), (b"train: {epochs: .inf, max_steps: 0}\n",
                                           "train.epochs"),
    (b"run: {output_dir: \"a\\0b\"}\n", "run.output_dir"), (b"data: {demo_size: 1000000000}\n",
                                                            "data.demo_size"),
    (b"train: {seed: 99999999999999999999}\n", "train.seed"),
    (b"run: {nnodes: \"\xc2\xb2\"}\n", "run.nnodes"),
    (b"comm: {strategy: local, options: {perod: 8}}\n", "local.perod"),
    (b"model: {name: \xff}\n", "--config"), (b"[" * 3000, "--config"),
    (b"train: {lr: 1" + b"0" * 400 + b"}\n", "train.lr"),
    (b"train: {seed: 2020-13-45}\n", "--config"), (b"train: {seed: " + b"1" * 5000 + b"}\n",
                                                    "--config"),
])
def test_yaml_config_fields(tmp_path, text, field):
    p = tmp_path / "c.yaml"
    p.write_bytes(text)
    with pytest.raises(ConfigError) as e:
        load_config(str(p))
    assert e.value.field == field


def test_demo_config_refuses_an_eval_file():
    with pytest.raises(ConfigError) as e:
        DataConfig(path="demo", eval_path="e.jsonl")
    assert e.value.field == "data.eval_path"


# ---------------------------------------------------------------- probe JSON: plan, tune, doctor

@pytest.mark.parametrize("probe, field", [
    ({"world_size": 2, "sweep": [1, 2, 3]}, "probe.sweep[0]"),
    ({"world_size": 2, "model": "fast"}, "probe.model"),
    ({"world_size": 2, "sweep": [{"collective": "all_reduce", "bytes": "x", "time_s": 1},
                                 {"collective": "all_reduce", "bytes": 2, "time_s": 1}]},
     "probe.sweep[0].bytes"),
])
def test_plan_probe_of_the_wrong_shape(guard, tmp_path, capsys, probe, field):
    write_json(tmp_path / "p.json", probe)
    refused(capsys, tmp_path, ["plan", "--probe", "p.json", "--compute-s", "1"],
            f"--probe p.json: {field}:")


BANDWIDTH = "probe.model.bandwidth_Bps"


@pytest.mark.parametrize("model, field, value", [
    ({"alpha_s": 1e-3, "bandwidth_Bps": 1e-300}, BANDWIDTH, "1e-300"),
    ({"alpha_s": 1e-3, "bandwidth_Bps": 999.0}, BANDWIDTH, "999.0"),
    ({"alpha_s": 1e-3, "bandwidth_Bps": 2e13}, BANDWIDTH, "20000000000000.0"),
    ({"alpha_s": 1e-3, "bandwidth_Bps": -5.0}, BANDWIDTH, "-5.0"),
    ({"alpha_s": 1e-3, "bandwidth_Bps": math.nan}, BANDWIDTH, "nan"),
    ({"alpha_s": 1e9, "bandwidth_Bps": 1e6}, "probe.model.alpha_s", "1000000000.0"),
    ({"alpha_s": 10 ** 400, "bandwidth_Bps": 1e6}, "probe.model.alpha_s", "1000"),
    ({"alpha_s": 1e-3, "beta_s_per_byte": 1e-20}, "probe.model.beta_s_per_byte", "1e+20"),
])
def test_plan_probe_with_absurd_values(guard, tmp_path, capsys, model, field, value):
    write_json(tmp_path / "p.json", probe_json(model=model))
    refused(capsys, tmp_path, ["plan", "--probe", "p.json", "--compute-s", "1"],
            f"{field}: invalid value {value}", "re-run `lorasync probe")


def test_plan_probe_with_an_absurd_pair_latency(guard, tmp_path, capsys):
    write_json(tmp_path / "p.json", probe_json(pairs=[{"latency_s": 3600.0}]))
    refused(capsys, tmp_path, ["plan", "--probe", "p.json", "--compute-s", "1"],
            "probe.pairs[0].latency_s", "between 0 and 60 s")


@pytest.mark.parametrize("argv, needle", [
    (["--rate", "1bit", "--rtt", "1ms"], "--rate: invalid value '1bit'"),
    (["--rate", "1gbit", "--rtt", "2min"], "--rtt: invalid value '2min'"),
    (["--rate", "1gbit", "--bucket-mb", "nan"], "--bucket-mb"),
    (["--rate", "1gbit", "--encode-ns", "int8=nan"], "--encode-ns"),
    (["--rate", "1gbit", "--nodes", "100000000"], "--nodes"),
])
def test_plan_what_if_out_of_bounds(guard, tmp_path, capsys, argv, needle):
    refused(capsys, tmp_path, ["plan", "--compute-s", "1", *argv], needle)


def test_a_good_probe_plans(guard, tmp_path, capsys):
    write_json(tmp_path / "p.json", probe_json())
    rc, out, err = run(capsys, ["plan", "--probe", "p.json", "--compute-s", "1"])
    assert rc == 0 and "Recommendation:" in out, err


def test_a_live_probe_is_not_held_to_the_file_bounds():
    # auto plans from a live probe: a noisy fit (a slope near zero) must not stop the run
    net, _ = net_from_probe(probe_json(model={"alpha_s": 1e-5, "bandwidth_Bps": 5e14}))
    assert net.bandwidth_Bps == pytest.approx(5e14)
    with pytest.raises(ConfigError, match=BANDWIDTH):
        net_from_probe(probe_json(model={"alpha_s": 1e-5, "bandwidth_Bps": 5e14}), strict=True)
    with pytest.raises(ConfigError, match="probe.model.alpha_s"):   # types: always
        net_from_probe(probe_json(model={"alpha_s": "1ms", "bandwidth_Bps": 1e6}))


@pytest.mark.parametrize("probe, field", [
    ({"world_size": "2"}, "probe.world_size"), ({"world_size": 2, "pairs": 5}, "probe.pairs"),
    ({"world_size": 2, "pairs": [7]}, "probe.pairs[0]"),
    ({"world_size": 2, "ranks": 5}, "probe.ranks"), ({"world_size": 2, "rdma": "yes"},
                                                     "probe.rdma"),
    ({"world_size": 2, "backend": 3}, "probe.backend"),
])
def test_net_from_probe_names_the_field(probe, field):
    with pytest.raises(ConfigError) as e:
        net_from_probe({**probe_json(), **probe})
    assert e.value.field == field


@pytest.mark.parametrize("sweep, field", [
    ("x", "probe.sweep"), ([None], "probe.sweep[0]"),
    ([{"collective": "all_reduce", "bytes": 1 << 20, "time_s": 0}], "probe.sweep[0].time_s"),
    ([{"collective": "all_reduce", "bytes": True, "time_s": 1}], "probe.sweep[0].bytes"),
    ([{"collective": "all_reduce", "bytes": 1e300, "time_s": 1}], "probe.sweep[0].bytes"),
    ([{"collective": "all_reduce", "bytes": 10 ** 400, "time_s": 1}], "probe.sweep[0].bytes"),
])
def test_fit_sweep_checks_its_records(sweep, field):
    with pytest.raises(ConfigError) as e:
        fit_sweep(sweep, 2)
    assert e.value.field == field


def test_fit_sweep_skips_other_collectives():
    sweep = [{"collective": "all_gather", "bytes": "?"},
             {"collective": "all_reduce", "bytes": 1 << 20, "time_s": 0.01},
             {"collective": "all_reduce", "bytes": 4 << 20, "time_s": 0.04}]
    assert fit_sweep(sweep, 2).bandwidth_Bps > 0


@pytest.mark.parametrize("command", ["tune", "doctor"])
@pytest.mark.parametrize("probe, needle", [
    (probe_json(model={"bandwidth_Bps": 1e-300, "latency_s": 1e-3}),
     f"{BANDWIDTH}: invalid value 1e-300"),
    (probe_json(model="fast"), "probe.model: invalid value 'fast'"),
    (probe_json(pairs=[5]), "probe.pairs[0]"),
    ({"model": None}, "probe.model: invalid value None"),
])
def test_from_probe_names_the_field(guard, tmp_path, capsys, command, probe, needle):
    write_json(tmp_path / "p.json", probe)
    refused(capsys, tmp_path, [command, "--from-probe", "p.json"],
            f"--from-probe p.json: {needle}")


def test_from_probe_reads_a_good_probe(tmp_path):
    link = tune.link_from_probe(write_json(tmp_path / "p.json", probe_json()))
    assert link.rate_Bps == 1.25e6 and link.rtt_s == pytest.approx(0.8e-3)


# ---------------------------------------------------------------- tunnel.json

def _tunnel(tmp_path, change) -> str:
    path = tunnel_configs(tmp_path)[1]   # node a, behind NAT
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))
    return str(path)


def _set(key, value):
    return lambda raw: raw.__setitem__(key, value)


def _allowed(*ips):
    return lambda raw: raw["peers"][0].__setitem__("allowed_ips", list(ips))


@pytest.mark.parametrize("change, needles", [
    (_set("listen_port", "abc"), ["listen_port: invalid value 'abc'", "1 and 65535"]),
    (_set("mtu", "big"), ["mtu: invalid value 'big'", "1280"]),
    (_set("peers", 5), ["peers: invalid value 5", "list"]),
    (_allowed("0.0.0.0/0"), ["peers[0].allowed_ips", "'0.0.0.0/0'", "all traffic"]),
    (_allowed("::/0"), ["peers[0].allowed_ips", "'::/0'", "all traffic"]),
    (_allowed("10.77.0.1/32", "0.0.0.0/1", "128.0.0.0/1"), ["'0.0.0.0/1'", "all traffic"]),
    (_allowed("203.0.113.0/24"), ["'203.0.113.0/24'", "underlay", "203.0.113.5"]),
    (_allowed("192.168.1.0/24"), ["'192.168.1.0/24'", "inside 10.77.0.0/24"]),
    (_set("nodes", "x"), ["nodes: invalid value 'x'"]),
    (_set("is_hub", True), ["is_hub"]),
    (_set("ifname", "lsync0\n"), ["ifname"]),
    (lambda raw: raw["peers"][0].__setitem__("endpoint", "h:70000"), ["peers[0].endpoint"]),
    (lambda raw: raw.pop("subnet"), ["tunnel.json subnet", "missing"]),
])
def test_tunnel_json_fields(guard, tmp_path, capsys, change, needles):
    path = _tunnel(tmp_path, change)
    refused(capsys, tmp_path, ["tunnel", "up", "--config", path], *needles)


def test_tunnel_json_of_init_loads(guard, tmp_path, capsys):
    for path in tunnel_configs(tmp_path):
        assert tunnel.load_config(path).peers
    with pytest.raises(Reached):   # the file is fine: up goes on to the root check
        run(capsys, ["tunnel", "up", "--config", str(path)])


def test_state_files_that_are_no_state_are_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(supervisor, "TUNNELS_DIR", tmp_path)
    (tmp_path / "a.json").write_text("[1, 2]")
    (tmp_path / "b.json").write_text('{"ifname": 5}')
    (tmp_path / "c.json").write_text('{"ifname": "lsync9", "config": "/x/tunnel.json"}')
    assert [s["ifname"] for s in tunnel.states()] == ["lsync9"]
