"""What a run leaves for other tools: checkpoint-N with a PEFT adapter that loads
elsewhere, --init-adapter, and the experiment trackers (--report-to) with the
Hugging Face Trainer's metric names."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _bad_input import Guard, refused
from lorasync.config import LoraSettings, ModelConfig, RunConfig, load_config
from lorasync.errors import ConfigError, ModelError
from lorasync.monitor import sinks as sinks_mod
from lorasync.monitor.sinks import check_report_to, open_sinks, scalars
from lorasync.train import checkpoint as ckpt
from lorasync.train.model import ModelSource, add_lora, base_model_ref, load_base

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


def _trained(r=4, seed=0, targets=("q_proj", "v_proj")):
    """The tiny model with a LoRA adapter whose B is not zero (as after training)."""
    base, tok = load_base(ModelSource.resolve("tiny"))
    model = add_lora(base, LoraSettings(r=r, targets=list(targets)), seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model, tok


def _adapter(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


# ---------------------------------------------------------------- checkpoint-N for other tools


_FRESH = r"""
import sys, torch
from peft import AutoPeftModelForCausalLM
from transformers import AutoTokenizer
from transformers.trainer_utils import get_last_checkpoint
ck = get_last_checkpoint(sys.argv[1])          # finds RUN/checkpoint-N as the Trainer's
model = AutoPeftModelForCausalLM.from_pretrained(ck)   # the base from adapter_config.json
tok = AutoTokenizer.from_pretrained(ck)
ids = tok("12+34=", return_tensors="pt")["input_ids"]
with torch.no_grad():
    logits = model(input_ids=ids).logits
torch.save({"checkpoint": ck, "logits": logits, "ids": ids,
            "adapter": {n: p.detach() for n, p in model.named_parameters() if "lora_" in n}},
           sys.argv[2])
"""


def test_a_checkpoint_loads_in_a_fresh_process_from_its_path_alone(tmp_path):
    """The base model a user gave as a directory: checkpoint-N's adapter_config.json
    names it, the tokenizer is beside the adapter, and a fresh process that knows
    only the run directory finds the newest checkpoint, loads base + adapter with
    PEFT and computes the same logits."""
    base, tok = load_base(ModelSource.resolve("tiny"))
    base_dir = tmp_path / "base"
    base.save_pretrained(base_dir)
    tok.save_pretrained(base_dir)
    source = ModelSource.resolve(str(base_dir))
    base, tok = load_base(source)
    model = add_lora(base, LoraSettings(r=4, targets=["q_proj", "v_proj"]), 0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    run = tmp_path / "run"
    for step in (2, 4):
        c = ckpt.Checkpointer(str(run), rank=0, local_rank=0, world_size=1,
                              barrier=lambda: None, interval=2, keep=2, tokenizer=tok,
                              base_ref=source.ref)
        c.save(ckpt.Progress(step=step), model=model, opt=torch.optim.SGD(
            [p for p in model.parameters() if p.requires_grad], lr=0.1),
            sched=torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1)], lr=1),
                                                    lambda s: 1.0),
            sync=type("S", (), {"state_dict": lambda self: {}})(), meta={})
    folder = run / "checkpoint-4"
    conf = json.loads((folder / "adapter_config.json").read_text())
    assert conf["base_model_name_or_path"] == str(base_dir)
    assert conf["r"] == 4 and sorted(conf["target_modules"]) == ["q_proj", "v_proj"]
    for name in ("adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "lorasync/meta.json", "lorasync/rank0.pt", "lorasync/rank0.json"):
        assert (folder / name).is_file(), name
    assert ckpt.latest(str(run)) == str(folder) and ckpt.intact(str(folder))
    # the model keeps the name it was loaded with (only the saved config names the ref)
    assert model.peft_config["default"].base_model_name_or_path == str(base_dir)

    out = tmp_path / "fresh.pt"
    p = subprocess.run([sys.executable, "-c", _FRESH, str(run), str(out)], capture_output=True,
                       text=True, timeout=100, cwd=tmp_path,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    got = torch.load(out, weights_only=True)
    assert got["checkpoint"] == str(folder)
    assert torch.equal(got["ids"], tok("12+34=", return_tensors="pt")["input_ids"])
    mine = _adapter(model)
    assert got["adapter"].keys() == mine.keys()
    for k, v in mine.items():
        assert torch.equal(got["adapter"][k], v), k
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=got["ids"]).logits
    assert torch.allclose(got["logits"], logits, atol=1e-6)
    # and the adapter changes the output: the comparison could fail
    with model.disable_adapter(), torch.no_grad():
        assert not torch.allclose(model(input_ids=got["ids"]).logits, logits, atol=1e-4)


def test_the_adapter_names_the_hub_id_or_the_directory(tmp_path):
    assert base_model_ref("smollm2-135m") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert base_model_ref(str(tmp_path)) == str(tmp_path)
    model, tok = _trained()
    ckpt.export_adapter(model, str(tmp_path / "a"), tokenizer=tok,
                        base_ref="HuggingFaceTB/SmolLM2-135M-Instruct")
    conf = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert conf["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert ".cache" not in (tmp_path / "a" / "adapter_config.json").read_text()


# ---------------------------------------------------------------- --init-adapter


def _cfg(tmp_path, init, **lora):
    return load_config(None, {"model": {"name": "tiny"},
                              "lora": {"r": 4, "targets": "q_proj,v_proj", **lora},
                              "run": {"init_adapter": str(init)}})


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A trained tiny adapter (r=4, q/v, alpha 16) saved as lorasync saves it."""
    folder = tmp_path_factory.mktemp("init") / "adapter"
    model, tok = _trained()
    ckpt.export_adapter(model, str(folder), tokenizer=tok, base_ref=ModelSource.resolve("tiny").ref)
    return folder, _adapter(model)


def test_init_adapter_loads_its_weights_into_the_fresh_adapter(exported):
    folder, weights = exported
    fresh, _ = _trained(seed=7)
    assert not all(torch.equal(v, weights[k]) for k, v in _adapter(fresh).items())
    assert ckpt.check_init_adapter(_cfg(None, folder))["r"] == 4
    assert ckpt.load_init_adapter(fresh, str(folder)) == len(weights)
    for k, v in _adapter(fresh).items():
        assert torch.equal(v, weights[k]), k
    # past the check (an adapter edited by hand): one error, not a traceback
    other, _ = _trained(r=2)
    with pytest.raises(ModelError, match="does not fit this run's adapter|does not load"):
        ckpt.load_init_adapter(other, str(folder))


@pytest.mark.parametrize("change, lora, field, needles", [
    ({}, {"r": 8}, "lora.r", ["has r=4", "--lora-r 4"]),
    ({}, {"targets": "q_proj,k_proj"}, "lora.targets", ["q_proj,v_proj", "--lora-targets"]),
    ({}, {"alpha": 32.0}, "lora.alpha", ["lora_alpha=16", "--lora-alpha 16"]),
    ({"base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}, {}, "model.name",
     ["base model HuggingFaceTB/SmolLM2-135M-Instruct", "--model"]),
    ({"peft_type": "IA3"}, {}, "run.init_adapter", ["IA3", "not LoRA"]),
], ids=["r", "targets", "alpha", "base", "not-lora"])
def test_init_adapter_of_another_shape_or_base_is_refused(exported, tmp_path, change, lora,
                                                          field, needles):
    folder, _ = exported
    mine = tmp_path / "a"
    mine.mkdir()
    conf = json.loads((folder / "adapter_config.json").read_text())
    (mine / "adapter_config.json").write_text(json.dumps({**conf, **change}))
    (mine / "adapter_model.safetensors").write_bytes((folder / "adapter_model.safetensors")
                                                     .read_bytes())
    with pytest.raises(ConfigError) as err:
        ckpt.check_init_adapter(_cfg(tmp_path, mine, **lora))
    assert err.value.field == field, str(err.value)
    for n in needles:
        assert n in str(err.value), (n, str(err.value))


def test_init_adapter_saved_by_earlier_versions_names_the_cache_and_is_accepted(tmp_path):
    conf = {"peft_type": "LORA", "r": 8, "lora_alpha": 16.0,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
            "base_model_name_or_path": "/home/someone/.cache/lorasync/smollm2-135m-instruct"}
    (tmp_path / "adapter_config.json").write_text(json.dumps(conf))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"x")
    cfg = load_config(None, {"run": {"init_adapter": str(tmp_path)}})
    assert ckpt.check_init_adapter(cfg)["r"] == 8


@pytest.mark.parametrize("make, needle", [
    (lambda d: None, "no such directory"),
    (lambda d: d.mkdir(), "has no adapter_config.json"),
    (lambda d: (d.mkdir(), (d / "adapter_config.json").write_text("{")), "cannot be read"),
    (lambda d: (d.mkdir(), (d / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4}))), "no adapter_model.safetensors"),
], ids=["missing", "no-config", "bad-json", "no-weights"])
def test_init_adapter_that_is_no_adapter_exits_2_before_launch(monkeypatch, tmp_path, capsys,
                                                               make, needle):
    monkeypatch.chdir(tmp_path)
    guard = Guard(monkeypatch)
    make(tmp_path / "ad")
    refused(capsys, tmp_path, ["train", "--model", "tiny", "--no-progress", "--max-steps", "2",
                               "--init-adapter", "ad", "--output-dir", "r"],
            "run.init_adapter", needle)
    assert guard.launches == 0


def test_init_adapter_mismatch_exits_2_before_launch(monkeypatch, tmp_path, capsys, exported):
    folder, _ = exported
    monkeypatch.chdir(tmp_path)
    guard = Guard(monkeypatch)
    refused(capsys, tmp_path, ["train", "--model", "tiny", "--no-progress", "--max-steps", "2",
                               "--lora-targets", "q_proj,v_proj", "--init-adapter", folder,
                               "--output-dir", "r"], "lora.r: invalid value 8", "--lora-r 4")
    assert guard.launches == 0


# ---------------------------------------------------------------- --report-to


def test_report_to_is_validated_in_the_config():
    assert RunConfig(report_to="tensorboard, wandb").report_to == ["tensorboard", "wandb"]
    assert RunConfig().report_to == ["none"]
    # the older flag is an alias
    assert RunConfig(tensorboard=True).report_to == ["tensorboard"]
    assert RunConfig(report_to="mlflow", tensorboard=True).report_to == ["mlflow", "tensorboard"]
    for bad in ("tensorbord", "none,wandb", "", ["wandb", 3]):
        with pytest.raises(ConfigError, match="run.report_to"):
            RunConfig(report_to=bad)
    assert ModelConfig().name   # the sections are unchanged around it


def test_report_to_a_missing_package_exits_2_before_launch(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sinks_mod.TRACKERS, "wandb", ("no_such_module_for_lorasync", "wandb"))
    with pytest.raises(ConfigError, match=r"pip install wandb"):
        check_report_to(["tensorboard", "wandb"])
    monkeypatch.chdir(tmp_path)
    guard = Guard(monkeypatch)
    refused(capsys, tmp_path, ["train", "--model", "tiny", "--no-progress", "--max-steps", "2",
                               "--report-to", "tensorboard,wandb", "--output-dir", "r"],
            "run.report_to", "'wandb'", "pip install wandb")
    assert guard.launches == 0


def _record(step, **kw):
    r = {"step": step, "rank": 0, "world_size": 2, "strategy": "allreduce", "loss": 2.0 / step,
         "lr": 1e-3 * step, "samples": 4, "tokens": 100, "grad_accum": 1, "compute_s": 0.2,
         "comm_s": 0.05, "step_s": 0.25, "wire_bytes": 1000, "intra_bytes": 1000,
         "inter_bytes": 0, "fp32_bytes": 2000, "encode_s": 0.0, "time": 1.0e9 + step}
    r.update(kw)
    return r


def test_metric_names_are_the_trainers_and_agree_with_the_hf_path():
    s = scalars(_record(3, grad_norm=0.5), world_size=2)
    assert s["train/loss"] == pytest.approx(2 / 3)
    assert s["train/learning_rate"] == pytest.approx(3e-3)
    assert s["train/grad_norm"] == 0.5
    assert s["lorasync/samples_per_s"] == pytest.approx(4 * 2 / 0.25)
    assert s["lorasync/compression"] == 2.0
    assert not [k for k in s if not k.startswith(("train/", "lorasync/"))]
    assert "train/grad_norm" not in scalars(_record(3), 2)   # not measured: not logged
    # lorasync.hf adds its per-step measurements to the Trainer's logs under these keys
    hf = set(re.findall(r'"(lorasync/\w+)"', (ROOT / "src/lorasync/hf.py").read_text()))
    for key in ("lorasync/comm_s", "lorasync/wire_bytes", "lorasync/sync_share",
                "lorasync/step_s", "lorasync/compression"):
        assert key in hf and key in s, key


def test_wandb_offline_run_holds_the_metrics_and_continues_on_resume(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "config.yaml").write_text("train:\n  lr: 0.002\n")
    for steps in ((1, 2, 3), (4, 5)):
        s = open_sinks(str(tmp_path), rank=0, world_size=2, report_to=["wandb"])
        for step in steps:
            s.write(_record(step, grad_norm=1.5))
        s.write({"step": steps[-1], "eval_loss": 0.7, "exact_match": 0.5, "n": 8, "time": 0.0})
        s.close()
    rid = (tmp_path / "wandb" / "lorasync-run-id").read_text()
    files = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 2 and all(f.endswith(f"run-{rid}.wandb") for f in files)
    data = b"".join(Path(f).read_bytes() for f in files)
    for key in (b"train/loss", b"train/learning_rate", b"train/grad_norm", b"eval/loss",
                b"lorasync/wire_bytes", b"train.lr"):
        assert key in data, key
    assert b"train/lr\"" not in data
    # rank 1 logs nothing
    s = open_sinks(str(tmp_path / "r1"), rank=1, world_size=2, report_to=["wandb"])
    s.write(_record(1))
    s.close()
    assert not (tmp_path / "r1").exists()


def test_mlflow_file_store_holds_the_metrics_and_continues_on_resume(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    (tmp_path / "config.yaml").write_text("train:\n  lr: 0.002\n")
    for steps in ((1, 2, 3), (4, 5)):   # a run stopped after 3, then resumed
        s = open_sinks(str(tmp_path), rank=0, world_size=2, report_to=["mlflow", "none"])
        for step in steps:
            s.write(_record(step))
        s.write({"step": steps[-1], "eval_loss": 0.5 + step, "exact_match": 0.5, "n": 8,
                 "time": 0.0})
        s.close()
    rid = (tmp_path / "mlruns" / "lorasync-run-id").read_text()
    client = MlflowClient(tracking_uri="file://" + str(tmp_path / "mlruns"))
    loss = client.get_metric_history(rid, "train/loss")
    assert [m.step for m in loss] == [1, 2, 3, 4, 5]
    assert loss[1].value == pytest.approx(1.0)
    assert [m.step for m in client.get_metric_history(rid, "eval/loss")] == [3, 5]
    run = client.get_run(rid)
    assert run.data.params["train.lr"] == "0.002" and run.info.status == "FINISHED"
    assert "lorasync/sync_share" in run.data.metrics
    assert "train/learning_rate" in run.data.metrics and "train/lr" not in run.data.metrics
