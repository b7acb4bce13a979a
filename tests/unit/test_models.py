"""The model side of a run: where ``--model`` comes from (a directory, or a Hub
id in the local cache, never a download), what an adapter records as its
base, PEFT's LoraConfig as the flags build it, and the QLoRA preflight
(bitsandbytes and a device it supports, or one line before launch)."""

from __future__ import annotations

import copy
import math

import pytest

from _bad_input import Guard, refused
from lorasync.config import LoraSettings, ModelConfig, load_config
from lorasync.errors import ConfigError, ModelError, UnknownKey
from lorasync.train import model as m

TRAIN = ["train", "--no-progress", "--max-steps", "2", "--output-dir", "r"]


@pytest.fixture
def guard(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    return Guard(monkeypatch)


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """An empty Hub cache that huggingface_hub reads, here and in children."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def cache_tiny(cache, repo_id: str, with_config: bool = True) -> str:
    """The tiny Llama and its tokenizer saved as ``hf download`` leaves a repo:
    snapshots/<commit>/..., refs/main."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / ("ab" * 20)
    tok = m._tiny_tokenizer()
    if with_config:
        m._tiny_model(len(tok), tok.pad_token_id, tok.eos_token_id).save_pretrained(snap)
    tok.save_pretrained(snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("ab" * 20)
    return str(snap)


# ---------------------------------------------------------------- where --model comes from

def test_a_hub_id_resolves_to_its_cached_snapshot_and_loads(hub):
    snap = cache_tiny(hub, "acme/tiny-llama")
    assert m.resolve_model("acme/tiny-llama") == snap
    model, tok = m.load_base(m.ModelSource.resolve("acme/tiny-llama"))
    assert type(model).__name__ == "LlamaForCausalLM" and tok.pad_token == "<pad>"


def test_a_hub_id_not_in_the_cache_names_the_download_command(hub):
    with pytest.raises(ModelError) as e:
        m.resolve_model("acme/absent")
    msg = str(e.value)
    assert "\n" not in msg and "hf download acme/absent" in msg and str(hub) in msg


def test_a_partial_download_is_no_model(hub):
    cache_tiny(hub, "acme/tokenizer-only", with_config=False)
    with pytest.raises(ModelError, match="no config.json.*hf download acme/tokenizer-only"):
        m.resolve_model("acme/tokenizer-only")


def test_a_name_that_is_neither_a_directory_nor_a_hub_id(hub):
    with pytest.raises(ModelError, match="not 'smollm2-135m', 'tiny', an existing directory"):
        m.resolve_model("no/such/dir")


def test_a_directory_wins_over_a_hub_id_of_the_same_spelling(hub, tmp_path, monkeypatch):
    cache_tiny(hub, "acme/x")
    local = tmp_path / "acme" / "x"
    m._tiny_model(10, 0, 1).save_pretrained(local)
    monkeypatch.chdir(tmp_path)
    assert m.resolve_model("acme/x") == "acme/x"


def test_an_uncached_hub_id_is_refused_before_launch(hub, guard, tmp_path, capsys):
    line = refused(capsys, tmp_path, TRAIN + ["--model", "Qwen/Qwen2.5-7B-Instruct"],
                   "model.name", "hf download Qwen/Qwen2.5-7B-Instruct")
    assert guard.launches == 0, line


def test_the_launcher_resolves_the_model_once_and_hands_it_to_its_workers(
        hub, tmp_path, monkeypatch, capsys):
    """The launcher's tokenizer and meta model (a target outside the defaults
    builds it) and its workers take one resolution, handed on in the workers'
    environment; a worker torchrun started directly resolves the model itself."""
    import os

    import lorasync.launch.torchrun as torchrun
    from _bad_input import run
    from lorasync.train import cli

    snap = cache_tiny(hub, "acme/tiny-llama")
    monkeypatch.chdir(tmp_path)
    Guard(monkeypatch, launch_ok=True)
    calls, seen = [], {}
    real = m.resolve_model
    monkeypatch.setattr(m, "resolve_model", lambda name: calls.append(name) or real(name))
    monkeypatch.setattr(torchrun, "run_agent", lambda args: seen.update(os.environ))
    rc, _, err = run(capsys, TRAIN + ["--model", "acme/tiny-llama", "--lora-targets", "q_proj"])
    assert rc == 0, err
    assert calls == ["acme/tiny-llama"]
    source = m.ModelSource("acme/tiny-llama", snap, "acme/tiny-llama")
    monkeypatch.setenv(cli._SOURCE_ENV, seen[cli._SOURCE_ENV])
    assert cli._handed("acme/tiny-llama") == source
    assert cli._handed("tiny") is None   # a variable left over from a run of another model
    monkeypatch.delenv(cli._SOURCE_ENV)
    assert cli._handed("acme/tiny-llama") is None


def test_base_model_ref_never_names_lorasyncs_cache(hub, tmp_path, monkeypatch):
    snap = cache_tiny(hub, "acme/tiny-llama")
    assert m.base_model_ref("acme/tiny-llama") == "acme/tiny-llama"
    assert m.base_model_ref(snap) == "acme/tiny-llama"   # a snapshot folder given as a path
    (tmp_path / "mine").mkdir()
    monkeypatch.chdir(tmp_path)
    assert m.base_model_ref("mine") == str(tmp_path / "mine")
    assert m.base_model_ref("smollm2-135m") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert m.cache_dir() not in m.base_model_ref("smollm2-135m")
    assert m.base_model_ref("tiny") == "tiny"


# ---------------------------------------------------------------- LoRA as PEFT offers it

def test_all_linear_reaches_peft_as_its_keyword():
    cfg = m.lora_config(LoraSettings(targets="all-linear"))
    assert cfg.target_modules == "all-linear" and cfg.task_type == "CAUSAL_LM"


def test_all_linear_stands_alone():
    with pytest.raises(ConfigError, match="lora.targets.*stands alone"):
        LoraSettings(targets="all-linear,q_proj")


def test_dora_rslora_and_modules_to_save_on_the_tiny_model():
    base, _ = m.load_base(m.ModelSource.resolve("tiny"))
    lora = LoraSettings(targets="all-linear", use_dora=True, use_rslora=True,
                        modules_to_save="norm", alpha=16.0, r=4)
    model = m.add_lora(base, lora, seed=0)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("lora_magnitude_vector" in n for n in names)          # DoRA
    assert any("modules_to_save" in n for n in names)                # the norm, trained whole
    from peft.tuners.lora import LoraLayer

    layers = {n.rsplit(".", 1)[-1] for n, mod in model.named_modules()
              if isinstance(mod, LoraLayer)}
    assert layers == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert math.isclose(q.scaling["default"], 16.0 / math.sqrt(4))  # rsLoRA: alpha / sqrt(r)
    held = {n for n, _ in m.adapter_named_params(model)}
    assert set(names) <= held and all("lora_" in n or n in names for n in held)


def test_lora_opt_sets_any_other_loraconfig_field():
    cfg = load_config(overrides={"lora": {"options": {"init_lora_weights": "gaussian",
                                                       "alpha_pattern": {"q_proj": 32}}}})
    built = m.lora_config(cfg.lora)
    assert built.init_lora_weights == "gaussian" and built.alpha_pattern == {"q_proj": 32}


@pytest.mark.parametrize("key, value, needle", [
    ("init_lora_weight", True, "did you mean 'init_lora_weights'"),
    ("r", 4, "--lora-r"), ("use_dora", True, "--use-dora"), ("task_type", "SEQ_CLS", "itself"),
])
def test_lora_opt_keys_are_checked_against_loraconfig(key, value, needle):
    with pytest.raises(ConfigError, match=needle) as e:
        LoraSettings(options={key: value})
    assert e.value.field == f"lora.options.{key}"
    assert isinstance(e.value, UnknownKey) == (key == "init_lora_weight")


def test_a_value_peft_refuses_is_a_config_error_before_launch(guard, tmp_path, capsys):
    line = refused(capsys, tmp_path, TRAIN + ["--model", "tiny", "--lora-opt",
                                              "layers_pattern=layers"],
                   "lora.options", "layers_pattern", "LoraConfig")
    assert guard.launches == 0, line


def test_a_misspelt_lora_opt_is_refused_before_launch(guard, tmp_path, capsys):
    refused(capsys, tmp_path, TRAIN + ["--model", "tiny", "--lora-opt",
                                       "init_lora_weight=gaussian"],
            "lora.options", "'init_lora_weight'", "init_lora_weights")


def test_modules_to_save_must_name_modules_of_the_model(guard, tmp_path, capsys):
    refused(capsys, tmp_path, TRAIN + ["--model", "tiny", "--lora-modules-to-save", "heads"],
            "lora.modules_to_save", "'heads'", "lm_head")


def test_names_are_matched_as_peft_matches_them():
    """A target is a module name or a dotted suffix of one; a module to save is
    accepted exactly when the installed PEFT wraps a module for it (PEFT 0.22 made
    the rule a dotted suffix: "layernorm" no longer takes input_layernorm)."""
    source = m.ModelSource.resolve("tiny")
    m.check_lora_targets(source, LoraSettings(targets="self_attn.q_proj,v_proj",
                                              modules_to_save="model.norm"))
    with pytest.raises(ConfigError, match="'attn.q_proj'"):
        m.check_lora_targets(source, LoraSettings(targets="attn.q_proj"))
    base, _ = m.load_base(source)
    for name in ("norm", "model.norm", "input_layernorm", "layernorm", "orm"):
        lora = LoraSettings(targets="self_attn.q_proj", modules_to_save=name)
        try:
            m.check_lora_targets(source, lora)
            accepted = True
        except ConfigError:
            accepted = False
        model = m.add_lora(copy.deepcopy(base), lora, seed=0)
        wrapped = any("modules_to_save" in n and p.requires_grad
                      for n, p in model.named_parameters())
        assert accepted == wrapped, (name, accepted, wrapped)
        if name == "norm":
            assert wrapped


# ---------------------------------------------------------------- quantized bases

@pytest.mark.parametrize("bnb, needle", [
    ((False, set(), set()), "needs the bitsandbytes package"),
    ((True, {"cuda"}, {"cpu"}), "supports cuda, this host has cpu"),
])
def test_quantization_preflight_refuses_a_host_that_cannot(monkeypatch, bnb, needle):
    monkeypatch.setattr(m, "_bnb_devices", lambda: bnb)
    with pytest.raises(ConfigError, match=needle) as e:
        m.check_quantization(ModelConfig(name="acme/x", load_in_4bit=True))
    assert e.value.field == "model.load_in_4bit" and "--load-in-4bit" in str(e.value)
    with pytest.raises(ConfigError, match="--load-in-8bit"):
        m.check_quantization(ModelConfig(name="acme/x", load_in_8bit=True))


def test_quantization_preflight_passes_a_host_that_can(monkeypatch):
    monkeypatch.setattr(m, "_bnb_devices", lambda: (True, {"cuda", "cpu"}, {"cpu", "cuda"}))
    m.check_quantization(ModelConfig(name="acme/x", load_in_4bit=True))
    m.check_quantization(ModelConfig(name="acme/x"))   # not quantized: nothing to check


def test_on_this_host_4bit_is_refused_before_launch(guard, tmp_path, capsys):
    if m._bnb_devices()[1] & m._bnb_devices()[2]:
        pytest.skip("this host can run bitsandbytes")
    line = refused(capsys, tmp_path, TRAIN + ["--model", "smollm2-135m", "--load-in-4bit"],
                   "model.load_in_4bit", "--load-in-4bit", "bitsandbytes")
    assert guard.launches == 0, line


def test_the_bitsandbytes_config_built():
    import torch

    q4 = m.quantization_config(ModelConfig(name="acme/x", load_in_4bit=True, dtype="bfloat16"))
    assert q4.load_in_4bit and not q4.load_in_8bit
    assert q4.bnb_4bit_quant_type == "nf4" and q4.bnb_4bit_use_double_quant
    assert q4.bnb_4bit_compute_dtype == torch.bfloat16
    fp4 = m.quantization_config(ModelConfig(name="acme/x", load_in_4bit=True, quant_type="fp4",
                                            double_quant=False))
    assert fp4.bnb_4bit_quant_type == "fp4" and not fp4.bnb_4bit_use_double_quant
    assert fp4.bnb_4bit_compute_dtype == torch.float32
    q8 = m.quantization_config(ModelConfig(name="acme/x", load_in_8bit=True))
    assert q8.load_in_8bit and not q8.load_in_4bit
    assert m.quantization_config(ModelConfig(name="acme/x")) is None


@pytest.mark.parametrize("kw, field", [
    ({"load_in_4bit": True, "load_in_8bit": True}, "model.load_in_8bit"),
    ({"name": "tiny", "load_in_4bit": True}, "model.name"),
    ({"load_in_4bit": True, "quant_type": "int4"}, "model.quant_type"),
])
def test_quantization_settings_that_cannot_be(kw, field):
    with pytest.raises(ConfigError) as e:
        ModelConfig(**{"name": "acme/x", **kw})
    assert e.value.field == field


def test_the_dtype_field_still_sets_the_parameter_dtype():
    import torch

    model, _ = m.load_base(m.ModelSource.resolve("tiny"), "bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_a_quantized_load_asks_transformers_for_bitsandbytes_on_the_device(
        hub, monkeypatch):
    """The path a GPU takes, up to bitsandbytes itself: from_pretrained gets the
    BitsAndBytesConfig and the whole model on this rank's device, and
    add_lora prepares the quantized base the QLoRA way before PEFT wraps it."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    cache_tiny(hub, "acme/tiny-llama")
    monkeypatch.setattr(m, "_bnb_devices", lambda: (True, {"cpu"}, {"cpu"}))
    seen = {}
    real = AutoModelForCausalLM.from_pretrained.__func__

    def from_pretrained(cls, path, **kw):
        seen.update(kw)
        model = real(cls, path, dtype=kw["dtype"])
        model.is_quantized = True   # what bitsandbytes' quantizer leaves on the model
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(from_pretrained))
    cfg = ModelConfig(name="acme/tiny-llama", load_in_4bit=True, dtype="bfloat16")
    base, _ = m.load_base(m.ModelSource.resolve(cfg.name), cfg.dtype, quantize=cfg,
                       device=torch.device("cpu"))
    q = seen["quantization_config"]
    assert q.load_in_4bit and q.bnb_4bit_compute_dtype == torch.bfloat16
    assert seen["device_map"] == {"": "cpu"} and seen["dtype"] == torch.bfloat16
    prepared = []
    real_prepare = peft.prepare_model_for_kbit_training
    monkeypatch.setattr(peft, "prepare_model_for_kbit_training",
                        lambda model, **kw: prepared.append(kw) or real_prepare(model, **kw))
    model = m.add_lora(base, LoraSettings(), seed=0)
    assert prepared == [{"use_gradient_checkpointing": False}]
    assert m.adapter_param_count(model) > 0
