"""The bad-input contract, checked through ``lorasync.cli.main`` in this process.

Bad input exits 2 with one line on stderr that names the field, no
traceback, no worker started and nothing written.  ``Guard`` stands in for
the places that would start something (torchrun's agent, ``lorasync train``'s
launch, ``tunnel up``'s root check, which comes after the file is read),
so a case that gets through is seen instead of run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from lorasync import cli
from lorasync.overlay import preflight


class Reached(Exception):
    """A run got past every check to where it would start workers or a tunnel."""


class Guard:
    """Patches (with pytest's ``monkeypatch``) what would start processes:
    torchrun's agent (after every check of ``run_torchrun``) and ``tunnel
    up``'s root check (after the file is read).  ``launch_ok``: a run that
    gets there counts (``launches``) and ends with exit 0."""

    def __init__(self, monkeypatch, launch_ok: bool = False):
        import lorasync.launch.torchrun as torchrun

        self.launches = 0
        self.launch_ok = launch_ok
        monkeypatch.setattr(torchrun, "run_agent", self._agent)
        monkeypatch.setattr(preflight, "check_root", self._root)
        for var in ("LOCAL_RANK", "WORLD_SIZE"):   # never a worker here
            monkeypatch.delenv(var, raising=False)
        # what run_torchrun sets for its workers: restored after the test
        for var in ("OMP_NUM_THREADS", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "LORASYNC_NNODES",
                    "LORASYNC_FATAL_DIR"):
            if var in os.environ:
                monkeypatch.setenv(var, os.environ[var])
            else:
                monkeypatch.delenv(var, raising=False)

    def _agent(self, *args, **kw):
        self.launches += 1
        if not self.launch_ok:
            raise Reached("torchrun's agent would start the workers")

    def _root(self):
        raise Reached("tunnel up would start the tunnel")


def files(root) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``root``: path -> (size, mtime_ns)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_size, st.st_mtime_ns)
    return out


def run(capsys, argv) -> tuple[int, str, str]:
    """``lorasync ARGV`` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_refused(rc: int, err: str, *needles: str) -> str:
    """Exit 2 and one line on stderr, no traceback, holding every needle."""
    lines = err.strip().splitlines()
    assert rc == 2, (rc, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("lorasync ") and ": error: " in line, line
    for n in needles:
        assert n in line, (n, line)
    return line


def refused(capsys, root, argv, *needles) -> str:
    """Run ``argv``, check the contract, and that nothing under ``root`` changed."""
    before = files(root)
    rc, _, err = run(capsys, argv)
    line = assert_refused(rc, err, *needles)
    assert files(root) == before, "bad input must leave nothing written"
    return line


# ---------------------------------------------------------------- inputs

def tunnel_configs(root) -> list[Path]:
    """A valid overlay (hub with an endpoint, a node behind NAT, one with an
    endpoint) under ``root``: each node's tunnel.json."""
    from tunnel_fakes import enrolled   # stand-in keys: no wireguard-tools needed

    return enrolled(Path(root) / "overlay", ("hub=203.0.113.5", "a", "b=198.51.100.7:51821"),
                    "hub")


def probe_json(n: int = 2, alpha: float = 1e-3, bw: float = 1.25e6, **extra) -> dict:
    """A probe JSON as `lorasync probe --json` writes it (the fields plan reads)."""
    sweep = [{"collective": "all_reduce", "bytes": b, "time_s": 2 * (n - 1) * alpha
              + 2 * (n - 1) / n * b / bw, "time_s_min": 0.0, "time_s_max": 0.0}
             for b in (1 << 18, 1 << 20, 4 << 20)]
    d = {"world_size": n, "backend": "gloo", "quick": True, "sweep": sweep,
         "pairs": [{"src": 0, "dst": 1, "latency_s": 0.5e-3, "latency_min_s": 0.4e-3,
                    "bandwidth_Bps": bw}],
         "model": {"alpha_s": alpha, "beta_s_per_byte": 1 / bw, "bandwidth_Bps": bw,
                   "latency_s": alpha},
         "slowest_pair": {"src": 0, "dst": 1, "bandwidth_Bps": bw, "latency_s": 0.5e-3},
         "ranks": [{"host": "h0"}, {"host": "h1"}], "warnings": []}
    d.update(extra)
    return d


def write_json(path, obj) -> str:
    Path(path).write_text(json.dumps(obj))
    return str(path)
