"""Write a new shared secret for a job across nodes.

    lorasync secret job.secret                  # mode 0600, refuses to overwrite
    scp -p job.secret node1:job.secret          # to every other node
    export LORASYNC_SECRET_FILE=job.secret      # on every node, then lorasync train ...

Every store of the job (the rendezvous, the workers' store, the heartbeats)
answers only a process that proves it holds the secret (a challenge-response:
the secret never crosses the network), and the rendezvous id derives from it,
so a process without it can neither join, read nor write.  On one node
lorasync makes a fresh secret by itself.  Keep the file private: whoever
reads it can join the job.
"""

from __future__ import annotations

import argparse
import os

from lorasync.errors import ConfigError

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="where to write the secret (a new file, mode 0600)")


def run(args: argparse.Namespace) -> int:
    from lorasync.launch.guard import new_secret

    path = args.file
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError("file", path, f"directory {folder} does not exist")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError("file", path, "exists: a job's secret is written once; choose "
                          "another name or remove it first") from None
    with os.fdopen(fd, "w") as fh:
        fh.write(new_secret() + "\n")
    print(f"wrote {path} (mode 0600): copy it to every node (scp -p) and set "
          f"LORASYNC_SECRET_FILE={path} there")
    return 0
