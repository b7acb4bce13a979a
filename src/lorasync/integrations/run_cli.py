"""Run a training command with lorasync switched on in its Hugging Face Trainers.

    lorasync run --strategy int8 -- torchrun --nproc-per-node 2 train_sft.py ...
    lorasync run --strategy diloco --comm-opt period=8 -- accelerate launch train.py ...
    lorasync run --strategy auto -- llamafactory-cli train examples/llamafactory_lora.yaml
    lorasync run --strategy int8 -- trl sft --model_name_or_path ... --use_peft ...

It checks the strategy and options (attach's messages), sets LORASYNC_STRATEGY
and LORASYNC_OPTIONS and replaces itself with COMMAND (exec): every Trainer
started in that process tree attaches lorasync before it prepares the model,
on every rank (docs/integrations.md).  The same as setting the two variables
yourself; the start-up hook that reads them is installed with the package.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from lorasync.errors import ConfigError, LorasyncError

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strategy", default="auto", metavar="NAME",
                   help="sync strategy: allreduce, fp16, bf16, int8, onebit, topk, powersgd, "
                        "local, diloco or auto (default auto)")
    p.add_argument("--comm-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="a strategy option, repeatable, e.g. --comm-opt period=8 "
                        "(`lorasync train --list-strategies` lists them)")
    p.add_argument("--keep-token-average", action="store_true",
                   help="keep the Trainer's average_tokens_across_devices (a token-count "
                        "all-gather every step); lorasync turns it off by default")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="the command to run (torchrun, accelerate launch, llamafactory-cli, "
                        "trl, python ...)")


def environment(strategy: str, options: dict, *, keep_token_average: bool = False) -> dict:
    """The variables ``lorasync run`` sets, checked (a :class:`LorasyncError` names the fix)."""
    from lorasync.integrations import switch

    switch.check(strategy, options)
    opts = dict(options)
    if keep_token_average:
        opts["keep_token_average"] = True
    return {switch.ENV_STRATEGY: strategy, switch.ENV_OPTIONS: switch.format_options(opts)}


def run(args: argparse.Namespace) -> int:
    from lorasync.config import parse_options
    from lorasync.integrations import switch

    command = list(args.cmd)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise ConfigError("command", "", "give the command to run after --, e.g. "
                          "lorasync run --strategy int8 -- torchrun --nproc-per-node 2 train.py")
    env = environment(args.strategy, parse_options(args.comm_opt),
                      keep_token_average=args.keep_token_average)
    if switch.hook_installed() is None:
        raise LorasyncError(
            f"the switch's start-up hook ({switch.HOOK_FILE}) is not in this Python's "
            f"site-packages ({sys.prefix}), so the command's Trainers would not see "
            "LORASYNC_STRATEGY; reinstall lorasync into this environment (make install, or "
            "pip install -e .) and run the command with the same environment's Python")
    exe = shutil.which(command[0])
    if exe is None:
        raise ConfigError("command", command[0], "not found on PATH; give the program's path "
                          "or activate the environment that has it")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(exe, command, {**os.environ, **env})
    return 0   # not reached: execve replaces this process
