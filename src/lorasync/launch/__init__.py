"""Starting workers: torch's own elastic launcher (torchrun) in-process, and
the torchrun agent that emulated clusters and the overlay start on every node
(:mod:`lorasync.launch.agent`)."""

from lorasync.launch.torchrun import (EXIT_FAULT, exit_now, in_worker, restart_env, run_agent,
                                      run_torchrun, worker_env)

__all__ = ["in_worker", "run_torchrun", "run_agent", "worker_env", "restart_env", "exit_now",
           "EXIT_FAULT"]
