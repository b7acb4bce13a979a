"""Failure detection for one rank: heartbeats through the c10d store, a named verdict, a fast exit.

A rank waiting in a collective on a dead, frozen (SIGSTOP) or cut-off peer
would otherwise wait for the process group's timeout (10 minutes), and a
collective blocked in C++ cannot be interrupted from Python.  So every rank
runs a ``Watchdog`` thread that

* beats: every ``interval`` it bumps a counter under its own key in the
  group's c10d store (the store torchrun hands the workers), together with
  its step and phase, over a connection of its own;
* watches: it reads every rank's beat; a peer whose counter has not moved
  for longer than the bound, or a store this rank cannot reach for longer
  than the bound, is a failure.  Counters, not clocks: nothing depends on
  the nodes' clocks agreeing.  A dead process, a frozen one (all its threads
  stop) and a node cut off from the store host all stop beating; the beats
  go on through long evaluations, checkpoints and slow steps, which are not
  failures;
* decides within ``bound = max(min_timeout_s, steps x the median step time)``
  (30 s and 10 by default): it prints one line naming the rank and node that
  stopped answering and what happens next (restart, continue without it,
  give up), records it in this rank's metrics stream, and ends the worker
  with exit code 75 from the thread, wherever the main thread waits (inside
  a backward hook, a periodic sync, a streamed DiLoCo sync, an evaluation).
  torchrun then restarts the group (train/loop.py resumes it).

A peer that dies outright usually shows first as a broken connection in the
main thread (gloo: "Connection reset by peer"); ``connection_lost`` turns
that error into the same named verdict.  The first verdict is also put in
the store, so ranks that only see the consequence (a peer that exited
because *it* detected a failure) report the original cause.
"""

from __future__ import annotations

import collections
import datetime as _dt
import os
import re
import socket
import statistics
import sys
import threading
import time
from typing import Callable

from lorasync.launch import EXIT_FAULT

__all__ = ["Watchdog", "EXIT_FAULT", "describe_self", "member_name", "peer_in_error"]


def _boot_id() -> str:
    """This kernel and pid namespace: pids are comparable between processes that share it."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def _my_address() -> str:
    """The address peers reach this rank at (gloo binds GLOO_SOCKET_IFNAME's address)."""
    from lorasync.launch.stores import collective_address

    addr = collective_address()
    if addr:
        return addr
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def describe_self(rank: int) -> dict:
    """What peers need to name this rank and to check whether it still runs."""
    return {"rank": rank, "node": int(os.environ.get("GROUP_RANK", "0")),
            "host": socket.gethostname(), "addr": _my_address(), "pid": os.getpid(),
            "boot": _boot_id()}


def member_name(m: dict | None) -> str:
    if not m:
        return "an unknown peer"
    return f"rank {m['rank']} (node {m['node']}, {m['host']} {m['addr']}, pid {m['pid']})"


def _alive_here(m: dict) -> bool | None:
    """Whether member ``m`` still runs, when it shares this kernel; None when unknown."""
    if not m.get("boot") or m["boot"] != _boot_id():
        return None
    try:
        with open(f"/proc/{m['pid']}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def peer_in_error(text: str, members: list[dict], me: int) -> dict | None:
    """The peer a collective's error points at: gloo names the address it lost
    (``[10.213.0.2]:41234``); between ranks of one machine, which all share an
    address, the one whose process is gone."""
    others = [m for m in members if m["rank"] != me]
    addrs = set(re.findall(r"\[([0-9a-fA-F.:]+)\]:\d+", text))
    cands = [m for m in others if m["addr"] in addrs] or others
    if len(cands) == 1:
        return cands[0]
    dead = [m for m in cands if _alive_here(m) is False]
    return dead[0] if len(dead) == 1 else None


class Watchdog:
    """Heartbeats and failure verdicts of one rank (see the module docstring).

    ``on_fault(event)`` records a verdict (this rank's metrics stream);
    ``next_action()`` says what happens next, as (word, sentence).
    """

    def __init__(self, *, rank: int, members: list[dict], store_addr: str, store_port: int,
                 prefix: str, min_timeout_s: float, steps: float,
                 on_fault: Callable[[dict], None], next_action: Callable[[], tuple[str, str]],
                 exit: Callable[[int], None] = os._exit):
        self.rank, self.members = rank, members
        self.store_addr, self.store_port, self.prefix = store_addr, store_port, prefix
        self.min_timeout_s, self.steps = float(min_timeout_s), float(steps)
        self.on_fault, self.next_action, self._exit = on_fault, next_action, exit
        # a beat every second with the 30 s default; faster for short test bounds
        self.interval = min(1.0, max(0.05, self.min_timeout_s / 10))
        self._op_timeout = max(2 * self.interval, min(5.0, self.min_timeout_s / 3))
        self.step, self.phase, self._since = 0, "setup", time.monotonic()
        self._step_times: collections.deque = collections.deque(maxlen=20)
        self._stop = threading.Event()
        self._fired = threading.Lock()
        self._thread: threading.Thread | None = None
        self._store = None
        self._beat = 0
        self._warned_stall = False

    # -- the main thread's side -------------------------------------------------

    def start(self) -> None:
        """Connect and put the first beat in the store (before the group's next
        collective, so every rank's key exists when the watching starts)."""
        self._store = self._connect()
        self._send_beat()
        self._thread = threading.Thread(target=self._run, name="lorasync-watchdog", daemon=True)
        self._thread.start()

    def mark(self, phase: str, step: int) -> None:
        """What the main thread does now: setup, train, eval, checkpoint, finish."""
        self.step, self.phase, self._since = step, phase, time.monotonic()

    def step_done(self, step_s: float) -> None:
        self._step_times.append(step_s)

    def bound(self) -> float:
        """Seconds of silence that count as a failure: max(min, steps x median step)."""
        med = statistics.median(self._step_times) if self._step_times else 0.0
        return max(self.min_timeout_s, self.steps * med)

    def bound_text(self) -> str:
        med = statistics.median(self._step_times) if self._step_times else None
        return (f"max({self.min_timeout_s:g} s, {self.steps:g} x the {med:.2f} s median step)"
                if med is not None else f"{self.min_timeout_s:g} s, no step measured yet")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def connection_lost(self, exc: BaseException) -> None:
        """The main thread's collective failed: name the peer, record, exit."""
        peer = peer_in_error(str(exc), self.members, self.rank)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        # gloo: "[.../pair.cc:537] Read error [10.213.0.2]:41234: Connection reset by
        # peer. This is typically caused by ..." -> the part that says what happened
        detail = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". This is typically")[0][:160]
        self._fail(peer, "connection", f"lost the connection to {member_name(peer)} "
                   f"({detail})", silent_s=None, tb=exc.__traceback__)

    # -- the thread ---------------------------------------------------------------

    def _connect(self):
        import torch.distributed as dist

        from lorasync.launch.stores import connect

        store = connect(self.store_addr, self.store_port, None,
                        _dt.timedelta(seconds=self._op_timeout), wait_for_workers=False)
        return dist.PrefixStore(self.prefix, store)

    def _send_beat(self) -> None:
        self._beat += 1
        self._store.set(f"beat/{self.rank}", f"{self._beat}|{self.step}|{self.phase}")

    def _run(self) -> None:
        keys = [f"beat/{m['rank']}" for m in self.members]
        seen: dict[int, tuple[str, float]] = {}   # rank -> (beat counter, when it last moved)
        pos: dict[int, tuple[str, float]] = {}    # rank -> (step|phase, since when)
        last_ok = prev = time.monotonic()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            gap, prev = now - prev, now
            if gap > max(10 * self.interval, 2.0):
                # this process itself got no CPU (SIGSTOP, a paused VM, an overloaded
                # host): that gap is no peer's fault; it only ends this rank when
                # another one has already given up on it
                if gap > self.bound() and self._given_up_on_me():
                    self._fail(self._me(), "self", f"this rank was stopped for {gap:.0f} s, "
                               "longer than the bound, and the others have given up on it",
                               silent_s=gap)
                last_ok = now
                seen = {r: (b, now) for r, (b, _) in seen.items()}
                pos = {r: (w, now) for r, (w, _) in pos.items()}
            try:
                self._send_beat()
                values = self._store.multi_get(keys)
                last_ok = now
            except Exception:  # noqa: BLE001 - timeouts, resets: the store is out of reach
                # (the same connection is kept: reconnecting to a dead host only adds
                # torch's connect-retry log lines, and the verdict is due either way)
                if now - last_ok > self.bound():
                    host = next((m for m in self.members if m["rank"] == 0), None)
                    self._fail(host, "store",
                               f"cannot reach the group's store at {self.store_addr}:"
                               f"{self.store_port} (hosted by {member_name(host)}'s node) for "
                               f"{now - last_ok:.0f} s: that rank is down or frozen, or this "
                               "node is cut off", silent_s=now - last_ok)
                continue
            bound = self.bound()
            for m, raw in zip(self.members, values):
                r = m["rank"]
                if r == self.rank:
                    continue
                beat, _, where = raw.decode(errors="replace").partition("|")
                if r not in seen or seen[r][0] != beat:
                    seen[r] = (beat, now)
                if r not in pos or pos[r][0] != where:
                    pos[r] = (where, now)
                silent = now - seen[r][1]
                if silent > bound:
                    self._fail(m, "silent", f"{member_name(m)} stopped answering: no heartbeat "
                               f"for {silent:.0f} s", silent_s=silent)
            self._check_stall(pos, now, bound)

    def _check_stall(self, pos: dict, now: float, bound: float) -> None:
        """Every peer beats, but this rank's step does not end: a peer that is
        alive yet stays behind, in an earlier step, is stuck; otherwise say once
        that the collective itself makes no progress."""
        if self.phase != "train" or now - self._since <= bound:
            return
        for m in self.members:
            where, since = pos.get(m["rank"], ("", now))
            step, _, phase = where.partition("|")
            if (m["rank"] != self.rank and phase == "train" and step.isdigit()
                    and int(step) < self.step and now - since > bound):
                self._fail(m, "stuck", f"{member_name(m)} is alive but has stayed in step "
                           f"{step} for {now - since:.0f} s while this rank waits in step "
                           f"{self.step}", silent_s=now - since)
        if not self._warned_stall:
            self._warned_stall = True
            print(f"lorasync: rank {self.rank}: step {self.step} has run for "
                  f"{now - self._since:.0f} s (bound {self.bound_text()}) while every rank "
                  "still answers: the network between them is stalled or very slow",
                  file=sys.stderr, flush=True)

    # -- the verdict ----------------------------------------------------------------

    def _fail(self, peer: dict | None, kind: str, what: str, *, silent_s: float | None,
              tb=None) -> None:
        if not self._fired.acquire(blocking=False):
            return
        reported = self._first_verdict(peer, what)
        if reported is not None and reported.get("rank") != self.rank:
            what = f"rank {reported['rank']} reported: {reported['what']}"
            peer = next((m for m in self.members if m["rank"] == reported.get("peer")), peer)
        word, sentence = self.next_action()
        where = _main_thread_site(tb)
        msg = (f"lorasync: rank {self.rank} (node {self._me()['node']}), step {self.step} "
               f"({self.phase}{', in ' + where if where else ''}): {what} (bound "
               f"{self.bound_text()}); {sentence}")
        event = {"event": "fault", "rank": self.rank, "time": time.time(), "step": self.step,
                 "phase": self.phase, "where": where, "kind": kind,
                 "peer": peer["rank"] if peer else None,
                 "peer_node": peer["node"] if peer else None, "silent_s": silent_s,
                 "bound_s": self.bound(), "next": word, "what": what, "message": msg}
        try:
            self.on_fault(event)
        finally:
            print(msg, file=sys.stderr, flush=True)
            sys.stdout.flush()
            self._exit(EXIT_FAULT)

    def _given_up_on_me(self) -> bool:
        import json

        try:
            if not self._store.check(["verdict"]):
                return False
            got = self._store.get("verdict")
            return json.loads(got.decode() if isinstance(got, bytes) else got).get("peer") \
                == self.rank
        except Exception:  # noqa: BLE001 - no store: the group's store host is gone too
            return True

    def _me(self) -> dict:
        return next(m for m in self.members if m["rank"] == self.rank)

    def _first_verdict(self, peer: dict | None, what: str) -> dict | None:
        """Put this verdict in the store unless another rank's came first; return the first."""
        import json

        mine = json.dumps({"rank": self.rank, "peer": peer["rank"] if peer else None,
                           "what": what})
        try:
            got = self._store.compare_set("verdict", "", mine)
            return json.loads(got.decode() if isinstance(got, bytes) else got)
        except Exception:  # noqa: BLE001 - no store: this rank's own view stands
            return None


def _main_thread_site(tb=None) -> str:
    """Where the main thread waits (or, with ``tb``, where its collective failed):
    its innermost lorasync frame, e.g. ``comm/periodic.py:123 _wait_pending``."""
    import traceback

    if tb is not None:
        stack = traceback.extract_tb(tb)
    else:
        frame = sys._current_frames().get(threading.main_thread().ident)
        stack = traceback.extract_stack(frame) if frame is not None else []
    for fs in reversed(stack):
        path = fs.filename.replace(os.sep, "/")
        if "/lorasync/" in path and not path.endswith("train/watchdog.py"):
            return f"{path.split('/lorasync/', 1)[1]}:{fs.lineno} {fs.name}"
    return ""
