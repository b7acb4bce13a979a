"""A real ``axolotl train`` on 2 gloo ranks with lorasync: through its plugin
(YAML keys) and through the switch (``LORASYNC_STRATEGY``, no plugin).

axolotl 0.19.0 pins its own transformers, PEFT, TRL, accelerate and datasets,
so it lives in an environment of its own, ``.venv-axolotl``, that ``make test``
builds (tests/fixtures/axolotl/requirements.txt); lorasync is installed into it
without dependencies.  Without that environment these tests skip and say how to
build it.  On CPU the test adds a plugin of its own (tests/fixtures/axolotl/
cpu_ranks.py): axolotl puts each rank's model on GPU number LOCAL_RANK."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("LORASYNC_AXOLOTL_VENV", ROOT / ".venv-axolotl"))
PYTHON = VENV / "bin" / "python"

pytestmark = pytest.mark.skipif(
    not (VENV / ".installed").exists(),
    reason=f"axolotl's environment {VENV} is not built (`make axolotl-env`; it needs the "
           "package index: axolotl pins its own transformers/PEFT/TRL, so it is not installed "
           "into lorasync's environment)")

CONFIG = """\
base_model: {model}
tokenizer_type: PreTrainedTokenizerFast
plugins:
  - cpu_ranks.CpuRanksPlugin
{lorasync}adapter: lora
lora_r: 8
lora_alpha: 16
lora_dropout: 0.0
lora_target_modules: [q_proj, v_proj]
lora_mlp_kernel: false
lora_qkv_kernel: false
lora_o_kernel: false
datasets:
  - path: {data}
    ds_type: json
    type: alpaca
val_set_size: 0
sequence_len: 512
micro_batch_size: 2
gradient_accumulation_steps: 1
max_steps: 4
num_epochs: 1
learning_rate: 0.001
optimizer: adamw_torch
lr_scheduler: cosine
bf16: false
fp16: false
tf32: false
output_dir: {out}
logging_steps: 1
save_strategy: "no"
dataset_prepared_path: {prepared}
special_tokens:
  pad_token: "<pad>"
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from lorasync.train.model import ModelSource, load_base

    tmp = tmp_path_factory.mktemp("axolotl")
    base, tok = load_base(ModelSource.resolve("tiny"))
    base.save_pretrained(tmp / "tiny")
    tok.save_pretrained(tmp / "tiny")
    with open(tmp / "data.jsonl", "w") as fh:
        for i in range(64):
            fh.write(json.dumps({"instruction": f"add {i} and {i + 1}", "input": "",
                                 "output": str(2 * i + 1)}) + "\n")
    return tmp


def axolotl_train(tmp: Path, name: str, lorasync_yaml: str = "", env_extra=None):
    out = tmp / name
    out.mkdir()
    cfg = out / "cfg.yaml"
    cfg.write_text(CONFIG.format(model=tmp / "tiny", data=tmp / "data.jsonl", out=out / "model",
                                 prepared=tmp / "prepared", lorasync=lorasync_yaml))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LORASYNC_", "PYTHON", "ACCELERATE_", "TORCHELASTIC"))}
    env.update(PYTHONPATH=str(ROOT / "tests" / "fixtures" / "axolotl"), ACCELERATE_USE_CPU="1",
               AXOLOTL_DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               LORASYNC_TEST_OUT=str(out), **(env_extra or {}))
    p = subprocess.run([str(PYTHON), "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", "-m", "axolotl.cli.train", str(cfg)],
                       env=env, cwd=out, capture_output=True, text=True, timeout=400)
    return p, out


def ranks(out: Path):
    return [torch.load(out / f"rank-{r}.pt", weights_only=False) for r in (0, 1)]


def lorasync_logs(history):
    return [h for h in history if any(k.startswith("lorasync/") for k in h)]


def test_the_plugin_trains_with_int8_on_two_ranks(setup):
    p, out = axolotl_train(setup, "plugin", "  - lorasync.integrations.axolotl.LorasyncPlugin\n"
                           "lorasync_strategy: int8\n")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    r0, r1 = ranks(out)
    logs = lorasync_logs(r0["log_history"])
    assert logs and logs[-1]["lorasync/strategy"] == "int8", r0["log_history"]
    assert logs[-1]["lorasync/wire_bytes_total"] > 0
    assert logs[0]["lorasync/world_size"] == 2
    # int8 sends fewer bytes per sync than the fp32 gradient it stands for
    assert logs[0]["lorasync/compression"] > 2
    # per-step sync: every rank holds the same adapter after every step
    assert r0["adapter"].keys() == r1["adapter"].keys() and r0["adapter"]
    for k in r0["adapter"]:
        assert torch.equal(r0["adapter"][k], r1["adapter"][k]), k
    assert (out / "model" / "adapter_model.safetensors").exists()


def test_the_switch_attaches_without_the_plugin(setup):
    p, out = axolotl_train(setup, "switch", env_extra={"LORASYNC_STRATEGY": "diloco",
                                                       "LORASYNC_OPTIONS": "period=2"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    r0, r1 = ranks(out)
    logs = lorasync_logs(r0["log_history"])
    assert logs and logs[-1]["lorasync/strategy"] == "diloco", r0["log_history"]
    # 4 steps, an outer sync every 2 (the last one at the end): the replicas agree
    for k in r0["adapter"]:
        assert torch.equal(r0["adapter"][k], r1["adapter"][k]), k


def test_a_misspelt_option_stops_axolotl_before_training(setup):
    p, out = axolotl_train(setup, "bad", "  - lorasync.integrations.axolotl.LorasyncPlugin\n"
                           "lorasync_strategy: diloco\nlorasync_options:\n  perod: 8\n")
    assert p.returncode != 0
    text = p.stdout + p.stderr
    assert "perod" in text and "period" in text, text[-3000:]
    assert not (out / "rank-0.pt").exists()


def test_the_plugin_interface_tests_pass_in_axolotls_environment():
    """tests/unit/test_switch.py's axolotl tests (the plugin through axolotl's
    PluginManager and validate_config, post_trainer_create on a real Trainer)
    skip in lorasync's environment; here they run in axolotl's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LORASYNC_", "PYTEST"))}
    env.update(PYTHONPATH=str(ROOT / "src"), AXOLOTL_DO_NOT_TRACK="1", HF_HUB_OFFLINE="1")
    p = subprocess.run([str(PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        str(ROOT / "tests" / "unit" / "test_switch.py"), "-k", "axolotl"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "3 passed" in p.stdout and "skipped" not in p.stdout, p.stdout[-1500:]
