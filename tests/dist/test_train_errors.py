"""Bad input: one clear line naming the field/file and the fix, exit 2, nothing written."""

import json
import os

import pytest

from conftest import run_cli

pytestmark = [pytest.mark.timeout(120)]

TINY = ["--model", "tiny", "--nproc", "2", "--no-progress"]


def check(p, out, *needles):
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    last = p.stderr.strip().splitlines()[-1]
    for n in needles:
        assert n in last, (n, last)
    assert "Traceback" not in p.stderr
    assert not os.path.exists(out), "no run directory for a run that never started"


def test_unknown_config_key(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train:\n  max_step: 3\n")
    out = tmp_path / "r"
    check(run_cli("train", *TINY, "--config", cfg, "--output-dir", out), out,
          "unknown key 'max_step'", "did you mean 'max_steps'")


def test_invalid_value(tmp_path):
    out = tmp_path / "r"
    check(run_cli("train", *TINY, "--lr", "-1", "--output-dir", out), out, "train.lr", "(0, 1)")


def test_unknown_strategy(tmp_path):
    out = tmp_path / "r"
    check(run_cli("train", *TINY, "--comm", "carrier-pigeon", "--output-dir", out), out,
          "comm.strategy", "allreduce")


def test_malformed_jsonl_line(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n{oops\n")
    out = tmp_path / "r"
    check(run_cli("train", *TINY, "--data", data, "--output-dir", out), out, f"{data}:2",
          "not valid JSON")


def test_missing_model_path(tmp_path):
    out = tmp_path / "r"
    check(run_cli("train", "--model", tmp_path / "nope", "--output-dir", out), out,
          "model.name", "local Hugging Face model directory")


def test_dataset_smaller_than_global_batch(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(5)))
    out = tmp_path / "r"
    check(run_cli("train", *TINY, "--data", data, "--batch-size", "4", "--output-dir", out), out,
          "fewer than one global batch", "--batch-size")


def test_existing_run_is_not_overwritten(tmp_path):
    out = tmp_path / "r"
    out.mkdir()
    (out / "config.yaml").write_text("precious")
    p = run_cli("train", *TINY, "--output-dir", out)
    assert p.returncode == 2 and "--resume" in p.stderr
    assert (out / "config.yaml").read_text() == "precious"
