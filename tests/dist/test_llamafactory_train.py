"""A real ``llamafactory-cli train`` on 2 gloo ranks with lorasync attached by the
switch (``LORASYNC_STRATEGY``; LLaMA-Factory has no plugin API), and through
``lorasync run``.

LLaMA-Factory 0.9.5 imports torchaudio at start-up and pins its own
transformers, PEFT, TRL, accelerate and datasets, none of which fits lorasync's
environment, so it lives in an environment of its own, ``.venv-llamafactory``,
that ``make test`` builds (tests/fixtures/llamafactory/constraints.txt);
lorasync is installed into it without dependencies.  Without that environment
these tests skip and say how to build it.

``llamafactory-cli train`` is run as a user runs it: ``FORCE_TORCHRUN=1
NPROC_PER_NODE=2`` make it start torchrun with two workers (``use_cpu: true``
in the YAML: DDP over gloo); the switch reaches the workers through the
environment that LLaMA-Factory's launcher passes on."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("LORASYNC_LLAMAFACTORY_VENV", ROOT / ".venv-llamafactory"))
BIN = VENV / "bin"

pytestmark = pytest.mark.skipif(
    not (VENV / ".installed").exists(),
    reason=f"LLaMA-Factory's environment {VENV} is not built (`make llamafactory-env`; it "
           "needs the package index: LLaMA-Factory imports torchaudio, which has no build for "
           "lorasync's torch, and pins its own transformers/PEFT/TRL)")

CONFIG = """\
model_name_or_path: {model}
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 8
lora_alpha: 16
lora_dropout: 0.0
lora_target: q_proj,v_proj
dataset: toy
dataset_dir: {data}
template: default
cutoff_len: 128
max_samples: 64
output_dir: {out}
logging_steps: 1
save_strategy: steps
save_steps: 4
overwrite_output_dir: true
report_to: none
per_device_train_batch_size: 2
gradient_accumulation_steps: 1
learning_rate: 1.0e-3
max_steps: 4
use_cpu: true
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from lorasync.train.model import ModelSource, load_base

    tmp = tmp_path_factory.mktemp("llamafactory")
    base, tok = load_base(ModelSource.resolve("tiny"))
    base.save_pretrained(tmp / "tiny")
    tok.save_pretrained(tmp / "tiny")
    data = tmp / "data"
    data.mkdir()
    rows = [{"instruction": f"add {i} and {i + 1}", "input": "", "output": str(2 * i + 1)}
            for i in range(64)]
    (data / "toy.json").write_text(json.dumps(rows))
    (data / "dataset_info.json").write_text(json.dumps({"toy": {"file_name": "toy.json"}}))
    return tmp


def run(tmp: Path, name: str, argv: list[str], env_extra=None):
    out = tmp / name
    out.mkdir()
    cfg = out / "cfg.yaml"
    cfg.write_text(CONFIG.format(model=tmp / "tiny", data=tmp / "data", out=out / "model"))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LORASYNC_", "PYTHON", "ACCELERATE_", "TORCHELASTIC"))}
    env.update(PATH=f"{BIN}:{env.get('PATH', '')}", FORCE_TORCHRUN="1", NPROC_PER_NODE="2",
               HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", **(env_extra or {}))
    p = subprocess.run([str(BIN / argv[0]), *argv[1:], "train", str(cfg)],
                       env=env, cwd=out, capture_output=True, text=True, timeout=400)
    return p, out / "model"


def log_history(model: Path):
    return json.loads((model / "trainer_state.json").read_text())["log_history"]


def lorasync_logs(history):
    return [h for h in history if any(k.startswith("lorasync/") for k in h)]


def test_the_switch_attaches_int8_to_llamafactorys_trainer(setup):
    p, model = run(setup, "int8", ["llamafactory-cli"], {"LORASYNC_STRATEGY": "int8"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    steps = [h for h in lorasync_logs(log_history(model)) if "lorasync/wire_bytes" in h]
    assert [h["step"] for h in steps] == [1, 2, 3, 4], log_history(model)
    assert all(h["lorasync/strategy"] == "int8" and h["lorasync/world_size"] == 2 for h in steps)
    # int8 sends fewer bytes per sync than the fp32 gradient it stands for
    assert steps[0]["lorasync/compression"] > 2
    assert steps[-1]["lorasync/syncs"] == 4
    # the adapter LLaMA-Factory saves is a PEFT adapter, as without lorasync
    assert (model / "adapter_model.safetensors").exists()


def test_lorasync_run_with_diloco_leaves_identical_replicas(setup):
    p, model = run(setup, "diloco", ["lorasync", "run", "--strategy", "diloco",
                                     "--comm-opt", "period=2", "--", "llamafactory-cli"])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    logs = lorasync_logs(log_history(model))
    assert logs and logs[-1]["lorasync/strategy"] == "diloco", logs
    # the checkpoint at step 4 (an outer sync every 2 steps) holds each rank's own
    # replica (DiLoCo's replicas differ between syncs): here they agree
    folder = model / "checkpoint-4" / "lorasync"
    r0, r1 = (torch.load(folder / f"rank-{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["adapter"].keys() == r1["adapter"].keys() and r0["adapter"]
    for k in r0["adapter"]:
        assert torch.equal(r0["adapter"][k], r1["adapter"][k]), k


def test_unset_llamafactory_trains_without_lorasync(setup):
    p, model = run(setup, "plain", ["llamafactory-cli"])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    history = log_history(model)
    assert [h["step"] for h in history if "loss" in h] == [1, 2, 3, 4]
    assert not lorasync_logs(history)
    assert not (model / "checkpoint-4" / "lorasync").exists()


def test_a_bad_option_stops_llamafactory_before_any_worker(setup):
    p, model = run(setup, "bad", ["llamafactory-cli"],
                   {"LORASYNC_STRATEGY": "int8", "LORASYNC_OPTIONS": "blocks=3"})
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-4000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("lorasync: error:")]
    assert len(errors) == 1 and "'blocks'" in errors[0] and "'block'" in errors[0], p.stderr
    assert "Traceback" not in p.stderr
    assert not model.exists()


def test_the_llamafactory_interface_tests_pass_in_its_environment():
    """tests/unit/test_switch.py's LLaMA-Factory test (the example YAML parsed by
    LLaMA-Factory's own argument classes) skips in lorasync's environment; here
    it runs in LLaMA-Factory's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LORASYNC_", "PYTEST"))}
    env.update(PYTHONPATH=str(ROOT / "src"), HF_HUB_OFFLINE="1")
    p = subprocess.run([str(BIN / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        str(ROOT / "tests" / "unit" / "test_switch.py"), "-k", "llamafactory"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "1 passed" in p.stdout and "skipped" not in p.stdout, p.stdout[-1500:]
