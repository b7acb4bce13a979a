"""The switch (LORASYNC_STRATEGY), ``lorasync run``, the hook's packaging and
axolotl's plugin, in this process or one short subprocess each; the switch on
2 ranks under torchrun and accelerate is tests/dist/test_hf_switch.py.

The axolotl tests import the real axolotl.  It is not installed into the
project's environment (it pins its own transformers, PEFT and TRL); ``make
test`` builds its environment, ``.venv-axolotl``, and
tests/dist/test_axolotl_train.py runs these tests there, as

    PYTHONPATH=src .venv-axolotl/bin/python -m pytest tests/unit/test_switch.py -k axolotl

LLaMA-Factory's example config test runs the same way in ``.venv-llamafactory``
(``-k llamafactory``; tests/dist/test_llamafactory_train.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT, cli_env
from lorasync import catalog
from lorasync.cli import main
from lorasync.errors import ConfigError, LorasyncError
from lorasync.integrations import run_cli, switch
from lorasync.integrations.switch import SwitchError

# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize("text,expected", [
    ("", {}),
    ("period=8,streaming=true", {"period": 8, "streaming": True}),
    ("candidates=int8,diloco,diloco.period=4", {"candidates": "int8,diloco", "diloco.period": 4}),
    (" ratio = 0.01 ", {"ratio": 0.01}),
    ("delta_dtype=fp16", {"delta_dtype": "fp16"}),
])
def test_parse_options(text, expected):
    assert switch.parse_options(text) == expected
    assert switch.parse_options(switch.format_options(expected)) == expected


@pytest.mark.parametrize("text,words", [
    ("period", "'period' is not key=value"),
    ("=8", "an option has no name"),
    ("period=[", "is not a value"),
])
def test_parse_options_errors_name_the_variable_and_the_fix(text, words):
    with pytest.raises(SwitchError, match="LORASYNC_OPTIONS") as e:
        switch.parse_options(text)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_settings_from_the_environment():
    assert switch.settings({}) is None
    assert switch.settings({"LORASYNC_STRATEGY": " "}) is None
    assert switch.settings({"LORASYNC_STRATEGY": "diloco",
                            "LORASYNC_OPTIONS": "period=4,keep_token_average=true"}) == \
        ("diloco", {"period": 4}, {"keep_token_average": True})
    with pytest.raises(SwitchError, match="keep_token_average=3: use true or false"):
        switch.settings({"LORASYNC_STRATEGY": "int8", "LORASYNC_OPTIONS": "keep_token_average=3"})


BAD = [("fastest", {}), ("int8", {"blocks": 3}), ("int8", {"block": 0}),
       ("diloco", {"period": "often"}), ("auto", {"nope.period": 2}),
       ("auto", {"diloco.perod": 2}), ("topk", {"ratio": 2.0})]


@pytest.mark.parametrize("strategy,options", BAD)
def test_check_says_what_attach_says(strategy, options):
    """The start-up check (torch-free, on the catalog) raises attach's own message."""
    hf = pytest.importorskip("lorasync.hf")
    with pytest.raises(hf.AttachError) as want:
        hf._check_strategy(strategy, options)
    with pytest.raises(SwitchError) as got:
        switch.check(strategy, options)
    assert str(got.value) == str(want.value)


def test_check_knows_the_registered_strategies():
    from lorasync.comm import strategy_names

    assert catalog.names() == strategy_names()
    for name in catalog.STRATEGIES:
        switch.check(name, {})


# --------------------------------------------------------------------------- the start-up hook

def _python(code, timeout=120, **env):
    e = cli_env(PYTHONPATH=os.path.join(ROOT, "src"), **env)
    if "LORASYNC_STRATEGY" not in env:
        e.pop("LORASYNC_STRATEGY", None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=e,
                          capture_output=True, text=True, timeout=timeout)


def test_hook_line_is_inert_when_unset_and_boots_when_set():
    """The shipped .pth line, executed as site executes it."""
    line = open(switch.hook_source()).read()
    assert line.count("\n") == 1 and line.startswith("import ")
    code = f"""
        import sys
        exec({line!r})
        print(sorted(m for m in sys.modules if m.split(".")[0] == "lorasync"))
        print("torch" in sys.modules, "transformers" in sys.modules)
    """
    unset = _python(code)
    assert unset.returncode == 0 and unset.stdout.split("\n")[0] == "[]", unset.stderr
    on = _python(code, LORASYNC_STRATEGY="int8")
    assert on.returncode == 0, on.stderr
    assert "'lorasync.integrations.switch'" in on.stdout.split("\n")[0]
    assert on.stdout.split("\n")[1] == "False False"   # nothing heavy at start-up
    bad = _python(code, LORASYNC_STRATEGY="int8", LORASYNC_OPTIONS="blocks=3")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr == ("lorasync: error: int8: unknown option 'blocks'; did you mean 'block'? "
                          "(int8 takes: warmup_steps, block) (LORASYNC_STRATEGY='int8' "
                          "LORASYNC_OPTIONS='blocks=3'; fix it, or unset LORASYNC_STRATEGY to "
                          "train without lorasync)\n")


def test_import_hook_wraps_trainer_train_when_transformers_loads():
    pytest.importorskip("trl")
    p = _python("""
        import inspect, sys
        from lorasync.integrations import switch
        switch.install()
        assert "transformers" not in sys.modules
        from transformers import Trainer
        import transformers.trainer as mod
        assert Trainer.train._lorasync_switch and mod.__loader__ is not None
        assert "def train" in inspect.getsource(mod)          # the real loader still answers
        from transformers import Seq2SeqTrainer
        assert Seq2SeqTrainer.train is Trainer.train           # subclasses inherit it
        assert "lorasync.hf" not in sys.modules                 # attach loads at train()
        assert not any(isinstance(f, switch._TrainerFinder) for f in sys.meta_path)
        print("ok")
    """, LORASYNC_STRATEGY="int8")
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]


# --------------------------------------------------------------------------- train() in process

@pytest.fixture
def tiny_trainer(monkeypatch, tmp_path):
    """A one-process Trainer on the tiny model, with the switch's train() wrapper
    on transformers.Trainer for this test only; ``_fail`` raises instead of exiting."""
    pytest.importorskip("trl")
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    from lorasync.train.model import ModelSource, load_base

    monkeypatch.setattr(Trainer, "train", Trainer.train)   # restored after the test
    switch._patch(Trainer)

    class Failed(Exception):
        pass

    def fail(msg):
        raise Failed(msg)
    monkeypatch.setattr(switch, "_fail", fail)

    def make(peft=True):
        base, tok = load_base(ModelSource.resolve("tiny"))
        torch.manual_seed(0)
        model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"],
                                                task_type="CAUSAL_LM")) if peft else base
        args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1, report_to=[],
                                 use_cpu=True, remove_unused_columns=False, disable_tqdm=True,
                                 per_device_train_batch_size=2, save_strategy="no")
        data = [{"input_ids": [1, 2, 3, 4], "labels": [1, 2, 3, 4]}] * 4

        def collate(batch):
            ids = torch.tensor([b["input_ids"] for b in batch])
            return {"input_ids": ids, "labels": ids.clone()}
        return Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
    make.Failed = Failed
    return make


def test_switch_attaches_at_train_once(tiny_trainer, monkeypatch):
    import lorasync.hf as hf

    monkeypatch.setenv("LORASYNC_STRATEGY", "int8")
    monkeypatch.setenv("LORASYNC_OPTIONS", "block=64")
    t = tiny_trainer()
    assert not any(isinstance(cb, hf._Callback) for cb in t.callback_handler.callbacks)
    t.train()
    handle = t._lorasync_switch
    assert isinstance(handle, hf.HFSync) and handle.strategy == "int8"
    assert handle.options["block"] == 64
    assert isinstance(t.callback_handler.callbacks[0], hf._Callback)
    assert t.args.average_tokens_across_devices is False or t.args.world_size == 1
    switch._attach_once(t)   # what a second train() of the same Trainer runs first
    assert t._lorasync_switch is handle
    assert sum(isinstance(cb, hf._Callback) for cb in t.callback_handler.callbacks) == 1


def test_switch_leaves_a_script_that_attached_itself_alone(tiny_trainer, monkeypatch):
    import lorasync.hf as hf

    monkeypatch.setenv("LORASYNC_STRATEGY", "int8")
    t = tiny_trainer()
    mine = hf.attach(t, "fp16")
    t.train()
    cbs = [cb for cb in t.callback_handler.callbacks if isinstance(cb, hf._Callback)]
    assert len(cbs) == 1 and cbs[0].h is mine


def test_switch_fails_with_attachs_message(tiny_trainer, monkeypatch):
    monkeypatch.setenv("LORASYNC_STRATEGY", "int8")
    t = tiny_trainer(peft=False)
    with pytest.raises(tiny_trainer.Failed) as e:
        t.train()
    msg = str(e.value)
    assert msg.startswith("model: trainer.model is a LlamaForCausalLM without a PEFT adapter")
    assert msg.endswith("(LORASYNC_STRATEGY='int8'; fix it, or unset LORASYNC_STRATEGY to "
                        "train without lorasync)")


# --------------------------------------------------------------------------- lorasync run

def test_run_sets_the_variables_and_execs(monkeypatch):
    seen = {}

    def execve(path, argv, env):
        seen.update(path=path, argv=argv, env=env)
        raise SystemExit(0)
    monkeypatch.setattr(os, "execve", execve)
    monkeypatch.setattr(switch, "hook_installed", lambda: "/site/lorasync-switch.pth")
    with pytest.raises(SystemExit):
        main(["run", "--strategy", "auto", "--comm-opt", "candidates=int8,diloco",
              "--comm-opt", "diloco.period=4", "--keep-token-average", "--", "env", "-0"])
    assert seen["path"] == shutil.which("env") and seen["argv"] == ["env", "-0"]
    assert seen["env"]["LORASYNC_STRATEGY"] == "auto"
    assert seen["env"]["LORASYNC_OPTIONS"] == \
        "candidates=int8,diloco,diloco.period=4,keep_token_average=true"
    assert switch.settings(seen["env"]) == (
        "auto", {"candidates": "int8,diloco", "diloco.period": 4}, {"keep_token_average": True})


@pytest.mark.parametrize("argv,words", [
    (["run", "--strategy", "fastest", "--", "env"], "strategy: unknown name 'fastest'"),
    (["run", "--strategy", "int8", "--comm-opt", "blocks=2", "--", "env"],
     "int8: unknown option 'blocks'"),
    (["run", "--strategy", "int8"], "command: invalid value '': give the command"),
    (["run", "--", "no-such-program-here"], "not found on PATH"),
])
def test_run_bad_input_one_line_exit_2(argv, words, capsys, monkeypatch):
    monkeypatch.setattr(switch, "hook_installed", lambda: "/site/lorasync-switch.pth")
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("exec'd"))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("lorasync run: error: ") and words in err and err.count("\n") == 1


def test_run_refuses_without_the_hook(capsys, monkeypatch):
    monkeypatch.setattr(switch, "hook_installed", lambda: None)
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("exec'd"))
    assert main(["run", "--", "env"]) == 2
    assert "lorasync-switch.pth) is not in this Python's site-packages" in capsys.readouterr().err


# --------------------------------------------------------------------------- packaging

def _installed_lorasync() -> list[str]:
    """The files pip lists for this environment's lorasync (empty if none)."""
    p = subprocess.run([sys.executable, "-m", "pip", "show", "-f", "lorasync"],
                       capture_output=True, text=True, timeout=120)
    return sorted(line.strip() for line in p.stdout.splitlines() if line.startswith("  "))


def test_editable_install_puts_the_hook_into_site_packages(tmp_path):
    """``pip install -e`` (make install) installs the hook file (setup.py) into the
    environment's site-packages, where site runs it; a copy of the project is
    installed (offline, no build isolation) under a scratch prefix."""
    pytest.importorskip("setuptools", minversion="64")
    proj = tmp_path / "proj"
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(os.path.join(ROOT, name), proj / name if proj.exists() else
                    (proj.mkdir() or proj / name))
    shutil.copytree(os.path.join(ROOT, "src"), proj / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    prefix = tmp_path / "prefix"
    # --ignore-installed: without it pip uninstalls this environment's own lorasync (the same
    # name, found on sys.path) before installing the copy under the prefix
    before = _installed_lorasync()
    p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                        "--no-build-isolation", "--ignore-installed", "--prefix", str(prefix),
                        "-e", str(proj)], capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert _installed_lorasync() == before   # the environment's own install is untouched
    found = sorted(str(f.relative_to(prefix)) for f in prefix.rglob(switch.HOOK_FILE))
    assert found == [f"lib/python{sys.version_info[0]}.{sys.version_info[1]}/site-packages/"
                     f"{switch.HOOK_FILE}"], found
    assert (prefix / found[0]).read_text() == open(switch.hook_source()).read()


# --------------------------------------------------------------------------- axolotl

AXOLOTL_SKIP = ("axolotl is not installed here: it pins its own torch, so it is kept out of "
                "the project's environment; see this module's docstring to run these tests "
                "against it (written and run against axolotl 0.19.0)")


def test_axolotl_args_check_the_yaml_keys():
    """The pydantic model axolotl mixes into its config (pydantic alone)."""
    pytest.importorskip("pydantic")
    from pydantic import ValidationError

    from lorasync.integrations.axolotl_args import LorasyncArgs

    ok = {"adapter": "lora", "lorasync_strategy": "diloco", "lorasync_options": {"period": 4}}
    assert LorasyncArgs(**ok).lorasync_options == {"period": 4}
    assert LorasyncArgs().lorasync_strategy is None
    for extra, words in [
        ({"lorasync_strategy": "fastest"}, "lorasync_strategy: strategy: unknown name 'fastest'"),
        ({"lorasync_options": {"periodd": 4}}, "unknown option 'periodd'; did you mean 'period'?"),
        ({"lorasync_strategy": None}, "lorasync_options: set without lorasync_strategy"),
        ({"deepspeed": "zero2.json"}, "DeepSpeed is on (deepspeed)"),
        ({"fsdp_config": {"fsdp_version": 2}}, "FSDP is on (fsdp_config)"),
        ({"adapter": None}, "adapter is None; lorasync syncs a LoRA adapter only"),
        ({"lorasync_options": {"keep_token_average": "yes"}}, "use true or false"),
    ]:
        with pytest.raises(ValidationError, match="lorasync") as e:
            LorasyncArgs(**{**ok, **extra})
        assert words in str(e.value), (extra, str(e.value))


@pytest.fixture(scope="module")
def axolotl_plugins():
    pytest.importorskip("axolotl.integrations.base", reason=AXOLOTL_SKIP)
    from axolotl.integrations.base import PluginManager

    pm = PluginManager.get_instance()
    pm.register("lorasync.integrations.axolotl.LorasyncPlugin")
    return pm


def test_axolotl_plugin_loads_and_validates_through_axolotl(axolotl_plugins):
    from axolotl.integrations.base import BasePlugin
    from axolotl.utils.config import validate_config
    from axolotl.utils.dict import DictDefault
    from pydantic import ValidationError

    from lorasync.integrations.axolotl import LorasyncPlugin

    plugin = axolotl_plugins.plugins["lorasync.integrations.axolotl.LorasyncPlugin"]
    assert isinstance(plugin, LorasyncPlugin) and isinstance(plugin, BasePlugin)
    base = dict(base_model="/nonexistent/model", adapter="lora", micro_batch_size=1,
                gradient_accumulation_steps=1, learning_rate=1e-4, output_dir="/tmp/o",
                sequence_len=64, num_epochs=1,
                datasets=[{"path": "/nonexistent/data.json", "type": "alpaca"}],
                plugins=["lorasync.integrations.axolotl.LorasyncPlugin"])
    cfg = validate_config(DictDefault({**base, "lorasync_strategy": "diloco",
                                       "lorasync_options": {"period": 8}}))
    assert cfg.lorasync_strategy == "diloco" and cfg.lorasync_options == {"period": 8}
    with pytest.raises(ValidationError, match="did you mean 'period'"):
        validate_config(DictDefault({**base, "lorasync_strategy": "diloco",
                                     "lorasync_options": {"perod": 8}}))


def test_axolotl_post_trainer_create_attaches(axolotl_plugins, tiny_trainer):
    from axolotl.utils.dict import DictDefault

    import lorasync.hf as hf

    t = tiny_trainer()
    axolotl_plugins.post_trainer_create(
        DictDefault({"lorasync_strategy": "int8", "lorasync_options": {"block": 64}}), t)
    cb = t.callback_handler.callbacks[0]
    assert isinstance(cb, hf._Callback) and cb.h.strategy == "int8"
    assert cb.h.options["block"] == 64
    # without the key the plugin does nothing
    t2 = tiny_trainer()
    axolotl_plugins.post_trainer_create(DictDefault({}), t2)
    assert not any(isinstance(c, hf._Callback) for c in t2.callback_handler.callbacks)


# --------------------------------------------------------------------------- LLaMA-Factory

def test_llamafactory_example_has_no_lorasync_and_parses(monkeypatch):
    """examples/llamafactory_lora.yaml: nothing of lorasync in it (the switch does
    it); it parses with LLaMA-Factory's own argument classes where LLaMA-Factory
    can be imported: in its own environment (.venv-llamafactory, run there by
    tests/dist/test_llamafactory_train.py), not in the project's: it imports
    torchaudio, which has no build for torch 2.13, and pins older transformers,
    TRL and PEFT; docs/integrations.md)."""
    import yaml

    path = os.path.join(ROOT, "examples", "llamafactory_lora.yaml")
    cfg = yaml.safe_load(open(path))
    assert not [k for k in cfg if "lorasync" in k]
    assert cfg["finetuning_type"] == "lora" and "deepspeed" not in cfg
    monkeypatch.setenv("DISABLE_VERSION_CHECK", "1")
    pytest.importorskip("llamafactory.hparams.parser", reason=(
        "LLaMA-Factory is not installed here: it imports torchaudio (no build for torch "
        "2.13) and pins transformers<=5.6, trl<=0.24, peft<=0.18.1"))
    from transformers import HfArgumentParser
    from llamafactory.hparams.parser import _TRAIN_ARGS

    model, data, training, finetuning, _ = HfArgumentParser(_TRAIN_ARGS).parse_dict(
        {**cfg, "use_cpu": True}, allow_extra_keys=False)
    assert finetuning.finetuning_type == "lora" and data.template == "smollm2"
    assert finetuning.lora_target == ["q_proj", "k_proj", "v_proj", "o_proj"]
