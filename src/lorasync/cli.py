"""``lorasync`` command line: subcommands -> functions.

This is the only place where errors become exit codes: a ``LorasyncError``
(anything the user can fix) prints one line and exits 2; anything else is a
bug and keeps its traceback.

Each subcommand lives in its own module exposing ``add_arguments(parser)``
and ``run(args) -> int``.  Those modules import heavy libraries (torch,
transformers) only inside ``run`` so that ``--help`` and argument errors stay
fast.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

from lorasync import __version__
from lorasync.errors import LorasyncError

__all__ = ["main"]

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("lorasync.train.cli", "LoRA fine-tuning on torchrun (the main job)"),
    "cluster": ("lorasync.emulate.cli", "emulated multi-node cluster in network namespaces"),
    "tunnel": ("lorasync.overlay.cli", "WireGuard overlay for nodes in different networks / behind NAT"),
    "probe": ("lorasync.netdiag.probe_cli", "measure the links training will use"),
    "doctor": ("lorasync.netdiag.doctor_cli", "find host and network problems, with fixes"),
    "tune": ("lorasync.netdiag.tune_cli", "check, emit, apply or revert TCP tuning"),
    "plan": ("lorasync.plan.cli", "predict and rank sync strategies for a network"),
    "bench": ("lorasync.bench.cli", "progressive-optimization benchmark"),
    "report": ("lorasync.monitor.report_cli", "HTML report of one or more runs"),
    "secret": ("lorasync.launch.secret_cli", "write a shared secret for a job across nodes"),
    "run": ("lorasync.integrations.run_cli", "run a command (torchrun, accelerate, trl, "
            "llamafactory-cli) with lorasync in its Trainers"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors: usage + exit 2, one line
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lorasync", description="Distributed LoRA fine-tuning that stays fast "
                     "when the network is the bottleneck.")
    parser.add_argument("--version", action="version", version=f"lorasync {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (modname, help_text) in SUBCOMMANDS.items():
        # a subcommand that fails to import is a packaging error: let it show
        mod = importlib.import_module(modname)
        p = sub.add_parser(name, help=help_text, description=(mod.__doc__ or help_text))
        p.formatter_class = argparse.RawDescriptionHelpFormatter
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def _terminate(signum, frame):
    raise SystemExit(128 + signum)


def entry() -> None:
    """``lorasync`` and ``python -m lorasync``: :func:`main`, then
    :func:`lorasync.launch.exit_now` (no interpreter teardown)."""
    from lorasync.launch import exit_now

    try:
        code = main()
    except SystemExit as exc:   # argparse (--help, bad usage), a worker's user error
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    exit_now(code)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    args._argv = list(argv)  # subcommands that relaunch themselves under torchrun need it
    # SIGTERM (kill, torchrun stopping its workers, CI timeouts) unwinds like Ctrl-C, so
    # `finally` blocks run: emulated clusters come down, sinks and process groups close.
    signal.signal(signal.SIGTERM, _terminate)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except LorasyncError as exc:
        print(f"lorasync {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"lorasync {args.command}: interrupted", file=sys.stderr)
        return 130
