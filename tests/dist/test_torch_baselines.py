"""torch's own hooks as bench baselines: they train, and their wire bytes are counted."""

import json
import os

import pytest

from conftest import run_cli

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

TINY = ["--model", "tiny", "--nproc", "2", "--batch-size", "2", "--eval-size", "0",
        "--no-progress", "--max-steps", "5", "--ckpt-interval", "0"]
ADAPTER = 7168  # tiny model, r=8 on q/k/v/o


def metrics(run):
    with open(os.path.join(run, "metrics.jsonl")) as fh:
        return [json.loads(x) for x in fh]


def test_torch_fp16_hook(tmp_path):
    run = str(tmp_path / "r")
    p = run_cli("train", *TINY, "--comm", "torch_fp16", "--output-dir", run)
    assert p.returncode == 0, p.stderr[-2000:]
    for r in metrics(run):
        assert r["strategy"] == "torch_fp16" and r["wire_bytes"] == 2 * ADAPTER


def test_torch_powersgd_hook_with_fixed_length_batches(tmp_path):
    # the tiny adapter's gradients (28 KB) fit one 1 MB bucket: torch's hook runs on gloo
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"row {i:04d} of fixed size"}) + "\n"
                            for i in range(64)))
    run = str(tmp_path / "r")
    p = run_cli("train", *TINY, "--comm", "torch_powersgd", "--data", data, "--output-dir", run,
                timeout=200)
    assert p.returncode == 0, p.stderr[-2000:]
    recs = metrics(run)
    # steps 1 (start_iter=2): plain all-reduce; later: rank-1 factors, far fewer bytes
    first = [r["wire_bytes"] for r in recs if r["step"] == 1]
    later = [r["wire_bytes"] for r in recs if r["step"] >= 3]
    assert first == [4 * ADAPTER] * 2
    assert all(0 < w < ADAPTER for w in later)


def test_torch_powersgd_refuses_buckets_it_would_hang_on(tmp_path):
    # several buckets: torch's hook waits on an all-reduce inside a gloo callback and
    # hangs at its first PowerSGD step (lorasync.comm.torch_hooks); refused at attach,
    # exit 2 naming the field and the size that works, before the run directory exists
    run = tmp_path / "r"
    p = run_cli("train", *TINY, "--comm", "torch_powersgd", "--bucket-mb", "0.01",
                "--output-dir", str(run), timeout=200)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "comm.bucket_mb" in p.stderr and "--bucket-mb 25" in p.stderr, p.stderr[-2000:]
    assert not run.exists() or not any(run.iterdir())
