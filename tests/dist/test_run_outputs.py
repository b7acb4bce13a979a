"""A real 2-rank run's outputs for other tools: it starts from an existing PEFT
adapter (--init-adapter), logs to TensorBoard, W&B (offline) and MLflow (file
store) under the Trainer's names, writes checkpoint-N folders, and resumes
from a checkpoint of the layout before (checkpoints/step-N), pruning it."""

import glob
import json
import os
import shutil

import pytest
import torch

from conftest import run_cli

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

TINY = ["--model", "tiny", "--nproc", "2", "--batch-size", "2", "--eval-size", "4",
        "--max-new-tokens", "2", "--no-progress", "--no-eval-before"]


def _init_adapter(folder):
    """A tiny adapter as training would leave it (lora_B not zero), in PEFT's format."""
    from lorasync.config import LoraSettings
    from lorasync.train.checkpoint import export_adapter
    from lorasync.train.model import ModelSource, add_lora, load_base

    source = ModelSource.resolve("tiny")
    base, tok = load_base(source)
    model = add_lora(base, LoraSettings(), seed=5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    export_adapter(model, folder, tokenizer=tok, base_ref=source.ref)


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "adapter_model.safetensors"))


def test_init_adapter_trackers_and_resume_from_the_older_layout(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lorasync.train.model import base_model_ref

    init = str(tmp_path / "init")
    _init_adapter(init)
    run = str(tmp_path / "run")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_TRACKING_URI": ""}
    # lr 1e-9: after a step the adapter is still the one it started from
    flags = [*TINY, "--max-steps", "4", "--ckpt-interval", "2", "--lr", "1e-9",
             "--report-to", "tensorboard,wandb,mlflow", "--init-adapter", init]
    p = run_cli("train", *flags, "--stop-after", "2", "--output-dir", run, **env)
    assert p.returncode == 0, p.stderr[-3000:]
    ck = os.path.join(run, "checkpoint-2")
    conf = json.loads(open(os.path.join(ck, "adapter_config.json")).read())
    assert conf["base_model_name_or_path"] == base_model_ref("tiny")
    start, got = _weights(init), _weights(ck)
    assert start.keys() == got.keys()
    assert any(v.abs().sum() > 0 for k, v in start.items() if "lora_B" in k)
    for k in start:
        assert torch.allclose(got[k], start[k], atol=1e-6), k

    # the checkpoint as versions before this one wrote it: RUN/checkpoints/step-000002
    old = os.path.join(run, "checkpoints", "step-000002")
    shutil.move(os.path.join(ck, "lorasync"), old)
    shutil.rmtree(ck)
    p = run_cli("train", "--resume", "--output-dir", run, "--keep-ckpts", "1", "--no-progress",
                **env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resumed from" in p.stderr and "step-000002 at step 2" in p.stderr
    assert sorted(n for n in os.listdir(run) if n.startswith("checkpoint")) == ["checkpoint-4"]
    assert not os.path.exists(old)   # pruned like any other (--keep-ckpts 1), its folder too
    for name in ("adapter/adapter_model.safetensors", "adapter/tokenizer.json",
                 "checkpoint-4/adapter_model.safetensors", "checkpoint-4/lorasync/rank1.pt"):
        assert os.path.isfile(os.path.join(run, name)), name
    final = json.loads(open(os.path.join(run, "adapter", "adapter_config.json")).read())
    assert final["base_model_name_or_path"] == base_model_ref("tiny")

    # every tracker has steps 1-4 under the Trainer's names, the resume continuing its run
    acc = EventAccumulator(os.path.join(run, "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]
    assert "train/learning_rate" in acc.Tags()["scalars"]
    assert "eval/loss" in acc.Tags()["scalars"]
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")   # what the run set for itself
    client = MlflowClient(tracking_uri="file://" + os.path.join(run, "mlruns"))
    rid = open(os.path.join(run, "mlruns", "lorasync-run-id")).read()
    assert [m.step for m in client.get_metric_history(rid, "train/loss")] == [1, 2, 3, 4]
    assert client.get_run(rid).data.params["lora.r"] == "8"
    wid = open(os.path.join(run, "wandb", "lorasync-run-id")).read()
    files = glob.glob(os.path.join(run, "wandb", "offline-run-*", f"run-{wid}.wandb"))
    assert len(files) == 2   # one per session, the same W&B run
    assert all(b"train/learning_rate" in open(f, "rb").read() for f in files)
