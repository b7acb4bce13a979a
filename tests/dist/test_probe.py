"""The probe (and live doctor) across real gloo processes on loopback."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "LOCAL_RANK", "RANK", "WORLD_SIZE",
              "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(extra)
    return env


def _worker(rank, world, port, out_dir):
    import torch
    import torch.distributed as dist

    from lorasync.comm.probe import run_probe
    from lorasync.netdiag.hostinfo import endpoint_facts

    torch.set_num_threads(1)
    os.environ.update(GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=__import__("datetime").timedelta(seconds=60))
    try:
        # a budget no loaded host exhausts: the whole pair matrix, whatever the timing
        res = run_probe(quick=True, max_bytes=256 << 10, pair_max_bytes=64 << 10, repeats=2,
                        collectives=("all_reduce", "all_gather", "broadcast"), time_budget_s=600,
                        describe_rank=endpoint_facts)
        res.pop("elapsed_s")  # each rank's own clock; everything else is shared
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)
        # a budget spent at once: quick pairs stop after the first, on every rank alike
        res = run_probe(quick=True, max_bytes=16 << 10, pair_max_bytes=16 << 10, repeats=1,
                        time_budget_s=1e-9)
        with open(os.path.join(out_dir, f"short{rank}.json"), "w") as f:
            json.dump([res["pairs"], res["pairs_complete"]], f)
        # a subgroup (as a trainer's own group would be): ranks are the group's, sends go to global ranks
        sub = dist.new_group([0, 2])
        if rank in (0, 2):
            res = run_probe(sub, quick=True, max_bytes=64 << 10, pair_max_bytes=16 << 10, repeats=2,
                            time_budget_s=600)
            with open(os.path.join(out_dir, f"sub{rank}.json"), "w") as f:
                json.dump(res, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def probe3(tmp_path_factory):
    """run_probe on 3 gloo ranks (3, so that busbw != algbw), spawned here."""
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("probe3")
    os.environ["OMP_NUM_THREADS"] = "1"
    mp.start_processes(_worker, args=(3, _free_port(), str(out)), nprocs=3, join=True,
                       start_method="spawn")
    return ([json.load(open(out / f"rank{r}.json")) for r in range(3)],
            [json.load(open(out / f"sub{r}.json")) for r in (0, 2)],
            [json.load(open(out / f"short{r}.json")) for r in range(3)])


@pytest.mark.timeout(120)
def test_probe_json_structure(probe3):
    res = probe3[0][0]
    assert res["world_size"] == 3 and res["backend"] == "gloo" and res["quick"] is True
    assert [r["rank"] for r in res["ranks"]] == [0, 1, 2]
    assert all(r["ifname"] == "lo" and r["addr"] == "127.0.0.1" for r in res["ranks"])
    keys = {"collective", "bytes", "time_s", "time_s_min", "time_s_max", "algbw_Bps", "busbw_Bps"}
    assert res["sweep"] and all(keys <= set(r) for r in res["sweep"])
    assert {r["collective"] for r in res["sweep"]} == {"all_reduce", "all_gather", "broadcast"}
    for r in res["sweep"]:
        assert 0 < r["time_s_min"] <= r["time_s"] <= r["time_s_max"]
    m = res["model"]
    assert m["alpha_s"] >= 0 and m["bandwidth_Bps"] > 0
    assert m["beta_s_per_byte"] == pytest.approx(1 / m["bandwidth_Bps"])
    assert m["latency_s"] == m["alpha_s"]
    json.dumps(res, allow_nan=False)  # strict JSON for the planner


@pytest.mark.timeout(120)
def test_busbw_is_nccl_tests_formula(probe3):
    n = 3
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "broadcast": 1.0}
    for r in probe3[0][0]["sweep"]:
        assert r["algbw_Bps"] == pytest.approx(r["bytes"] / r["time_s"])
        assert r["busbw_Bps"] == pytest.approx(r["algbw_Bps"] * factor[r["collective"]])
        if r["collective"] == "all_gather":
            assert r["bytes"] % (4 * n) == 0  # bytes = gathered output, whole floats per rank


@pytest.mark.timeout(120)
def test_pair_matrix_complete(probe3):
    res = probe3[0][0]
    assert sorted((p["src"], p["dst"]) for p in res["pairs"]) == [(s, d) for s in range(3) for d in range(3)
                                                                  if s != d]
    for p in res["pairs"]:
        assert p["latency_s"] > 0 and p["bandwidth_Bps"] > 0 and len(p["points"]) >= 2
    slow = res["slowest_pair"]
    assert slow["bandwidth_Bps"] == min(p["bandwidth_Bps"] for p in res["pairs"])


@pytest.mark.timeout(120)
def test_quick_pairs_stop_when_their_budget_is_spent(probe3):
    full, _, short = probe3
    assert full[0]["pairs_complete"] is True
    assert short[0] == short[1] == short[2]
    pairs, complete = short[0]
    assert complete is False and [(p["src"], p["dst"]) for p in pairs] == [(0, 1)]


def test_every_rank_gets_the_same_result(probe3):
    world = probe3[0]
    assert world[0] == world[1] == world[2]


@pytest.mark.timeout(120)
def test_probe_on_a_subgroup(probe3):
    a, b = probe3[1]
    assert a["world_size"] == 2 and [r["rank"] for r in a["ranks"]] == [0, 1]
    assert sorted((p["src"], p["dst"]) for p in a["pairs"]) == [(0, 1), (1, 0)]
    assert max(r["bytes"] for r in a["sweep"]) <= 64 << 10
    a.pop("elapsed_s"), b.pop("elapsed_s")
    assert a == b


@pytest.mark.timeout(150)
def test_cli_probe_two_local_ranks(tmp_path):
    out = tmp_path / "probe.json"
    p = subprocess.run([sys.executable, "-m", "lorasync", "probe", "--nproc", "2", "--quick", "--json",
                        "--max-bytes", "256K", "--output", str(out), "--timeout", "60",
                        "--time-budget", "600"],  # both pairs, however loaded the host
                       env=_env(), capture_output=True, text=True, timeout=140)
    assert p.returncode == 0, p.stderr[-3000:]
    printed = json.loads(p.stdout[p.stdout.index("{"):])
    written = json.load(open(out))
    assert printed == written
    assert written["world_size"] == 2 and len(written["pairs"]) == 2
    for r in written["sweep"]:  # n = 2: busbw = algbw
        assert r["busbw_Bps"] == pytest.approx(r["algbw_Bps"])
    assert max(r["bytes"] for r in written["sweep"]) <= 256 << 10


@pytest.mark.timeout(60)
def test_cli_probe_bad_option_is_exit_2():
    p = subprocess.run([sys.executable, "-m", "lorasync", "probe", "--max-bytes", "lots"],
                       env=_env(), capture_output=True, text=True, timeout=50)
    assert p.returncode == 2 and "--max-bytes" in p.stderr


@pytest.mark.timeout(60)
def test_worker_without_peers_times_out_instead_of_hanging():
    """A worker whose peer never comes: init_process_group gives up after --timeout."""
    env = _env(LOCAL_RANK="0", RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "lorasync", "doctor", "--timeout", "3"],
                       env=env, capture_output=True, text=True, timeout=50)
    assert time.monotonic() - t0 < 40
    assert p.returncode == 1
    assert "could not join the other 1 rank(s) within 3 s" in p.stdout


@pytest.mark.timeout(150)
def test_cli_doctor_live_two_ranks():
    p = subprocess.run([sys.executable, "-m", "lorasync", "doctor", "--nproc", "2", "--json", "--timeout", "60"],
                       env=_env(), capture_output=True, text=True, timeout=140)
    data = json.loads(p.stdout[p.stdout.index("{"):])
    checks = {f["check"]: f for f in data["findings"]}
    assert checks["reachable"]["severity"] == "ok"
    assert checks["same-lorasync"]["severity"] == "ok" and checks["same-torch"]["severity"] == "ok"
    assert checks["mtu"]["severity"] == "ok"
    assert "slow-link" in checks and data["probe"]["world_size"] == 2
    assert data["nnodes"] == 1  # same host, same netns
    assert p.returncode == data["exit_code"]
