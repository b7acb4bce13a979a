"""Mixed precision: what ``--bf16`` and ``--fp16`` need before a run starts.

The strategy (loss scaling and error feedback do not mix) and this host's
autocast (a device that lacks the dtype), checked by the launcher before any
worker starts and by every worker again on its own device
(``check_precision``).
"""

from __future__ import annotations

import warnings

from lorasync.config import Config

__all__ = ["check_precision", "precision_device"]


def _fp16_refused(strategy: str, options: dict | None = None) -> bool:
    """Whether ``strategy`` keeps gradients across steps (error feedback; auto
    may switch to such a strategy), where loss scaling would leave scaled, at
    times infinite, values.  auto passes when its ``candidates`` are per-step
    strategies without error feedback (what --fp16 gives the default auto)."""
    from lorasync import catalog

    if strategy == "auto":
        given = (options or {}).get("candidates")
        names = [c.strip() for c in str(given).split(",") if c.strip()] if given else []
        return not names or any(c not in ("allreduce", "fp16", "bf16") for c in names)
    if strategy == "torch_powersgd":
        return True
    return strategy in catalog.SPECS and catalog.SPECS[strategy].error_feedback


def precision_device(backend: str) -> str:
    """The device type the workers will compute on (``--backend``)."""
    import torch

    return "cuda" if backend == "nccl" or (backend == "auto" and torch.cuda.is_available()) \
        else "cpu"


def check_precision(cfg: Config, device_type: str, probe: bool = True) -> None:
    """``--bf16`` / ``--fp16`` against the strategy and (``probe``) this host's
    autocast: a ConfigError naming the flag and the fix.  The launcher calls
    it before any worker starts (probing only a CPU: a probe on a GPU would
    keep a CUDA context in the launcher for the whole run, and every CUDA GPU
    autocasts in both dtypes), each worker again on its own device."""
    from lorasync.errors import ConfigError

    tc = cfg.train
    if not (tc.bf16 or tc.fp16):
        return
    flag, name = ("train.fp16", "float16") if tc.fp16 else ("train.bf16", "bfloat16")
    if tc.fp16 and _fp16_refused(cfg.comm.strategy, cfg.comm.options):
        raise ConfigError(flag, True, f"--comm {cfg.comm.strategy} keeps gradients across "
                          "steps (error feedback), which loss scaling fills with scaled and at "
                          "times infinite values; use --bf16 (no loss scaling), or --fp16 with "
                          "allreduce, fp16, bf16, local or diloco"
                          + (" (or auto among allreduce, fp16 and bf16 only: --comm-opt "
                             "candidates=allreduce,fp16)" if cfg.comm.strategy == "auto" else ""))
    if not probe:
        return
    import torch

    why = _autocast_fails(device_type, getattr(torch, name))
    if why is None and tc.fp16:
        try:
            torch.amp.GradScaler(device_type)
        except (RuntimeError, ValueError) as exc:
            why = f"no loss scaler: {str(exc).splitlines()[0]}"
    if why:
        raise ConfigError(flag, True, f"torch {torch.__version__} cannot run {name} autocast "
                          f"on {device_type} here ({why}); drop --{flag[6:]}"
                          + (" or use --bf16" if tc.fp16 else ""))


def _autocast_fails(device_type: str, dtype) -> str | None:
    """Why a matmul under ``torch.autocast(device_type, dtype)`` does not run in
    ``dtype`` (torch warns and turns autocast off for a dtype a device lacks)."""
    import torch

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.autocast(device_type, dtype=dtype):
                x = torch.ones(4, 4, device=device_type)
                y = x @ x
    except (RuntimeError, ValueError, TypeError) as exc:
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if y.dtype != dtype:
        said = [str(w.message).splitlines()[0] for w in caught]
        return said[0] if said else f"the result came out {y.dtype}"
    return None
