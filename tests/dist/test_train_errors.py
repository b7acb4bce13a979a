"""Bad input: one clear line naming the field/file and the fix, exit 2, nothing written."""

import json
import os
import shutil

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


# ---------------------------------------------------------------- a failed --resume


def _tree(root):
    """Every file under ``root`` with its bytes: a failed resume must change none."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                out[os.path.relpath(os.path.join(d, f), root)] = fh.read()
    return out


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A run stopped after step 4 of 6 (checkpoints at 2 and 4): the one to resume."""
    out = tmp_path_factory.mktemp("stopped") / "r"
    p = run_cli("train", *TINY, "--batch-size", "2", "--eval-size", "0", "--max-steps", "6",
                "--ckpt-interval", "2", "--stop-after", "4", "--output-dir", out)
    assert p.returncode == 0, p.stderr[-3000:]
    return out


def _cut_config(run):
    text = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(text[:text.index("  - k_proj")])


def _corrupt_with_record(run):
    """rank 1's newest state file replaced by bytes that do not load, with a record
    that matches them: it verifies, and fails only when loaded."""
    import hashlib

    folder = run / "checkpoint-4" / "lorasync"
    data = (folder / "rank1.pt").read_bytes()[:1000]
    (folder / "rank1.pt").write_bytes(data)
    (folder / "rank1.json").write_text(json.dumps(
        {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}))


@pytest.mark.parametrize("damage, flags, needles", [
    # refused by the launcher, before any worker starts
    (_cut_config, (), ("config.yaml: cut short", "lora.targets")),
    (lambda run: None, ("--lora-r", "4"), ("lora.r: invalid value 4", "trained with 8")),
    # refused by the workers while restoring, with restarts left: stopped at once
    (_corrupt_with_record, ("--max-restarts", "2"),
     ("checkpoint-4/lorasync/rank1.pt: cannot be loaded", "move ")),
], ids=["config-cut", "lora-r-changed", "state-file-corrupt"])
def test_a_failed_resume_changes_nothing_and_exits_2_once(stopped_run, tmp_path, damage,
                                                         flags, needles):
    run = tmp_path / "r"
    shutil.copytree(stopped_run, run)
    damage(run)
    before = _tree(run)
    p = run_cli("train", "--resume", "--output-dir", run, "--no-progress", *flags)
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    errors = [line for line in p.stderr.splitlines() if line.startswith("lorasync train: error:")]
    assert len(errors) == 1, p.stderr[-3000:]       # said once, not once per restart
    for n in needles:
        assert n in errors[0], (n, errors[0])
    at = p.stderr.find("Traceback")
    assert at < 0, p.stderr[max(0, at - 1500):at + 3000]   # the whole traceback, to see whose
    assert "recovering" not in p.stderr
    assert _tree(run) == before                      # config.yaml, streams, checkpoints
