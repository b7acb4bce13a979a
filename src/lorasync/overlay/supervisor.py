"""What every overlay transport's supervisor shares: the background process
that keeps one daemon up (``wireguard-go`` in :mod:`lorasync.overlay.wgsupervisor`,
``ssh`` or ``sshd`` in :mod:`lorasync.overlay.sshtun`).

This module owns:

* :class:`BaseSupervisor`: the loop that restarts the daemon when it exits
  (after a delay the subclass decides), the event log
  ``/run/lorasync/tunnels/NAME.log``, the state file ``NAME.json`` (written
  whole, then renamed into place), and taking everything down;
* :func:`serve`: the supervisor's process (``python -m ... supervise
  CONFIG``): SIGTERM and SIGINT stop it; it prints ``ready`` once up (or
  ``error: MESSAGE`` and exits 2), supervises until signalled, then removes
  what it made;
* the parent's half (:func:`spawn`, :func:`ready_line`) and ``down``'s
  (:func:`states`, :func:`end_process`, :func:`remove_state`): state files
  are read back and a process is signalled only when its command line shows
  it is ours (a crashed supervisor's PIDs may belong to others since).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

from lorasync.errors import LorasyncError
from lorasync.hostops import TUNNELS_DIR, pid_alive

__all__ = ["BaseSupervisor", "argv_of", "end_process", "ready_line", "remove_state", "serve",
           "spawn", "states"]


class BaseSupervisor:
    """Keeps one daemon (``self.proc``) up; a subclass starts it and says what
    its state file holds.

    A subclass implements :meth:`_start` (everything :meth:`start` brings
    up), :meth:`state` (the state file's contents), :meth:`up_message`,
    :meth:`_exited` (the daemon exited: log it, return seconds until the
    restart), :meth:`_restart` and :meth:`_release` (what :meth:`stop`
    takes down besides the link-test server and the state file); it may add
    work done while the daemon runs (:meth:`_check`) and to :meth:`bring_up`.
    """

    def __init__(self, name: str, *, cluster: str | None = None, log=None, interval: float = 1.0):
        self.name = name
        self.cluster = cluster
        self.interval = interval
        self.log_path = TUNNELS_DIR / f"{name}.log"
        self._log = log
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._stop = threading.Event()
        self._server: socket.socket | None = None

    # -- events and state

    def event(self, msg: str) -> None:
        line = f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {self.name} {msg}"
        with open(self.log_path, "a") as f:
            f.write(line + "\n")
        if self._log is not None:
            print(line, file=self._log, flush=True)

    def state(self) -> dict:
        raise NotImplementedError

    def _save_state(self) -> None:
        # readers (`tunnel status`, `down`) never see a half-written file
        tmp = TUNNELS_DIR / f".{self.name}.json.tmp"
        tmp.write_text(json.dumps(self.state(), indent=1))
        tmp.replace(TUNNELS_DIR / f"{self.name}.json")

    # -- lifecycle

    def start(self) -> None:
        """Bring everything up; raises on failure after cleaning up what it made."""
        TUNNELS_DIR.mkdir(parents=True, exist_ok=True)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        self._save_state()
        self.event(self.up_message())

    def bring_up(self, stopping: Callable[[], bool]) -> None:
        """What :func:`serve` does before it says ``ready`` (``stopping``: a
        signal came meanwhile); on a LorasyncError nothing it made stays."""
        self.start()

    def _start(self) -> None:
        raise NotImplementedError

    def up_message(self) -> str:
        raise NotImplementedError

    def run(self) -> None:
        """Supervise until :meth:`request_stop`: start the daemon again when it exits."""
        restart_at = None
        while not self._stop.wait(self.interval):
            if self.proc is None or self.proc.poll() is not None:
                now = time.monotonic()
                if restart_at is None:
                    restart_at = now + self._exited(now)
                if now >= restart_at:
                    restart_at = self._restart(now)
                continue
            self._check()

    def _exited(self, now: float) -> float:
        raise NotImplementedError

    def _restart(self, now: float) -> float | None:
        """Start the daemon again: None when it runs, else when to try again."""
        raise NotImplementedError

    def _check(self) -> None:
        """One look at the running daemon, every ``interval`` seconds."""

    def request_stop(self) -> None:
        self._stop.set()

    def stop(self) -> None:
        """Take everything down: the link-test server, what :meth:`_release`
        names, the state file."""
        self._stop.set()
        if self._server is not None:
            with contextlib.suppress(OSError):
                self._server.close()
            self._server = None
        self._release()
        with contextlib.suppress(FileNotFoundError):
            (TUNNELS_DIR / f"{self.name}.json").unlink()

    def _release(self) -> None:
        raise NotImplementedError


def serve(build: Callable[[], BaseSupervisor], *, foreground: bool = False,
          report_bugs: bool = False) -> int:
    """A supervisor's process: ``build()`` it, bring it up, print ``ready``
    (or ``error: MESSAGE`` and return 2), supervise until SIGTERM or SIGINT,
    then take it down.  ``foreground``: stdout stays open (the parent of a
    background one stops reading after ``ready``); ``report_bugs``: a bug's
    message goes to stdout too, its traceback to stderr (the tunnel's log)."""
    stop = {"sig": None}
    sup: list[BaseSupervisor] = []

    def _term(signum, frame):
        stop["sig"] = signum
        for s in sup:
            s.request_stop()

    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGINT, _term)
    try:
        s = build()
        sup.append(s)
        s.bring_up(lambda: stop["sig"] is not None)
    except LorasyncError as exc:
        print(f"error: {exc}", flush=True)
        return 2
    except Exception as exc:
        if report_bugs:
            print(f"error: {type(exc).__name__}: {exc} (a bug; traceback in the tunnel's log)",
                  flush=True)
        raise
    print("ready", flush=True)
    if not foreground:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
    try:
        if stop["sig"] is None:
            s.run()
    finally:
        s.event(f"down (signal {stop['sig']})" if stop["sig"] else "down")
        s.stop()
    return 0


# ---------------------------------------------------------------- the parent's half

def spawn(argv: list[str], stderr: Path) -> subprocess.Popen:
    """Start a supervisor in a session of its own (once up, a Ctrl-C in the
    shell that started it must not take it down), its stderr appended to
    ``stderr`` and its stdout a pipe for :func:`ready_line`."""
    err = open(stderr, "ab")
    try:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=err, start_new_session=True, close_fds=True)
    finally:
        err.close()


def ready_line(proc: subprocess.Popen, timeout: float) -> str:
    """The supervisor's first line: ``ready``, ``error: MESSAGE``, or "" when
    none came within ``timeout`` seconds."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline().decode(errors="replace").strip() if ready else ""
    proc.stdout.close()
    return line


# ---------------------------------------------------------------- state files and processes

def states() -> list[dict]:
    """The state file of every tunnel this host runs (also a crashed one's);
    one that is not a state file (cut short, edited) is skipped."""
    out = []
    for f in sorted(TUNNELS_DIR.glob("*.json")):
        with contextlib.suppress(OSError, ValueError, RecursionError):
            st = json.loads(f.read_text())
            # an interface name is all `down` needs; `launch` and `status` also read
            # the config path
            if isinstance(st, dict) and isinstance(st.get("ifname"), str) \
                    and isinstance(st.get("config", ""), str):
                out.append(st)
    return out


def remove_state(name: str) -> list[str]:
    """Remove tunnel ``name``'s state file: ``["state PATH"]``, or [] when there is none."""
    path = TUNNELS_DIR / f"{name}.json"
    if not path.exists():
        return []
    path.unlink()
    return [f"state {path}"]


def argv_of(pid: int) -> list[str]:
    """The command line of process ``pid`` ([] when it is gone)."""
    try:
        return [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return []


def end_process(pid: int | None, ours: Callable[[int], bool], grace_s: float) -> bool:
    """SIGTERM ``pid`` when it runs and ``ours(pid)`` says it is ours, SIGKILL
    if it still is after ``grace_s`` seconds; whether it was ours."""
    if not (pid_alive(pid) and ours(pid)):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    if pid_alive(pid) and ours(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return True
