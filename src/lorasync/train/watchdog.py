"""Failure detection for one rank: heartbeats through the c10d store, a named verdict, a fast exit.

A rank waiting in a collective on a dead, frozen (SIGSTOP), cut-off or
stuck peer would otherwise wait for the process group's timeout (10
minutes), and a collective blocked in C++ cannot be interrupted from
Python.  So every rank runs a ``Watchdog`` thread that

* beats: every ``interval`` it bumps a counter under its own key in the
  group's c10d store (the store torchrun hands the workers), over a
  connection of its own, together with where its main thread is: the step,
  the phase (setup, train, eval, checkpoint, finish), how many of the
  phase's common points (the collectives every rank passes in the same
  order) it has entered, and a progress counter the main thread advances
  while it works (an evaluation batch, a chunk of a checkpoint file);
* watches: it reads every rank's beat.  A peer whose counter has not moved
  for longer than the bound, or a store this rank cannot reach for longer
  than the bound, is a failure: a dead process, a frozen one (all its
  threads stop) and a node cut off from the store host all stop beating.
  Counters, not clocks: nothing depends on the nodes' clocks agreeing;
* tells stuck from slow: beats come from a thread, so they prove the
  process lives, not that it works.  A peer that is *behind* this rank (an
  earlier step, phase or common point: this rank may be waiting for it) and
  whose main thread has made no progress for longer than the bound of the
  phase it is in is alive but stuck (a hung disk, an endless loop), and is
  named with its phase and the line its main thread is on.  A slow peer
  advances its progress counter, so it is never taken for a stuck one;
* decides within ``bound = max(min_timeout_s, steps x the median step
  time)`` (30 s and 10 by default) for silence and for training steps; an
  evaluation, a checkpoint, the end of the run get the larger of that and
  ``steps`` x the longest pause between two progress marks measured in the
  same stage (on the stuck rank, or on the judge, which has just done the
  same work), and a checkpoint write at least its size at 4 MB/s.  The
  model load is the one stage without a bound of its own (a first download
  can take any time): a rank dead or frozen there is still named, a stuck
  one waits for the process group's timeout.  On a verdict it prints one
  line naming the rank and node and what happens next (restart, continue
  without it, give up), records it in this rank's metrics stream, and ends
  the worker with exit code 75 from the thread, wherever the main thread
  waits.  The line and the record are written from helper threads with a
  deadline: a hung disk under the rank stream (or a full stderr pipe)
  cannot hold the exit.  torchrun then restarts the group (train/trainer.py
  resumes it).

A peer that dies outright usually shows first as a broken connection in the
main thread (gloo: "Connection reset by peer"); ``connection_lost`` turns
that error into the same named verdict.  The first verdict is also put in
the store, so ranks that only see the consequence (a peer that exited
because *it* detected a failure) report the original cause.

Before the watchdog can run (it needs the group's store and every rank's
description) ``StartGuard`` bounds the start of the group: the store,
``init_process_group``, the first gather and the first barrier; a rank that
does not arrive is named from the marks each rank leaves in the store.
``bounded_call`` gives ``destroy_process_group`` a deadline, and
``stall_here`` is the test hook that makes one rank stuck on purpose.
"""

from __future__ import annotations

import collections
import contextlib
import datetime as _dt
import json
import math
import os
import re
import socket
import statistics
import sys
import threading
import time
from typing import Callable

from lorasync.launch import EXIT_FAULT

__all__ = ["Watchdog", "Pace", "StartGuard", "EXIT_FAULT", "describe_self", "member_name",
           "peer_in_error", "bounded_call", "stall_here", "STALL_ENV", "PHASES"]

#: the phases of a step in the order a rank goes through them (a position compares by
#: step, then phase, then the common points entered)
PHASES = ("setup", "train", "eval", "checkpoint", "finish")

#: test hook: ``PHASE[.POINT]:RANK[,...]`` (see ``stall_here``)
STALL_ENV = "LORASYNC_TEST_STALL"

#: seconds the verdict's line and record get before the worker exits without them
_VERDICT_WRITE_S = 5.0


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


# ---------------------------------------------------------------- the main thread's marks


class Pace:
    """What the main thread tells about its progress; these do nothing (no
    watchdog: one rank, or a test).  ``Watchdog`` implements them.

    ``mark(phase, step)`` when a phase begins; ``waiting(what)`` around every
    collective of a phase (the common points: every rank enters them in the
    same order); ``tick(point, allow_s=...)`` while the rank works between
    them (``allow_s``: the work until the next mark may take that long, a
    write of N bytes); ``step_done(step_s)`` after each training step.
    """

    def mark(self, phase: str, step: int) -> None:
        pass

    def tick(self, point: str | None = None, *, allow_s: float = 0.0) -> None:
        pass

    @contextlib.contextmanager
    def waiting(self, what: str):
        yield

    def step_done(self, step_s: float) -> None:
        pass


def _progress(info: dict) -> tuple:
    """What counts as a peer's progress in its beat: step, phase, common point,
    progress marks, and whether it waits (leaving a collective is progress too:
    the main thread moves on with the same point and marks)."""
    return (info["s"], info["p"], info["i"], info["t"], bool(info.get("q")))


def stall_here(phase: str, point: str | None = None) -> None:
    """Test hook, off unless ``LORASYNC_TEST_STALL`` is set: block the calling
    (main) thread of one rank for good, as a hung disk or an endless loop would,
    while its other threads (the watchdog's beats) go on.  ``PHASE:RANK`` stalls
    where RANK begins PHASE (init, setup, train, eval, checkpoint, finish,
    destroy), ``PHASE.POINT:RANK`` where it reaches that point (``eval.batch``:
    after an evaluation batch, ``checkpoint.fsync``: before the fsync of its
    state file); several, comma-separated.  Only in a group's first attempt
    (``TORCHELASTIC_RESTART_COUNT`` 0), so a restarted group runs through.  The
    stalled rank says so on stderr, with the time (for tests to measure from)."""
    spec = os.environ.get(STALL_ENV, "")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    here, rank = phase if point is None else f"{phase}.{point}", os.environ.get("RANK", "0")
    if not any(item.strip().rpartition(":")[::2] == (here, rank) for item in spec.split(",")):
        return
    print(f"lorasync: test hook {STALL_ENV}: rank {rank} stalls in {here} at "
          f"{time.time():.3f}", file=sys.stderr, flush=True)
    while True:
        time.sleep(3600)


def bounded_call(fn: Callable[[], object], seconds: float, name: str = "lorasync-bounded") -> bool:
    """Run ``fn`` in a helper thread and wait at most ``seconds``: True when it
    returned (its exception is raised here), False when it still runs (the
    thread is left behind; it ends with the process)."""
    done, err = threading.Event(), []

    def run():
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            err.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name=name, daemon=True).start()
    if not done.wait(seconds):
        return False
    if err:
        raise err[0]
    return True


def _write_all(writers: list[Callable[[], object]], seconds: float) -> None:
    """Run each writer in its own helper thread; return once all are done or
    ``seconds`` have passed, whichever is first (a hung disk or a full pipe
    under one of them must not hold the caller)."""
    threads = [threading.Thread(target=_quiet(w), name="lorasync-verdict", daemon=True)
               for w in writers]
    for t in threads:
        t.start()
    end = time.monotonic() + seconds
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))


def _quiet(fn):
    def run():
        try:
            fn()
        except Exception:  # noqa: BLE001 - a verdict is written on a best-effort basis
            pass
    return run


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
    sys.stdout.flush()


# ---------------------------------------------------------------- the watchdog


class Watchdog(Pace):
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
        # where the main thread is within the phase: common points entered, progress
        # marks since, what it does, whether it waits, what the work may take
        self._point, self._ticks, self._what, self._waits, self._allow = 0, 0, "", False, 0.0
        self._moved = self._since               # the main thread's last progress mark
        self._pauses: dict[tuple[str, int], float] = {}  # (phase, point) -> longest pause
        self._waited: dict[tuple[str, int], float] = {}  # (phase, point) -> longest wait here
        self._step_times: collections.deque = collections.deque(maxlen=20)
        self._stop = threading.Event()
        self._fired = threading.Lock()
        self._thread: threading.Thread | None = None
        self._store = None
        self._beat = 0
        self._warned_stall = False
        self._behind: dict[int, tuple[tuple, float]] = {}  # rank -> (progress, seen behind since)

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
        now = time.monotonic()
        self._pause_ends(now)
        self._point, self._ticks, self._what, self._waits, self._allow = 0, 0, "", False, 0.0
        self.step, self.phase, self._since = step, phase, now
        self._moved = now
        stall_here(phase)

    def tick(self, point: str | None = None, *, allow_s: float = 0.0) -> None:
        """The main thread made progress; the work until its next mark may take
        ``allow_s`` (``math.inf``: no bound, a model download)."""
        now = time.monotonic()
        self._pause_ends(now)
        self._ticks += 1
        self._allow, self._moved = float(allow_s), now
        if point is not None:
            stall_here(self.phase, point)

    @contextlib.contextmanager
    def waiting(self, what: str):
        """Around a collective every rank enters in the same order: a rank that
        has entered more of them is ahead, and may be waiting for one behind."""
        now = time.monotonic()
        self._pause_ends(now)
        self._point += 1
        self._ticks, self._what, self._allow, self._waits, self._moved = 0, what, 0.0, True, now
        try:
            yield
        finally:
            # the wait is no pause of this rank's own work
            self._waits, self._moved = False, time.monotonic()
            key = (self.phase, self._point)
            self._waited[key] = max(self._waited.get(key, 0.0), self._moved - now)

    def _pause_ends(self, now: float) -> None:
        if not self._waits:
            key = (self.phase, self._point)
            self._pauses[key] = max(self._pauses.get(key, 0.0), now - self._moved)

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

    def stage_bound(self, phase: str | None = None, point: int | None = None) -> float:
        """Seconds the main thread may go without progress in a stage (this
        rank's now, unless given): the step bound, ``steps`` x the longest pause
        measured in the stage, the work's own allowance (this rank's stage
        only); inf: no bound."""
        allow = self._allow if phase is None else 0.0
        phase = self.phase if phase is None else phase
        point = self._point if point is None else point
        if math.isinf(allow):
            return math.inf
        if phase == "train":
            return self.bound()
        return max(self.bound(), self.steps * self._pauses.get((phase, point), 0.0), allow)

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

    def _where(self) -> dict:
        """This rank's position and progress, as its beat carries them."""
        b = self.stage_bound()
        return {"s": self.step, "p": self.phase, "i": self._point, "t": self._ticks,
                "w": self._what, "q": self._waits, "b": None if math.isinf(b) else b,
                "x": _main_thread_site()}

    def _send_beat(self) -> None:
        self._beat += 1
        self._store.set(f"beat/{self.rank}", f"{self._beat}|{json.dumps(self._where())}")

    def _run(self) -> None:
        keys = [f"beat/{m['rank']}" for m in self.members]
        seen: dict[int, tuple[str, float]] = {}   # rank -> (beat counter, when it last moved)
        pos: dict[int, tuple[tuple, float]] = {}  # rank -> (progress, since when)
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
            peers: dict[int, dict] = {}
            for m, raw in zip(self.members, values):
                r = m["rank"]
                if r == self.rank:
                    continue
                beat, _, where = raw.decode(errors="replace").partition("|")
                if r not in seen or seen[r][0] != beat:
                    seen[r] = (beat, now)
                silent = now - seen[r][1]
                if silent > bound:
                    self._fail(m, "silent", f"{member_name(m)} stopped answering: no heartbeat "
                               f"for {silent:.0f} s", silent_s=silent)
                try:
                    info = json.loads(where)
                    progress = _progress(info)
                except (ValueError, KeyError, TypeError):
                    continue
                if r not in pos or pos[r][0] != progress:
                    pos[r] = (progress, now)
                peers[r] = info
            # alive: beating now (a peer whose beats stop is the silence check's)
            fresh = max(5 * self.interval, 2.0)
            self._check_stuck({r: i for r, i in peers.items() if now - seen[r][1] <= fresh},
                              pos, now)
            self._check_stall(now, bound)

    def _position(self, step: int, phase: str, point: int) -> tuple:
        return (step, PHASES.index(phase) if phase in PHASES else -1, point)

    def _check_stuck(self, peers: dict[int, dict], pos: dict, now: float) -> None:
        """A peer behind this rank whose main thread has made no progress for
        longer than its stage's bound is alive but stuck; of several, the one
        furthest behind (the others may be waiting for it too)."""
        mine = self._position(self.step, self.phase, self._point)
        stuck = []
        for m in self.members:
            info = peers.get(m["rank"])
            if info is None:
                continue
            at = self._position(info["s"], info["p"], info["i"])
            if not at < mine or info.get("b") is None:
                continue
            # the peer's own bound, or what this rank measured doing the same work
            b = max(float(info["b"]), self.stage_bound(info["p"], info["i"]))
            still = now - pos[m["rank"]][1]
            if info.get("q"):
                # seen waiting in a collective this rank has left: its beat may
                # predate its own leaving (beats come once an interval), so the
                # wait counts only from when this rank first saw it behind
                since = self._behind.get(m["rank"])
                if since is None or since[0] != pos[m["rank"]][0]:
                    since = self._behind[m["rank"]] = (pos[m["rank"]][0], now)
                still = min(still, now - since[1])
                # a bulk collective ends on each rank when its own receiving is done:
                # what this rank sent last may still be on a slow link (socket
                # buffers, the queue of a narrow link) for about as long as this
                # rank's own wait there lasted
                b = max(b, self.bound() + self._waited.get((info["p"], info["i"]), 0.0))
            if still > b:
                stuck.append((at, m, info, still, b))
        if not stuck:
            return
        _, m, info, still, b = min(stuck, key=lambda c: c[0])
        here = (f"after {info['w']}" if info.get("w") and not info.get("q")
                else f"waiting at {info['w']}" if info.get("w") else "")
        detail = ", ".join(x for x in (here, f"in {info['x']}" if info.get("x") else "") if x)
        waits = f"at {self._what}" if self._waits and self._what else f"in {self.phase}"
        what = (f"{member_name(m)} is alive but stuck: its main thread has made no progress "
                f"for {still:.0f} s in {info['p']} at step {info['s']}"
                + (f" ({detail})" if detail else "") + f", while this rank waits {waits}")
        phase = info["p"]
        text = (f"{b:.0f} s for {phase}: the step bound {self.bound_text()}" if phase == "train"
                else f"{b:.0f} s for {phase}: the step bound {self.bound_text()}, or "
                f"{self.steps:g} x the longest pause measured in that stage, or its disk work "
                "at 4 MB/s, whichever is largest")
        self._fail(m, "stuck", what, silent_s=still, bound_s=b, bound_text=text,
                   extra={"peer_phase": phase, "peer_step": info["s"],
                          "peer_where": info.get("x", ""), "peer_doing": info.get("w", "")})

    def _check_stall(self, now: float, bound: float) -> None:
        """Every peer beats and none is behind, but this rank's step does not
        end: say once that the collective itself makes no progress."""
        if self.phase != "train" or now - self._since <= bound or self._warned_stall:
            return
        self._warned_stall = True
        print(f"lorasync: rank {self.rank}: step {self.step} has run for "
              f"{now - self._since:.0f} s (bound {self.bound_text()}) while every rank "
              "still answers: the network between them is stalled or very slow",
              file=sys.stderr, flush=True)

    # -- the verdict ----------------------------------------------------------------

    def _fail(self, peer: dict | None, kind: str, what: str, *, silent_s: float | None,
              tb=None, bound_s: float | None = None, bound_text: str | None = None,
              extra: dict | None = None) -> None:
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
               f"{bound_text or self.bound_text()}); {sentence}")
        event = {"event": "fault", "rank": self.rank, "time": time.time(), "step": self.step,
                 "phase": self.phase, "where": where, "kind": kind,
                 "peer": peer["rank"] if peer else None,
                 "peer_node": peer["node"] if peer else None, "silent_s": silent_s,
                 "bound_s": self.bound() if bound_s is None else bound_s, "next": word,
                 "what": what, "message": msg, **(extra or {})}
        # the line first, the record beside it: neither may hold the exit (the rank
        # stream may sit on the disk that hangs, stderr may be a full pipe)
        try:
            _write_all([lambda: _say(msg), lambda: self.on_fault(event)], _VERDICT_WRITE_S)
        finally:
            self._exit(EXIT_FAULT)

    def _given_up_on_me(self) -> bool:
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
        mine = json.dumps({"rank": self.rank, "peer": peer["rank"] if peer else None,
                           "what": what})
        try:
            got = self._store.compare_set("verdict", "", mine)
            return json.loads(got.decode() if isinstance(got, bytes) else got)
        except Exception:  # noqa: BLE001 - no store: this rank's own view stands
            return None


# ---------------------------------------------------------------- the start of the group


class StartGuard:
    """A bound on the start of the group, before the watchdog runs: connecting
    to the group's store, ``init_process_group`` (gloo/NCCL connect every rank
    to every other through it), the first gather of the members and the
    barrier after the watchdog's first beat.  Each rank leaves a mark in the
    store at every stage it reaches (``reached``); when the bound passes with
    the start unfinished, a thread reads the marks, names the ranks that did
    not arrive (the ones furthest behind) and what they did not do, and ends
    the worker with exit code 75, as the watchdog does.

    ``bound_s``: max(20 s, 2 x --fault-timeout) in the trainer: the workers of
    a group start within seconds of each other (torchrun starts them after its
    rendezvous), and a verdict here costs a restart.
    """

    #: the stages in order: what a rank there has done, and what it has not done yet
    STAGES = {None: ("started", "connect to the group's store"),
              "store": ("connected to the group's store",
                        "create the process group (init_process_group)"),
              "group": ("created the process group", "join the first gather of the members"),
              "members": ("joined the first gather", "start its watchdog and reach the "
                          "first barrier")}

    def __init__(self, *, rank: int, world: int, bound_s: float, store_addr: str,
                 store_port: int, bound_text: str, next_action: Callable[[], tuple[str, str]],
                 exit: Callable[[int], None] = os._exit):
        self.rank, self.world, self.bound_s = rank, world, float(bound_s)
        self.store_addr, self.store_port, self.bound_text = store_addr, store_port, bound_text
        self.next_action, self._exit = next_action, exit
        # one round of the group: a store shared between rounds (torch's default) may
        # still hold an earlier round's marks
        self.prefix = (f"lorasync/start/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
                       f"{world}/")
        self.stage: str | None = None
        self._connecting = False
        self._done = threading.Event()

    def start(self) -> "StartGuard":
        threading.Thread(target=self._run, name="lorasync-start", daemon=True).start()
        return self

    def done(self) -> None:
        """The start is complete (or failed with an error of its own)."""
        self._done.set()

    def connecting(self) -> None:
        """The main thread is about to create or connect to the group's store."""
        self._connecting = True

    def reached(self, stage: str, store) -> None:
        """The main thread reached ``stage`` (store, group, members): a mark in
        the group's ``store``."""
        self.stage = stage
        store.set(f"{self.prefix}{self.rank}",
                  json.dumps({"stage": stage, "who": describe_self(self.rank)}))

    def _run(self) -> None:
        if self._done.wait(self.bound_s):
            return
        try:
            what, peer = self._who_is_missing()
        except Exception as exc:  # noqa: BLE001 - the verdict is due either way
            what, peer = f"the start did not complete ({type(exc).__name__}: {exc})", None
        if self._done.is_set():  # it completed while the marks were read
            return
        word, sentence = self.next_action()
        where = _main_thread_site()
        stage = ("connecting to the group's store" if self.stage is None and self._connecting
                 else self.STAGES[self.stage][0])
        msg = (f"lorasync: rank {self.rank} (node {os.environ.get('GROUP_RANK', '0')}), start "
               f"of the group ({stage}{', in ' + where if where else ''}): {what} within "
               f"{self.bound_s:g} s (bound {self.bound_text}); {sentence}")
        try:
            _write_all([lambda: _say(msg)], _VERDICT_WRITE_S)
        finally:
            self._exit(EXIT_FAULT)

    def _who_is_missing(self) -> tuple[str, int | None]:
        """The ranks furthest behind, named, and what they did not do."""
        from lorasync.launch.stores import connect

        endpoint = f"{self.store_addr}:{self.store_port}"
        try:   # through the guard when the job has one, as every store client
            store = connect(self.store_addr, self.store_port, None,
                            _dt.timedelta(seconds=min(5.0, self.bound_s / 4)),
                            wait_for_workers=False)
        except Exception:  # noqa: BLE001 - refused, timed out: nobody serves it
            if self.rank == 0:
                return f"this rank could not open the group's store at {endpoint}", 0
            return (f"rank 0 did not open the group's store at {endpoint} (its worker is stuck "
                    "before init_process_group, or this node cannot reach it)"), 0
        order = list(self.STAGES)
        marks: dict[int, dict | None] = {}
        for r in range(self.world):
            key = f"{self.prefix}{r}"
            marks[r] = json.loads(store.get(key)) if store.check([key]) else None
        level = {r: order.index(m["stage"]) if m else 0 for r, m in marks.items()}
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            level[0] = max(level[0], 1)  # rank 0 serves the store this thread just reached
        # this rank's own stage: its mark may not be written yet (rank 0 waits for every
        # rank to connect inside the store's constructor)
        mine = order.index(self.stage) if self.stage in order else 0
        level[self.rank] = max(level[self.rank], mine, 1 if self._connecting else 0)
        low = min(level.values())
        behind = [r for r in sorted(level) if level[r] == low]
        done, todo = self.STAGES[order[low]]
        if len(behind) == self.world:
            return (f"every rank {done}, and none could {todo} (the ranks cannot connect to "
                    "each other: a firewall, NAT or a wrong GLOO_SOCKET_IFNAME?)"), None
        names = []
        for r in behind:
            who = (marks[r]["who"] if marks[r] else describe_self(r) if r == self.rank
                   else None)
            names.append(member_name({**who, "rank": r}) + (" [this rank]" if r == self.rank
                                                            else "") if who
                         else f"rank {r} (its worker never connected to the group's store at "
                         f"{endpoint})")
        they = "it" if len(names) == 1 else "they"
        return (f"{', '.join(names)} did not arrive: "
                + (f"{they} {done} but did not {todo}" if low else f"{they} did not {todo}")), \
            behind[0]


def _main_thread_site(tb=None) -> str:
    """Where the main thread waits (or, with ``tb``, where its collective failed):
    its innermost lorasync frame, e.g. ``comm/periodic.py:123 _wait_pending``.
    From the frames alone: no source file is read (a verdict must not touch a
    disk that may hang)."""
    frames = []
    if tb is not None:
        while tb is not None:
            frames.append((tb.tb_frame.f_code, tb.tb_lineno))
            tb = tb.tb_next
    else:
        f = sys._current_frames().get(threading.main_thread().ident)
        while f is not None:
            frames.append((f.f_code, f.f_lineno))
            f = f.f_back
        frames.reverse()
    for code, line in reversed(frames):
        path = code.co_filename.replace(os.sep, "/")
        if "/lorasync/" in path and not path.endswith("train/watchdog.py"):
            return f"{path.split('/lorasync/', 1)[1]}:{line} {code.co_name}"
    return ""
