"""A bench peer row's sync: accelerate's LocalSGD (lorasync.bench.peers) on a
2-rank gloo group averages the parameters every ``local_sgd_steps`` steps and
only then; with ``params=adapter`` the frozen ones are left alone."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_env

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

WORKER = Path(__file__).parent / "_peer_worker.py"


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("peer")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", str(WORKER), str(out)], env=cli_env(),
                       capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


# rank r's trainable values start at r + 1 and grow by 0.5 (r + 1) a step;
# steps 3 and 6 average them: (2.5 + 5) / 2 = 3.75, (5.25 + 6.75) / 2 = 6.0
EXPECTED = {0: [1.5, 2.0, 3.75, 4.25, 4.75, 6.0], 1: [3.0, 4.0, 3.75, 4.75, 5.75, 6.0]}


@pytest.mark.parametrize("params", ["adapter", "all"])
def test_localsgd_averages_every_k_steps(records, params):
    for rank, rec in enumerate(records):
        steps = [r for r in rec[params] if "step" in r]
        assert [r["values"] for r in steps] == [[v] for v in EXPECTED[rank]]
        assert [r["differ"] for r in steps] == [True, True, False, True, True, False]
        # one fp32 all-reduce payload per average (two, plus finish's), none between
        per = steps[2]["stats"]["wire_bytes"]
        assert per > 0 and steps[1]["stats"]["wire_bytes"] == 0
        assert steps[-1]["stats"]["syncs"] == 2 and rec[params][-1]["stats"]["syncs"] == 3
        assert rec[params][-1]["stats"]["wire_bytes"] == 3 * per
        assert steps[-1]["stats"]["strategy"] == "accelerate_localsgd"


def test_adapter_view_leaves_frozen_weights_alone(records):
    for rank, rec in enumerate(records):
        assert {x for r in rec["adapter"] if "step" in r for x in r["frozen"]} == {rank + 1.0}
        # as accelerate documents it (the whole model): the frozen weight is averaged too
        assert [r["frozen"] for r in rec["all"] if "step" in r][2] == [1.5]


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchft_streaming_diloco_row(tmp_path):
    """torchft's Streaming DiLoCo on lorasync's trainer (tiny model, 2 ranks):
    a fragment (half the adapter, fp32) goes out every 2 steps, and training
    lowers the eval loss of the replicas' mean."""
    pytest.importorskip("torchft")
    lh_bin = Path(sys.executable).parent / "torchft_lighthouse"
    port = _free_port()
    lh = subprocess.Popen([str(lh_bin), "--min_replicas", "2", "--bind", f"127.0.0.1:{port}",
                           "--join_timeout_ms", "1000", "--quorum_tick_ms", "50"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = tmp_path / "run"
    try:
        p = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             "2", "-m", "lorasync.bench.peers", "--peer", "torchft_diloco",
             "--peer-opt", "sync_every=4", "--peer-opt", "fragments=2",
             "--peer-opt", "fragment_sync_delay=1",
             "--peer-opt", f"lighthouse=http://127.0.0.1:{port}", "--",
             "--model", "tiny", "--max-steps", "8", "--eval-interval", "0", "--eval-size", "8",
             "--eval-mean", "--no-progress", "--ckpt-interval", "0", "--output-dir", str(out)],
            env=cli_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=150)
    finally:
        lh.kill()
        lh.wait()
    assert p.returncode == 0, p.stderr[-3000:]
    recs = [json.loads(x) for x in (out / "ranks" / "rank0.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "event" not in r]
    assert {r["strategy"] for r in steps} == {"torchft_diloco"}
    sent = [r["wire_bytes"] for r in steps]
    half = steps[0]["fp32_bytes"] // 2
    assert sent == [half, 0] * 4, sent   # prepared one step before each of 4 syncs
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_after"]["eval_loss"] < summary["eval_before"]["eval_loss"]
