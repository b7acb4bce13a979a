"""The environment switch: lorasync in every Hugging Face ``Trainer`` of a
process tree, without a line of the training script changed.

    LORASYNC_STRATEGY=int8 torchrun --nproc-per-node 2 sft.py ...
    LORASYNC_STRATEGY=diloco LORASYNC_OPTIONS=period=8,streaming=true accelerate launch ...
    LORASYNC_STRATEGY=auto llamafactory-cli train cfg.yaml
    lorasync run --strategy int8 -- trl sft ...      # the same, with the variables set for you

Mechanism (the ``coverage`` package's ``COVERAGE_PROCESS_START`` precedent):
the package installs ``lorasync-switch.pth`` into site-packages.  Python runs
an ``import`` line of every ``.pth`` file there at start-up, in every
interpreter of the environment: torchrun's and accelerate's launchers, each
worker they spawn, llamafactory-cli, trl.  The line reads
``LORASYNC_STRATEGY`` and, only when it is set, calls :func:`boot`; unset, the
line costs one dictionary look-up and nothing of lorasync is imported.

:func:`boot` checks the name and options (torch-free: the catalog) and, when
they are bad, prints attach's message on one line and ends the process with
exit code 2, before anything else runs: under torchrun or accelerate launch
that is the launcher itself, so no worker starts.  Otherwise it adds an import
hook that waits for ``transformers.trainer`` to be imported (it may never be:
then nothing else happens) and wraps ``Trainer.train``: the first ``train()``
of each Trainer calls ``lorasync.hf.attach(trainer, NAME, **OPTIONS)`` before
the original ``train()`` prepares the model (wraps it in DDP) and builds the
optimizer, on every rank.  Why ``train`` rather than ``__init__``: every
subclass has finished its own ``__init__`` by then (TRL's trainers apply the
PEFT config and add callbacks there), the user's own settings are final, and
a script that calls ``lorasync.hf.attach`` itself is seen and left alone.

An error of attach (the model has no PEFT adapter, DeepSpeed or FSDP is on, a
bad option value found when DDP is built) ends the process with that message
on one line (local rank 0 prints it) and exit code 2 on every rank, as
``lorasync train`` does with a user error: no traceback.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

from lorasync.errors import LorasyncError

__all__ = ["ENV_STRATEGY", "ENV_OPTIONS", "HOOK_FILE", "boot", "install", "settings",
           "parse_options", "check", "format_options", "hook_installed"]

ENV_STRATEGY = "LORASYNC_STRATEGY"
ENV_OPTIONS = "LORASYNC_OPTIONS"
#: the start-up hook's file name in site-packages (shipped in this package's folder)
HOOK_FILE = "lorasync-switch.pth"
#: not a strategy option: attach's own keyword (keep the Trainer's token average)
_ATTACH_KEYWORDS = ("keep_token_average",)


class SwitchError(LorasyncError, ValueError):
    """A bad ``LORASYNC_STRATEGY`` / ``LORASYNC_OPTIONS``; the message is attach's."""


# --------------------------------------------------------------------------- settings

def parse_options(text: str) -> dict[str, Any]:
    """``"period=8,streaming=true"`` -> ``{"period": 8, "streaming": True}``
    (values are YAML scalars, as ``--comm-opt``).  A comma-separated piece without
    ``=`` continues the previous value: ``candidates=int8,diloco,period=4`` is
    ``{"candidates": "int8,diloco", "period": 4}``."""
    if not text.strip():
        return {}
    import yaml

    pairs: list[list[str]] = []
    for piece in text.split(","):
        if "=" in piece:
            key, _, value = piece.partition("=")
            pairs.append([key.strip(), value])
        elif pairs and piece.strip():
            pairs[-1][1] += "," + piece
        elif piece.strip():
            raise SwitchError(f"{ENV_OPTIONS}: {piece.strip()!r} is not key=value; write "
                              "key=value pairs separated by commas, e.g. period=8,streaming=true")
    out: dict[str, Any] = {}
    for key, value in pairs:
        if not key:
            raise SwitchError(f"{ENV_OPTIONS}: an option has no name ({'=' + value!r}); write "
                              "key=value pairs separated by commas, e.g. period=8")
        try:
            out[key] = yaml.safe_load(value) if value.strip() else ""
        except (yaml.YAMLError, ValueError, RecursionError):
            raise SwitchError(f"{ENV_OPTIONS}: {key}={value!r} is not a value; write a number, "
                              "true/false or a word, e.g. period=8") from None
    return out


def format_options(options: dict[str, Any]) -> str:
    """The inverse of :func:`parse_options` (``lorasync run`` writes the variable)."""
    def text(v):
        return "true" if v is True else "false" if v is False else str(v)
    return ",".join(f"{k}={text(v)}" for k, v in options.items())


def check(strategy: str, options: dict[str, Any]) -> None:
    """``lorasync.hf.attach``'s check of the name and options, with its messages,
    without torch or transformers (this runs at interpreter start-up):
    ``lorasync.hf._check_strategy`` on the catalog, whose names are the
    registered strategies' (tests/unit/test_switch.py holds the two equal)."""
    from lorasync import catalog

    problem = catalog.strategy_problem(strategy, options)
    if problem:
        raise SwitchError(problem)


def settings(environ=None) -> tuple[str, dict[str, Any], dict[str, Any]] | None:
    """``(strategy, strategy options, attach keywords)`` from the environment,
    checked; None when ``LORASYNC_STRATEGY`` is unset or empty."""
    env = os.environ if environ is None else environ
    strategy = env.get(ENV_STRATEGY, "").strip()
    if not strategy:
        return None
    options = parse_options(env.get(ENV_OPTIONS, ""))
    keywords = {k: options.pop(k) for k in _ATTACH_KEYWORDS if k in options}
    for k, v in keywords.items():
        if not isinstance(v, bool):
            raise SwitchError(f"{ENV_OPTIONS}: {k}={v!r}: use true or false")
    check(strategy, options)
    return strategy, options, keywords


def _with_variable(msg: str, environ=None) -> str:
    env = os.environ if environ is None else environ
    opts = env.get(ENV_OPTIONS, "")
    where = f"{ENV_STRATEGY}={env.get(ENV_STRATEGY, '')!r}" + (
        f" {ENV_OPTIONS}={opts!r}" if opts else "")
    return f"{msg} ({where}; fix it, or unset {ENV_STRATEGY} to train without lorasync)"


def _fail(msg: str) -> None:
    """One line (local rank 0 of each node prints it), exit code 2, no teardown:
    the process holds nothing that needs one (a user error, before training)."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"lorasync: error: {msg}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(2)


# --------------------------------------------------------------------------- start-up

def boot() -> None:
    """Called by ``lorasync-switch.pth`` at interpreter start-up when
    ``LORASYNC_STRATEGY`` is set: check the settings, then :func:`install`."""
    try:
        if settings() is None:
            return
    except LorasyncError as exc:
        _fail(_with_variable(str(exc)))
    install()


_installed = False


def install() -> None:
    """Wrap ``transformers.Trainer.train`` now if transformers' trainer module is
    loaded, else as soon as it is imported (an import hook that removes itself)."""
    global _installed
    if _installed:
        return
    _installed = True
    mod = sys.modules.get("transformers.trainer")
    if mod is not None and hasattr(mod, "Trainer"):
        _patch(mod.Trainer)
    else:
        sys.meta_path.insert(0, _TrainerFinder())


class _TrainerFinder:
    """Finds ``transformers.trainer`` with the other finders and wraps its loader
    so that :func:`_patch` runs right after the module executed.  (Plain classes:
    a meta path finder and a loader are protocols, and ``importlib.abc`` costs
    70 ms at every process start.)"""

    NAME = "transformers.trainer"

    def find_spec(self, fullname, path, target=None):
        if fullname != self.NAME:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PatchingLoader(spec.loader, self)
        return spec


class _PatchingLoader:
    def __init__(self, loader, finder):
        self._loader, self._finder = loader, finder

    def __getattr__(self, name):   # get_source, get_code ...: the real loader's
        if name == "_loader":      # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        module.__loader__ = self._loader
        if self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        _patch(module.Trainer)


def _patch(trainer_cls) -> None:
    original = trainer_cls.train
    if getattr(original, "_lorasync_switch", False):
        return

    @functools.wraps(original)
    def train(self, *args, **kwargs):
        _attach_once(self)
        try:
            return original(self, *args, **kwargs)
        except LorasyncError as exc:
            from lorasync.hf import AttachError

            if not isinstance(exc, AttachError):
                raise
            # found when DDP was built (a model without adapter, a bad option value)
            _fail(_with_variable(str(exc)))

    train._lorasync_switch = True
    trainer_cls.train = train


def _attach_once(trainer) -> None:
    if getattr(trainer, "_lorasync_switch", None) is not None:
        return   # a second train() of the same Trainer: attached already
    import lorasync.hf as hf

    if any(isinstance(cb, hf._Callback) for cb in trainer.callback_handler.callbacks):
        trainer._lorasync_switch = "the script's own attach"
        return   # the script called lorasync.hf.attach itself: its settings win
    try:
        strategy, options, keywords = settings()
        trainer._lorasync_switch = hf.attach(trainer, strategy, **keywords, **options)
    except LorasyncError as exc:
        _fail(_with_variable(str(exc)))


# --------------------------------------------------------------------------- the hook file

def hook_source() -> str:
    """The path of the hook file shipped in this package."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), HOOK_FILE)


def hook_installed() -> str | None:
    """The installed hook file's path, or None: looked for in the site-packages
    folders Python processes at start-up (``site``'s, the user's when enabled)."""
    import site

    dirs = list(getattr(site, "getsitepackages", lambda: [])())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    for d in dirs:
        p = os.path.join(d, HOOK_FILE)
        if os.path.isfile(p):
            return p
    return None
