"""lorasync.hf in real clients: TRL SFTTrainer and transformers Trainer scripts
on 2 gloo ranks under torchrun and accelerate launch (tiny model, generated
data); the scripts are in _hf_clients.py (the SFT one is examples/hf_sft.py)."""

import json
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, cli_env

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]
pytest.importorskip("trl", reason="the lorasync[hf] extra (trl, accelerate) is not installed")

CLIENTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_hf_clients.py")


def launch(job, dump, *specs, accelerate=False, timeout=420, **env):
    if accelerate:
        cmd = [os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch",
               "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
               str(free_port())]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2"]
    p = subprocess.run([*cmd, CLIENTS, job, str(dump), *specs], env=cli_env(**env),
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return p


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ranks(dump, name):
    return [torch.load(os.path.join(dump, name, f"rank-{r}.pt"), weights_only=False)
            for r in (0, 1)]


def same_tensors(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def equal_states(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            equal_states(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal_states(x, y) for x, y in zip(a, b))
    return a == b


def train_logs(history):
    return [h for h in history if "loss" in h]


def any_nonzero_tensor(v):
    if isinstance(v, torch.Tensor):
        return v.is_floating_point() and bool(v.abs().max() > 0)
    if isinstance(v, dict):
        return any(any_nonzero_tensor(x) for x in v.values())
    return False


# --------------------------------------------------------------------------- TRL SFTTrainer

@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    dump = tmp_path_factory.mktemp("sft")
    launch("sft", dump, "ar:allreduce", "i8:int8")
    return dump


def test_sft_trainer_trains_with_identical_adapters(sft):
    for name, strategy in (("ar", "allreduce"), ("i8", "int8")):
        r0, r1 = ranks(sft, name)
        assert same_tensors(r0["adapter"], r1["adapter"]), f"{name}: adapters differ"
        logs = train_logs(r0["log_history"])
        assert logs[-1]["loss"] < logs[0]["loss"] - 0.05, [h["loss"] for h in logs]
        # the ranks built the same adapter (torch's default seed): the hash check
        # passed and nothing else was sent before the first step
        assert r0["startup_bytes"] == r1["startup_bytes"] == 16
        assert r0["stats"]["strategy"] == strategy and r0["stats"]["syncs"] == 24


def test_sft_int8_sends_fewer_bytes_than_allreduce(sft):
    ar, i8 = ranks(sft, "ar")[0], ranks(sft, "i8")[0]
    assert ar["stats"]["wire_bytes"] == ar["stats"]["fp32_bytes"]
    assert i8["stats"]["wire_bytes"] < 0.5 * ar["stats"]["wire_bytes"]
    per_step = [h["lorasync/wire_bytes"] for h in train_logs(i8["log_history"])]
    assert per_step and all(0 < b < 0.5 * ar["stats"]["fp32_bytes"] / 24 for b in per_step)


def test_sft_log_history_carries_lorasync_metrics(sft):
    for name, strategy in (("ar", "allreduce"), ("i8", "int8")):
        hist = ranks(sft, name)[0]["log_history"]
        logs = train_logs(hist)
        assert len(logs) == 6   # logging_steps=4 of 24
        for h in logs:
            assert h["lorasync/strategy"] == strategy
            assert h["lorasync/wire_bytes"] > 0 and h["lorasync/comm_s"] >= 0
            assert 0 <= h["lorasync/sync_share"] <= 1 and h["lorasync/step_s"] > 0
        assert [h["lorasync/syncs"] for h in logs] == [4, 8, 12, 16, 20, 24]
        final = hist[-1]
        assert "train_runtime" in final and final["lorasync/startup_bytes"] == 16
        assert final["lorasync/wire_bytes_total"] == ranks(sft, name)[0]["stats"]["wire_bytes"]


def test_docs_show_the_tested_sft_script():
    """docs/huggingface.md shows examples/hf_sft.py as it is (the script tested here)."""
    with open(os.path.join(ROOT, "examples", "hf_sft.py")) as fh:
        script = fh.read()
    with open(os.path.join(ROOT, "docs", "huggingface.md")) as fh:
        doc = fh.read()
    blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
    assert script in blocks


# --------------------------------------------------------------------------- plain Trainer

RESUME_SPECS = ("i8:int8:steps=6,save=3", "dl:diloco:period=2,steps=6,save=3",
                "au:auto:probe=live,measure_steps=1,interval=2,steps=6,save=3")


#: the other strategies, briefly: (spec, strategy, compresses)
EVERY_STRATEGIES = [("s-fp16:fp16:steps=6", "fp16", True), ("s-bf16:bf16:steps=6", "bf16", True),
                    ("s-onebit:onebit:steps=8,warmup_steps=3", "onebit", True),
                    ("s-topk:topk:steps=6", "topk", True),
                    ("s-powersgd:powersgd:steps=6", "powersgd", True),
                    ("s-local:local:steps=6,period=3", "local", True)]
EVERY = [spec for spec, _, _ in EVERY_STRATEGIES]


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    dump = tmp_path_factory.mktemp("trainer")
    launch("trainer", dump, "dl:diloco:period=4,perturb=true",
           "au:auto:probe=live,measure_steps=2,interval=4,force_switch_at=10:int8",
           "ga1:allreduce:steps=16", "ga2:allreduce:steps=8,ga=2,keep_token_average=true",
           "plain:allreduce:attach=false,perturb=true,steps=2", "badopt:int8:block=0",
           *EVERY, *(f"first-{s}" for s in RESUME_SPECS))
    return dump


@pytest.mark.parametrize("name,strategy", [("dl", "diloco"), ("au", "auto")])
def test_trainer_periodic_and_auto_end_identical(trainer, name, strategy):
    r0, r1 = ranks(trainer, name)
    assert same_tensors(r0["adapter"], r1["adapter"]), f"{name}: adapters differ"
    logs = train_logs(r0["log_history"])
    assert logs[-1]["loss"] < logs[0]["loss"] - 0.05
    assert r0["stats"]["steps"] == 16
    # the step records and the final sync (timed apart) account for every byte sent
    # once training began; before it only auto sends: its start probe, at attach
    final = r0["log_history"][-1]
    assert final["lorasync/final_sync_s"] >= 0
    before = r0["stats"]["wire_bytes"] - final["lorasync/final_sync_bytes"] \
        - sum(r["wire_bytes"] for r in r0["records"])
    assert before > 0 if strategy == "auto" else before == 0
    if strategy == "diloco":
        # outer steps on the Trainer's optimizer steps 4, 8, 12, 16; nothing sent between
        assert r0["stats"]["syncs"] == 4
        sent = [r["step"] for r in r0["records"] if r["wire_bytes"]]
        assert sent == [4, 8, 12, 16]
        assert all(h["lorasync/strategy"] == "diloco" for h in logs)


@pytest.mark.parametrize("spec,strategy,compresses", EVERY_STRATEGIES,
                         ids=[s for _, s, _ in EVERY_STRATEGIES])
def test_trainer_runs_every_strategy(trainer, spec, strategy, compresses):
    name = spec.split(":")[0]
    r0, r1 = ranks(trainer, name)
    assert same_tensors(r0["adapter"], r1["adapter"]), f"{strategy}: adapters differ"
    st = r0["stats"]
    assert st["strategy"] == strategy and st["syncs"] >= 2
    if compresses:
        assert 0 < st["wire_bytes"] < st["fp32_bytes"]
    logs = train_logs(r0["log_history"])
    assert all(h["lorasync/strategy"] == strategy for h in logs)
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    if strategy == "onebit":
        # 1-bit Adam on the Trainer's AdamW: after 3 warm-up steps the variance
        # is frozen and momentum travels as signs
        assert {"momentum", "adam_denom"} <= set(r0["state_keys"])


def test_trainer_log_history_has_auto_switches_with_reasons(trainer):
    hist = ranks(trainer, "au")[0]["log_history"]
    switches = [h["lorasync/switch"] for h in train_logs(hist) if "lorasync/switch" in h]
    assert any("-> int8" in s and "step 10" in s for s in switches), switches
    assert all(re.search(r"-> \w+: \S", s) for s in switches)   # each with its reason
    at10 = next(h for h in train_logs(hist) if h["step"] == 10)
    assert at10["lorasync/strategy"] == "int8"


def test_grad_accum_2_halves_the_sync_count(trainer):
    """16 micro-batches each: 1 per step syncs 16 times, 2 per step (the first
    under no_sync) 8 times, with half the bytes."""
    one, two = ranks(trainer, "ga1")[0], ranks(trainer, "ga2")[0]
    assert one["stats"]["syncs"] == 16 and two["stats"]["syncs"] == 8
    assert two["stats"]["wire_bytes"] * 2 == one["stats"]["wire_bytes"]
    assert {r["grad_accum"] for r in two["records"]} == {2}
    assert same_tensors(*(r["adapter"] for r in ranks(trainer, "ga2")))


def test_attach_turns_off_the_per_step_token_count_gather(trainer):
    """average_tokens_across_devices all-gathers token counts before every forward;
    attach turns it off unless told to keep it, and plain Trainer DDP keeps it."""
    assert [r["token_average"] for r in ranks(trainer, "ga1")] == [False, False]
    assert [r["token_average"] for r in ranks(trainer, "ga2")] == [True, True]
    assert [r["token_average"] for r in ranks(trainer, "plain")] == [True, True]


def test_no_startup_broadcast_of_frozen_weights(trainer):
    """Rank 1 changed a frozen base weight before training: plain Trainer DDP
    overwrites it with rank 0's at start-up, lorasync leaves the base alone."""
    d0, d1 = ranks(trainer, "dl")
    assert not torch.equal(d0["frozen"], d1["frozen"])
    assert d0["startup_bytes"] == 16
    p0, p1 = ranks(trainer, "plain")
    assert torch.equal(p0["frozen"], p1["frozen"])


def test_bad_option_value_fails_before_the_first_step(trainer):
    r0, r1 = ranks(trainer, "badopt")
    for r in (r0, r1):
        assert r["error"].startswith("AttachError") and "int8.block: invalid value 0" in r["error"]


# --------------------------------------------------------------------------- resume

@pytest.fixture(scope="module")
def resumed(trainer, tmp_path_factory):
    """The runs "first-*" of the trainer fixture wrote checkpoint-3 and went on
    to step 6; these resume from checkpoint-3 in a new process."""
    again = tmp_path_factory.mktemp("again")
    p = launch("trainer", again, *(f"first-{s}" for s in RESUME_SPECS), HF_RESUME=str(trainer))
    return trainer, again, p


@pytest.mark.parametrize("name", ["i8", "dl", "au"])
def test_resume_restores_strategy_state(resumed, name):
    first, again, p = resumed
    name = f"first-{name}"
    ckpt = os.path.join(first, name, "out", "checkpoint-3", "lorasync")
    with open(os.path.join(ckpt, "meta.json")) as fh:
        assert json.load(fh)["step"] == 3
    for r in (0, 1):
        saved = torch.load(os.path.join(ckpt, f"rank-{r}.pt"), weights_only=False)
        after = ranks(again, name)[r]
        assert equal_states(saved["sync"], after["resumed_state"]), f"{name} rank {r}"
        if name == "first-au":   # a decision made (and what it measured) to restore
            assert not saved["sync"]["measuring"] and saved["sync"]["net"]
        else:   # error feedback, DiLoCo's anchor and momentum
            assert any_nonzero_tensor(saved["sync"])
        if name != "first-au":
            # the same run as the uninterrupted one, bit for bit
            assert same_tensors(ranks(first, name)[r]["adapter"], after["adapter"])
    strategy = dict(i8="int8", dl="diloco", au="auto")[name.split("-")[1]]
    assert f"resumed {strategy} state from {os.path.join(first, name, 'out', 'checkpoint-3')}" \
        in p.stderr


# --------------------------------------------------------------------------- accelerate

@pytest.fixture(scope="module")
def accel(tmp_path_factory):
    dump = tmp_path_factory.mktemp("accel")
    launch("accelerate", dump, "tr:int8:steps=6", accelerate=True)
    return dump


def test_accelerate_helper_and_prepared_model(accel):
    for mode in ("helper", "prepared"):
        r0, r1 = ranks(accel, mode)
        assert same_tensors(r0["adapter"], r1["adapter"]), mode
        # 16 micro-batches, accumulation 2: one int8 sync per optimizer step
        assert r0["stats"]["syncs"] == 8 and r0["stats"]["strategy"] == "int8"
        assert r0["stats"]["wire_bytes"] < 0.5 * r0["stats"]["fp32_bytes"]
    # the ranks initialised different adapters: the helper broadcast rank 0's
    # (adapter only: 16 hash bytes + 2 layers x q,v x (A 8x64 + B 32x8 or 64x8) x 4 bytes)
    assert ranks(accel, "helper")[0]["startup_bytes"] > 16
    assert same_tensors(ranks(accel, "helper")[0]["adapter"], ranks(accel, "prepared")[0]["adapter"])


def test_trainer_under_accelerate_launch(accel):
    r0, r1 = ranks(accel, "tr")
    assert same_tensors(r0["adapter"], r1["adapter"])
    assert r0["stats"]["syncs"] == 6 and r0["startup_bytes"] == 16


# --------------------------------------------------------------------------- bad input

def test_bad_inputs_raise_value_errors_naming_the_fix(tmp_path):
    env = cli_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    p = subprocess.run([sys.executable, CLIENTS, "bad", str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    with open(tmp_path / "bad.json") as fh:
        got = json.load(fh)
    expected = {
        "unknown_strategy": ["unknown name 'fastest'", "choose one of", "int8"],
        "unknown_option": ["'blocks'", "did you mean 'block'", "int8 takes: warmup_steps, block"],
        "no_peft": ["without a PEFT adapter", "get_peft_model", "peft_config="],
        "fsdp": ["FSDP is on", "remove the fsdp settings"],
        "deepspeed": ["DeepSpeed is on", "remove the deepspeed settings"],
        "while_training": ["already training", "before trainer.train()"],
        "after_training": ["already wrapped", "freshly built Trainer"],
        "twice": ["already attached"],
        "not_a_trainer": ["transformers.Trainer", "lorasync.attach(ddp_model"],
    }
    for case, parts in expected.items():
        msg = got[case]
        assert msg is not None and msg.startswith("AttachError"), (case, msg)
        for part in parts:
            assert part in msg, (case, part, msg)
