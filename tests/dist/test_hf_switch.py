"""The switch end to end: a plain TRL SFTTrainer script that never imports
lorasync, on 2 gloo ranks, in a fresh environment whose site-packages holds
the start-up hook file as the package ships it (tiny model, generated data).

* ``lorasync run --strategy int8 -- torchrun ...``: lorasync/* metrics in the
  Trainer's log history, identical adapters on both ranks;
* ``LORASYNC_STRATEGY=allreduce accelerate launch ...``: the same under
  accelerate, and int8 sent fewer bytes than fp32;
* unset: the script trains with the Trainer's own DDP and lorasync was never
  imported (``sys.modules``);
* a bad name: the launcher fails at start-up, one line, exit code 2, no worker.

attach's errors at ``train()`` (a model without adapter ...) are
tests/unit/test_switch.py's, in one process.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import ROOT, cli_env

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]
pytest.importorskip("trl", reason="the lorasync[hf] extra (trl, accelerate) is not installed")

#: the user's script: TRL as it is, no lorasync anywhere
SCRIPT = textwrap.dedent('''
    import json, os, sys
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    model_dir, data, out = sys.argv[1:4]
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with open(data) as fh:
        rows = json.load(fh)
    torch.manual_seed(0)
    peft = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    args = SFTConfig(output_dir=os.path.join(out, "run"), max_steps=6,
                     per_device_train_batch_size=4, learning_rate=5e-3, max_length=64,
                     logging_steps=2, save_strategy="no", report_to=[], disable_tqdm=True,
                     seed=0, use_cpu=True)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=tok, peft_config=peft)
    trainer.train()
    adapter = {n: p.detach().cpu().clone() for n, p in trainer.model.named_parameters()
               if p.requires_grad}
    torch.save({"adapter": adapter, "log_history": trainer.state.log_history,
                "lorasync_modules": sorted(m for m in sys.modules
                                           if m.split(".")[0] == "lorasync")},
               os.path.join(out, "rank-%s.pt" % os.environ["RANK"]))
''')


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A fresh venv whose site-packages has the hook file (as installed) and
    reaches this environment's packages; the tiny model and the data on disk."""
    from lorasync.integrations import switch
    from lorasync.train.data import demo_rows
    from lorasync.train.model import ModelSource, load_base

    tmp = tmp_path_factory.mktemp("switch")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # "00-": before the hook in site's (alphabetical) order, as packages are in a real install
    shared = [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]
    with open(os.path.join(site, "00-shared.pth"), "w") as fh:
        fh.write("\n".join(shared) + "\n")
    with open(switch.hook_source()) as src, open(os.path.join(site, switch.HOOK_FILE), "w") as dst:
        dst.write(src.read())
    base, tok = load_base(ModelSource.resolve("tiny"))
    model_dir = tmp / "tiny"
    base.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    rows, _ = demo_rows(200, 0)
    (tmp / "data.json").write_text(json.dumps(rows))
    (tmp / "sft.py").write_text(SCRIPT)
    return {"tmp": tmp, "python": python}


def run(env, name, *launcher, extra_env=None, expect=0):
    out = env["tmp"] / name
    out.mkdir()
    e = cli_env(PYTHONPATH=os.path.join(ROOT, "src"), **(extra_env or {}))
    for k in ("LORASYNC_STRATEGY", "LORASYNC_OPTIONS"):
        if k not in (extra_env or {}):
            e.pop(k, None)
    cmd = [*launcher, str(env["tmp"] / "sft.py"), str(env["tmp"] / "tiny"),
           str(env["tmp"] / "data.json"), str(out)]
    p = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=400)
    assert p.returncode == expect, p.stdout[-2000:] + p.stderr[-4000:]
    ranks = [torch.load(out / f"rank-{r}.pt", weights_only=False) for r in (0, 1)] \
        if expect == 0 else None
    return p, ranks


def torchrun(env):
    return [env["python"], "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def accelerate(env):
    return [env["python"], "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
            "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port())]


@pytest.fixture(scope="module")
def runs(env):
    """The three training runs (about 15 s each on 2 cores)."""
    _, int8 = run(env, "int8", env["python"], "-m", "lorasync", "run", "--strategy", "int8",
                  "--", *torchrun(env))
    _, ar = run(env, "allreduce", *accelerate(env), extra_env={"LORASYNC_STRATEGY": "allreduce"})
    _, plain = run(env, "plain", *torchrun(env))
    return {"int8": int8, "allreduce": ar, "plain": plain}


def train_logs(history):
    return [h for h in history if "loss" in h]


@pytest.mark.parametrize("name", ["int8", "allreduce"])
def test_switch_attaches_on_every_rank(runs, name):
    r0, r1 = runs[name]
    for r in (r0, r1):
        assert "lorasync.hf" in r["lorasync_modules"]
    a, b = r0["adapter"], r1["adapter"]
    assert a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), \
        f"{name}: adapters differ between ranks"
    logs = train_logs(r0["log_history"])
    assert len(logs) == 3   # logging_steps=2 of 6
    for h in logs:
        assert h["lorasync/strategy"] == name and h["lorasync/wire_bytes"] > 0
        assert h["lorasync/syncs"] > 0 and h["lorasync/step_s"] > 0
    assert runs[name][0]["log_history"][-1]["lorasync/wire_bytes_total"] > 0


def test_switch_int8_sends_fewer_bytes_than_fp32(runs):
    i8 = runs["int8"][0]["log_history"][-1]["lorasync/wire_bytes_total"]
    fp32 = runs["allreduce"][0]["log_history"][-1]["lorasync/wire_bytes_total"]
    assert 0 < i8 < 0.5 * fp32, (i8, fp32)


def test_switch_unset_imports_nothing_and_changes_nothing(runs):
    r0, r1 = runs["plain"]
    assert r0["lorasync_modules"] == [] and r1["lorasync_modules"] == []
    assert not any(k.startswith("lorasync/") for h in r0["log_history"] for k in h)
    # the Trainer's own DDP trained: the replicas agree
    assert all(torch.equal(r0["adapter"][k], r1["adapter"][k]) for k in r0["adapter"])


def test_switch_bad_name_fails_in_the_launcher_with_one_line(env):
    p, _ = run(env, "bad-name", *torchrun(env), extra_env={"LORASYNC_STRATEGY": "fastest"},
               expect=2)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("lorasync: error: strategy: unknown name 'fastest'; choose one of")
    assert "LORASYNC_STRATEGY='fastest'" in lines[0]
