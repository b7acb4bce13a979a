"""Clean exits: a script that trained with any strategy ends with exit 0, with
no "terminate called without an active exception" (SIGABRT) from a gloo
worker thread that outlived the interpreter (lorasync.comm.shutdown).

Each case is its own torchrun of 2 ranks, since the exit is what is tested;
the scripts end as users' scripts do, without destroy_process_group.
bench/hf_exits.py runs the Trainer script 20 times per strategy.
"""

import os
import subprocess
import sys

import pytest

from conftest import cli_env

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
pytest.importorskip("accelerate", reason="the lorasync[hf] extra is not installed")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _hf_clients import EXIT_AT_RISK, EXIT_STRATEGIES, exit_clean, exit_spec  # noqa: E402

CLIENTS = os.path.join(HERE, "_hf_clients.py")
WORKER = os.path.join(HERE, "_exit_worker.py")


def torchrun(script, *args, timeout=240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", script, *args]
    p = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=timeout)
    out = p.stdout + p.stderr
    assert not exit_clean(p.returncode, out), (exit_clean(p.returncode, out), out[-4000:])


@pytest.mark.parametrize("name,strategy", EXIT_STRATEGIES, ids=[n for n, _ in EXIT_STRATEGIES])
def test_trainer_script_exits_cleanly(tmp_path, name, strategy):
    torchrun(CLIENTS, "exit", str(tmp_path), exit_spec(name, strategy))


@pytest.mark.parametrize("run", range(3))
def test_streamed_diloco_exits_cleanly_again(tmp_path, run):
    """The case of the issue (1 abort in 11 runs on a loaded host), a few more times."""
    torchrun(CLIENTS, "exit", str(tmp_path), exit_spec("again", dict(EXIT_STRATEGIES)[EXIT_AT_RISK]))


@pytest.mark.parametrize("end,strategy,opts", [
    ("finish", "int8", []),
    ("inflight", "diloco", ["period=2", "streaming=true"]),
], ids=["finish", "inflight"])
def test_own_loop_exits_cleanly(end, strategy, opts):
    """lorasync.attach in a user's loop, the DDP model (and so the process group
    and gloo's workers) alive at exit; a streamed sync left in flight is settled."""
    torchrun(WORKER, end, strategy, *opts)
