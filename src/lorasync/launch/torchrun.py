"""Starting workers through torch's own elastic launcher (torchrun).

Every distributed subcommand (train, probe, doctor --live, bench rows) runs
the same way: when the process is not yet a torchrun worker, it re-runs
``python -m lorasync <same argv>`` under ``torch.distributed.run``; inside a
worker (``LOCAL_RANK``/``WORLD_SIZE`` set by torchrun), it does the work.  A
user on several machines skips the first half and calls torchrun directly::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1:2 --max-restarts 3 \\
        --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:29400 -m lorasync train ...

Restarts (``max_restarts``): torchrun restarts the whole worker group after
a worker fails; the trainer resumes it from the agreed checkpoint.  With
restarts the workers get a fresh c10d store every round
(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): with torch's default, one store
shared by every round, a restarted group can read the previous round's
keys and fail to connect (docs/faults.md).
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Mapping, Sequence

__all__ = ["in_worker", "run_torchrun", "run_agent", "worker_env", "restart_env", "shared_secret",
           "EXIT_FAULT"]

#: exit code of a worker that stopped because a peer failed (train/watchdog.py; EX_TEMPFAIL)
EXIT_FAULT = 75


def in_worker() -> bool:
    """True inside a process started by torchrun (or any env:// launcher)."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def worker_env() -> dict[str, int]:
    """rank, world_size, local_rank, local_world_size of this worker."""
    e = os.environ
    return {
        "rank": int(e.get("RANK", 0)),
        "world_size": int(e.get("WORLD_SIZE", 1)),
        "local_rank": int(e.get("LOCAL_RANK", 0)),
        "local_world_size": int(e.get("LOCAL_WORLD_SIZE", e.get("WORLD_SIZE", 1))),
    }


def restart_env(max_restarts: int, nnodes: str | int = 1) -> dict[str, str]:
    """Environment for torchrun agents and their workers when groups restart."""
    env = {"LORASYNC_NNODES": str(nnodes)}
    if max_restarts > 0 or ":" in str(nnodes):
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def run_torchrun(argv: Sequence[str], nproc: int, *, nnodes: int | str = 1, node_rank: int = 0,
                 rdzv_endpoint: str | None = None, max_restarts: int = 0,
                 env: Mapping[str, str] | None = None) -> int:
    """Run ``python -m lorasync ARGV`` in ``nproc`` local workers via torchrun.

    Single node: ``--standalone`` (a free local port, rendezvous on loopback).
    Several nodes: c10d rendezvous at ``rdzv_endpoint``; ``nnodes`` is N or
    ``"MIN:MAX"`` (elastic).  Every store listens on one address
    (:mod:`lorasync.launch.stores`): loopback on one node, else the address of
    ``GLOO_SOCKET_IFNAME`` or of the route to the rendezvous host; and every
    store connection is guarded by the job's secret (:mod:`lorasync.launch.guard`):
    a fresh one on one node, across nodes the one every node was given
    (``LORASYNC_SECRET_FILE``), which also names the rendezvous.
    ``max_restarts``: worker-group restarts after a failure.  ``env``: set for
    the agent and its workers while the launch runs (what a launcher hands its
    workers).  Returns the exit code of the first failed worker (2 for a user
    error), 0 on success.
    """
    from lorasync.config import parse_endpoint

    if rdzv_endpoint is not None:   # torchrun's own check ends in a traceback
        parse_endpoint(rdzv_endpoint, "--rdzv-endpoint")
    # what this launch sets in the environment (its agent's and workers') is
    # undone when it returns: the caller's process may go on (tests, benches)
    env_before = dict(os.environ)
    try:
        os.environ.update(env or {})
        return _launch(list(argv), nproc, str(nnodes), node_rank, rdzv_endpoint, max_restarts)
    finally:
        os.environ.clear()
        os.environ.update(env_before)


def _launch(argv: list[str], nproc: int, nnodes: str, node_rank: int, rdzv_endpoint: str | None,
            max_restarts: int) -> int:
    import tempfile

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser

    from lorasync.launch import guard, stores

    args = ["--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts)]
    if str(nnodes) == "1" and rdzv_endpoint is None:
        args.append("--standalone")
        store_addr = stores.LOOPBACK
        secret = guard.new_secret()
        # gloo's own listeners too: on one node nothing needs more than loopback
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    else:
        secret = shared_secret()
        host = str(rdzv_endpoint).rpartition(":")[0].strip("[]")
        overlay = use_overlay(host)
        store_addr = stores.collective_address() or stores.route_address(host) or stores.LOOPBACK
        args += ["--nnodes", str(nnodes), "--node-rank", str(node_rank),
                 "--rdzv-backend", "c10d", "--rdzv-endpoint", str(rdzv_endpoint),
                 "--rdzv-id", guard.run_id(secret), "--local-addr", store_addr]
        if overlay:
            # torch decides who hosts the rendezvous store by the hostname's
            # addresses, never an overlay's: say it
            args += ["--rdzv-conf", f"is_host={int(socket.gethostbyname(host) == overlay[1])}"]
        # a round after a failure waits RESTART_JOIN_S for the nodes, and a round
        # that times out names the ones that did not come (RendezvousStalled, exit 75)
        from lorasync.launch.rendezvous import install_rendezvous_bound

        install_rendezvous_bound(socket.gethostname())
    args += ["-m", "lorasync"]
    parsed = get_args_parser().parse_args(args)
    # Set the worker's arguments after parsing: argparse would otherwise match
    # our flags against torchrun's abbreviations (--nproc vs --nproc-per-node).
    parsed.training_script_args = list(argv)
    # one thread per worker unless the user said otherwise: ranks share cores
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ.update(restart_env(max_restarts, nnodes))
    # every store this agent and its workers serve listens on one address,
    # behind the job's secret (in the environment of this process and its
    # workers only: never on a command line)
    os.environ[stores.ENV] = store_addr
    os.environ[guard.ENV] = secret
    undo = stores.bind_stores(store_addr, secret)
    # a worker's user error is the same on every try: restarted workers stop at once
    with tempfile.TemporaryDirectory(prefix="lorasync-fatal-") as fatal:
        os.environ["LORASYNC_FATAL_DIR"] = fatal
        try:
            run_agent(parsed)
        except ChildFailedError as exc:
            codes = [f.exitcode for f in exc.failures.values()]
            return next((c for c in codes if c == 2), codes[0] if codes else 1) or 1
        finally:
            undo()
    return 0


def use_overlay(rdzv_host: str, env=None) -> tuple[str, str] | None:
    """When the rendezvous host is reached over an overlay already on this node
    (tailscale0, zt*, wg*: :meth:`~lorasync.netdiag.hostinfo.HostInfo.overlay_kind`)
    and no interface is named: gloo and NCCL use that interface (so the stores
    listen on its address), and the launch says so.  Returns (interface,
    address) when it chose one."""
    from lorasync.netdiag.hostinfo import HostInfo

    env = os.environ if env is None else env
    if env.get("GLOO_SOCKET_IFNAME") or env.get("NCCL_SOCKET_IFNAME"):
        return None
    host = HostInfo(env=env)
    iface = host.overlay_to(rdzv_host)
    if iface is None or not iface.ipv4:
        return None
    env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = iface.name
    print(f"lorasync: the rendezvous host {rdzv_host} is reached over {host.overlay_kind(iface)} overlay "
          f"{iface.name}: gloo and NCCL use {iface.name}, the stores listen on {iface.ipv4[0]}",
          file=sys.stderr, flush=True)
    return iface.name, iface.ipv4[0]


def shared_secret() -> str:
    """The secret every node of a job across nodes holds
    (``LORASYNC_SECRET_FILE``, or ``LORASYNC_SECRET`` set by a launcher), or
    the error that says how to make one."""
    from lorasync.errors import ConfigError
    from lorasync.launch import guard

    secret = guard.job_secret()
    if secret is None:
        raise ConfigError(guard.FILE_ENV, None,
                          "a job across nodes needs a shared secret that guards its stores: "
                          "`lorasync secret job.secret` on one node, copy the file to every node "
                          "(scp -p; mode 0600), then `export LORASYNC_SECRET_FILE=job.secret` "
                          "on each before lorasync train / probe / doctor")
    return secret


def run_agent(args) -> None:
    """torchrun's ``run(args)``, with its per-run folder (error files) in a
    temporary directory that goes when the run ends: else every run leaves a
    ``torchelastic_*`` folder in /tmp."""
    import tempfile

    from torch.distributed.run import run

    with tempfile.TemporaryDirectory(prefix="lorasync-torchrun-") as logs:
        args.log_dir = args.log_dir or logs
        run(args)


def exit_now(code: int) -> None:
    """End this process with ``code`` once ``atexit`` handlers ran, without
    the interpreter's teardown.  Freeing torch's, gloo's and transformers'
    modules one by one takes seconds per process (in the launcher, in every
    torchrun agent and in every worker: docs/faults.md) and does nothing a
    finished process needs: our files are closed and process groups
    destroyed before the commands return."""
    import atexit
    import signal

    def _now(signum, frame):
        # a SIGTERM while the exit handlers run (torchrun stopping the other workers of a
        # failed group) ends the process with its own code at once; raising SystemExit
        # there, as during the run, would print an "Exception ignored" traceback
        sys.stderr.flush()
        os._exit(code)

    try:
        signal.signal(signal.SIGTERM, _now)
    except ValueError:   # not the main thread: the handler stays as it was
        pass
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
