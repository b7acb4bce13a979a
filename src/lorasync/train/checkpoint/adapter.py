"""The adapter as other tools read it: PEFT's format, and ``--init-adapter``.

``export_adapter`` writes a PEFT adapter (what ``RUN/adapter/`` and every
``checkpoint-N`` hold) whose ``adapter_config.json`` names the base model by
``ModelSource.ref`` (its Hub id, or the directory the user gave), never a
cache path, so ``PeftModel.from_pretrained(base, "RUN/checkpoint-40")`` loads
it on another machine.  ``check_init_adapter`` checks an adapter to start
from against the run before launch; ``load_init_adapter`` loads it.
"""

from __future__ import annotations

import json
import os

from lorasync.train.checkpoint.format import _reason
from lorasync.train.model import EMBEDDED_REF, base_model_ref

__all__ = ["export_adapter", "check_init_adapter", "load_init_adapter"]


def export_adapter(model, folder: str, *, tokenizer=None, base_ref: str | None = None) -> None:
    """Write ``model``'s adapter with PEFT's ``save_pretrained`` (safetensors)
    into ``folder``, its ``adapter_config.json`` naming ``base_ref`` as the base
    model (not the local path it was loaded from), and the tokenizer beside it:
    ``PeftModel.from_pretrained(base, folder)`` and
    ``AutoTokenizer.from_pretrained(folder)`` load them anywhere."""
    configs = getattr(model, "peft_config", {})
    before = {k: c.base_model_name_or_path for k, c in configs.items()}
    try:
        if base_ref:
            for c in configs.values():
                c.base_model_name_or_path = base_ref
        # the vocabulary is never resized: no base embedding to save, and "auto" would
        # ask the Hub whether the base's config exists
        model.save_pretrained(folder, safe_serialization=True, save_embedding_layers=False)
    finally:
        for k, c in configs.items():
            c.base_model_name_or_path = before[k]
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def _same_base(theirs: str, ours: str) -> bool:
    """Whether an adapter's ``base_model_name_or_path`` names this run's base
    model (``ModelSource.ref``), also when it is the local directory lorasync
    versions before named (the embedded default's cache) or the same directory
    by another path."""
    def norm(x: str) -> str:
        path = os.path.expanduser(x)
        if os.path.isdir(path):
            real = os.path.realpath(path)
            try:
                from lorasync.train.model import _embedded_dir
                cache = os.path.realpath(_embedded_dir())
            except ImportError:
                cache = None
            return EMBEDDED_REF if real == cache else real
        if x.rstrip("/").endswith("/smollm2-135m-instruct") and "lorasync" in x:
            return EMBEDDED_REF   # the embedded default's cache on the machine that saved it
        return x
    return norm(theirs) == norm(ours)


def check_init_adapter(cfg) -> dict | None:
    """``run.init_adapter`` against this run, before any worker starts: a PEFT
    LoRA adapter directory whose r, target modules, alpha and base model are
    the run's.  Returns its ``adapter_config.json``; a ``ConfigError`` naming
    the field that differs, with the fix."""
    from lorasync.errors import ConfigError

    given = cfg.run.init_adapter
    if not given:
        return None
    path = os.path.expanduser(given)
    fix_dir = ("give a PEFT adapter directory (adapter_config.json + "
               "adapter_model.safetensors), e.g. RUN/checkpoint-40 or RUN/adapter")
    if not os.path.isdir(path):
        raise ConfigError("run.init_adapter", given, f"no such directory; {fix_dir}")
    conf_path = os.path.join(path, "adapter_config.json")
    try:
        with open(conf_path, encoding="utf-8") as fh:
            conf = json.load(fh)
    except FileNotFoundError:
        raise ConfigError("run.init_adapter", given, f"has no adapter_config.json; "
                          f"{fix_dir}") from None
    except (OSError, ValueError) as exc:
        raise ConfigError("run.init_adapter", given, f"its adapter_config.json cannot be read "
                          f"({_reason(exc)}); {fix_dir}") from None
    if not isinstance(conf, dict) or str(conf.get("peft_type", "")).upper() != "LORA":
        kind = conf.get("peft_type") if isinstance(conf, dict) else type(conf).__name__
        raise ConfigError("run.init_adapter", given, f"holds a {kind} adapter, not LoRA; "
                          f"{fix_dir}")
    if not any(os.path.isfile(os.path.join(path, f))
               for f in ("adapter_model.safetensors", "adapter_model.bin")):
        raise ConfigError("run.init_adapter", given, f"has no adapter_model.safetensors; "
                          f"{fix_dir}")
    where = f"the adapter in {given} (--init-adapter) has"
    other = "or start from another --init-adapter"
    if conf.get("r") != cfg.lora.r:
        raise ConfigError("lora.r", cfg.lora.r, f"{where} r={conf.get('r')}: pass --lora-r "
                          f"{conf.get('r')}, {other}")
    targets = conf.get("target_modules")
    if isinstance(targets, str) or sorted(targets or []) != sorted(cfg.lora.targets):
        shown = targets if isinstance(targets, str) else ",".join(sorted(targets or []))
        raise ConfigError("lora.targets", ",".join(cfg.lora.targets),
                          f"{where} target modules {shown}: pass --lora-targets {shown}, "
                          f"{other}")
    alpha = conf.get("lora_alpha")
    if not isinstance(alpha, (int, float)) or float(alpha) != float(cfg.lora.alpha):
        raise ConfigError("lora.alpha", cfg.lora.alpha, f"{where} lora_alpha={alpha} (the "
                          f"scale of its weights): pass --lora-alpha {alpha}, {other}")
    base = conf.get("base_model_name_or_path")
    ours = base_model_ref(cfg.model.name)   # ModelSource.ref: checked before the model resolves
    if base and not _same_base(str(base), ours):
        raise ConfigError("model.name", cfg.model.name, f"{where} base model {base}, this run "
                          f"{ours}: pass --model with its base, {other}")
    return conf


def load_init_adapter(model, path: str) -> int:
    """Load the PEFT adapter in ``path`` into ``model``'s fresh adapter (PEFT's
    own loader); returns the tensors loaded.  A ``ModelError`` when it does not
    fit (``check_init_adapter`` refuses most of that before launch)."""
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    from lorasync.errors import ModelError

    path = os.path.expanduser(path)
    try:
        weights = load_peft_weights(path, device="cpu")
        result = set_peft_model_state_dict(model, weights)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise ModelError(f"run.init_adapter: {path} does not load into this run's adapter "
                         f"({_reason(exc)}); start from an adapter of the same model, r "
                         "and targets") from None
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        what = (f"{len(missing)} adapter tensor(s) missing, e.g. {missing[0]}" if missing
                else f"{len(result.unexpected_keys)} tensor(s) this model lacks, e.g. "
                f"{result.unexpected_keys[0]}")
        raise ModelError(f"run.init_adapter: {path} does not fit this run's adapter ({what}); "
                         "start from an adapter of the same model, r and targets")
    return len(weights)
