"""The torchrun agent that ``launch_on_cluster`` starts in every node.

It is torch's own elastic agent (``torch.distributed.run``) with one
difference: its exit code.  torchrun itself exits 1 whatever its workers
returned; this keeps the worker's code (2 = a user error) the way
:func:`lorasync.launch.run_torchrun` does in-process, so a bad option on an
emulated cluster still ends in exit code 2.

    python -m lorasync.net.agent TORCHRUN_ARGS...     # the same arguments as torchrun
"""

from __future__ import annotations

import sys

__all__ = ["exit_code", "main"]


def exit_code(codes: list[int | None]) -> int:
    """The agent's code from its failed workers' codes: 2 when any worker
    returned 2, else the first positive one, else 1 (killed by a signal)."""
    return 2 if 2 in codes else next((c for c in codes if c and c > 0), 1)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    argv = sys.argv[1:] if argv is None else argv
    try:
        run(get_args_parser().parse_args(argv))
    except ChildFailedError as exc:
        return exit_code([f.exitcode for f in exc.failures.values()])
    except SignalException as exc:  # stopped by launch_on_cluster; the agent has stopped its workers
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
