"""A run's config.yaml: --resume trusts it only whole and unchanged, and refuses
(one line, the field named) a file cut short, edited, or a flag that changes the
adapter's shape; nothing here starts a worker or writes a file."""

import argparse
import os

import pytest
import yaml

from lorasync.config import config_to_dict, load_config
from lorasync.errors import LorasyncError
from lorasync.train import cli
from lorasync.train.runconfig import check_run_config, write_run_config


@pytest.fixture
def run(tmp_path):
    cfg = load_config(None, {"model": {"name": "tiny"}, "run": {"output_dir": str(tmp_path)}})
    write_run_config(cfg, str(tmp_path / "config.yaml"))
    return tmp_path, cfg


def _args(*argv):
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args([str(a) for a in argv])


def test_written_whole_it_reads_back_as_written(run):
    out, cfg = run
    path = out / "config.yaml"
    check_run_config(str(path))
    assert yaml.safe_load(path.read_text()) == config_to_dict(cfg)
    assert config_to_dict(cli._resolve(_args("--resume", "--output-dir", out))) == \
        {**config_to_dict(cfg), "train": {**config_to_dict(cfg)["train"], "stop_after": 0}}
    assert not [n for n in os.listdir(out) if n != "config.yaml"]


def test_every_cut_is_refused(run):
    """Any prefix of the file (a disk that filled up, a copy that stopped) is refused."""
    out, _ = run
    path = out / "config.yaml"
    data = path.read_bytes()
    for n in range(len(data) - 1):   # (without its final newline alone it is whole)
        path.write_bytes(data[:n])
        with pytest.raises(LorasyncError) as err:
            check_run_config(str(path))
        assert "\n" not in str(err.value)


def test_the_issue_cut_names_lora_targets(run):
    out, _ = run
    path = out / "config.yaml"
    text = path.read_text()
    path.write_text(text[:text.index("  - k_proj")])   # lora.targets shrank to q_proj
    with pytest.raises(LorasyncError, match=r"cut short \(lora\.freeze_a and the \d+ field\(s\) "
                                            r"after it are missing, lora\.targets"):
        cli._resolve(_args("--resume", "--output-dir", out))


def test_an_edit_is_refused_until_its_checksum_is_removed(run):
    out, _ = run
    path = out / "config.yaml"
    text = path.read_text()
    path.write_text(text.replace("  r: 8", "  r: 4"))
    with pytest.raises(LorasyncError, match="changed since the run wrote it"):
        cli._resolve(_args("--resume", "--output-dir", out))
    # the edit kept deliberately (first and last lines deleted): checked by sections
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[1:-1]))
    assert cli._resolve(_args("--resume", "--output-dir", out)).lora.r == 4
    # such a file (or an earlier version's) still needs every section
    path.write_text("".join(lines[1:lines.index("data:\n")]))
    with pytest.raises(LorasyncError, match="the section data is missing"):
        cli._resolve(_args("--resume", "--output-dir", out))


@pytest.mark.parametrize("flag, value", [("--lora-r", 4), ("--lora-targets", "q_proj")])
def test_a_flag_that_changes_the_adapter_shape_is_refused(run, flag, value):
    out, _ = run
    with pytest.raises(LorasyncError, match=rf"lora\.\w+: invalid value .*the run in {out} was "
                                            "trained with"):
        cli._resolve(_args("--resume", "--output-dir", out, flag, value))
    # flags that do not touch the checkpoints' shape still override
    cfg = cli._resolve(_args("--resume", "--output-dir", out, "--max-steps", 7))
    assert cfg.train.max_steps == 7
