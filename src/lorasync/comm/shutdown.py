"""A clean end of the process: no collective, and no lorasync thread, left to
the interpreter's shutdown.

Why it is needed.  gloo runs every collective on one of its worker threads
(``pt_gloo_runloop``).  After the collective has completed, and after
``wait()`` has returned to Python, the worker still releases it; if Python
has dropped the collective's tensors by then, torch frees their Python
objects at that moment, which takes the GIL (a Python ``.then`` callback
still to run takes it too).  Once the interpreter is finalizing, a thread
that takes the GIL is ended with ``pthread_exit``; the unwinding reaches a
C++ destructor and calls ``std::terminate``: "terminate called without an
active exception", SIGABRT, and torchrun reports exit 1 for a script that
trained correctly.  Any collective that completes just before the process
exits can do it: a loaded host delays the worker past the main thread's
exit (docs/huggingface.md, "Clean exits", has the stack and the rates).
The Trainer never destroys the process group, and destroying it is not
enough while a DDP model still holds it: the workers live on.

:func:`install` (called once by ``attach``) registers :func:`at_exit`, which,
before the interpreter finalizes:

1. settles every live sync: waits for what it still has in flight (a
   streamed DiLoCo / local outer sync), applying nothing;
2. destroys the process groups if they are still initialized: with no other
   reference left, torch joins gloo's workers there;
3. stops lorasync's own point-to-point worker threads;
4. waits until gloo's worker threads are idle (a DDP model still alive keeps
   the group and its threads): a few milliseconds, while the GIL is free.

Steps 1-2 run on a daemon helper thread, waited for at most
:data:`EXIT_TIMEOUT_S` seconds (env ``LORASYNC_EXIT_TIMEOUT``), so a dead peer
cannot hang the exit (Python 3.12 refuses new threads at exit: there they run
inline, without the deadline); step 4 takes at most :data:`IDLE_TIMEOUT_S`.
Nothing is raised and the exit code stays the script's: a problem is one
line on stderr.  A helper left behind by the deadline is still inside torch
when the interpreter finalizes and may abort the process then: that is a
peer that died, where the run has failed anyway.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import weakref

__all__ = ["install", "track", "at_exit", "EXIT_TIMEOUT_S", "IDLE_TIMEOUT_S"]

#: seconds the exit waits for the syncs to settle and the groups to be destroyed
EXIT_TIMEOUT_S = 10.0
#: seconds the exit waits for gloo's worker threads to go idle
IDLE_TIMEOUT_S = 2.0
#: names torch gives gloo's worker threads
_WORKER_NAMES = ("pt_gloo_runloop",)
#: consecutive polls, _POLL_S apart, that must find every worker asleep
_CALM_POLLS = 3
_POLL_S = 0.005

_lock = threading.Lock()
_installed = False
_syncs: "weakref.WeakSet" = weakref.WeakSet()


def install() -> None:
    """Register :func:`at_exit` once per process."""
    global _installed
    with _lock:
        if not _installed:
            atexit.register(at_exit)
            _installed = True


def track(sync) -> None:
    """Settle ``sync`` at exit (held weakly: a sync that is gone needs nothing)."""
    install()
    _syncs.add(sync)


def _say(msg: str) -> None:
    rank = os.environ.get("RANK", "?")
    print(f"lorasync: at exit (rank {rank}): {msg}", file=sys.stderr, flush=True)


def _timeout() -> float:
    raw = os.environ.get("LORASYNC_EXIT_TIMEOUT", "")
    if not raw:
        return EXIT_TIMEOUT_S
    try:
        value = float(raw)
        if value > 0:
            return value
    except ValueError:
        pass
    _say(f"LORASYNC_EXIT_TIMEOUT={raw!r} is not a positive number of seconds; using "
         f"{EXIT_TIMEOUT_S:g}")
    return EXIT_TIMEOUT_S


def _settle_and_destroy(errors: list[str]) -> None:
    for sync in list(_syncs):
        try:
            sync.settle()
        except Exception as e:  # noqa: BLE001 - reported, never raised at exit
            errors.append(f"{getattr(sync, 'name', type(sync).__name__)}.settle: "
                          f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001
        errors.append(f"destroy_process_group: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:160] if str(e) else ''}")


def _worker_states() -> list[str] | None:
    """The scheduler state (R, S, D, ...) of each gloo worker thread of this
    process; None where /proc cannot tell."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    states = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue   # ended meanwhile
        close = stat.rfind(")")
        if stat[stat.find("(") + 1:close] in _WORKER_NAMES:
            states.append(stat[close + 2:close + 3])
    return states


def wait_workers_idle(timeout: float = IDLE_TIMEOUT_S) -> bool:
    """Wait (GIL released) until every gloo worker thread has been asleep for
    a few consecutive polls, or none is left: a worker that was still
    releasing a finished collective has then done so.  False on timeout."""
    deadline = time.monotonic() + timeout
    calm = 0
    while True:
        states = _worker_states()
        if states is None:   # no /proc: a short grace instead
            time.sleep(min(0.1, timeout))
            return True
        if not states:
            return True
        calm = calm + 1 if all(s == "S" for s in states) else 0
        if calm >= _CALM_POLLS:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)


def at_exit() -> None:
    """The exit guard (module docstring); never raises."""
    try:
        errors: list[str] = []
        timeout = _timeout()
        helper = threading.Thread(target=_settle_and_destroy, args=(errors,), daemon=True,
                                  name="lorasync-exit")
        try:
            helper.start()
        except RuntimeError:   # Python 3.12 starts no thread at exit: no deadline there
            _settle_and_destroy(errors)
        else:
            helper.join(timeout)
        if helper.is_alive():
            _say(f"the process group did not settle within {timeout:g} s (a peer gone or "
                 "stuck in a collective); leaving it to the interpreter (raise "
                 "LORASYNC_EXIT_TIMEOUT to wait longer)")
        for err in errors:
            _say(err)
        from lorasync.comm.wire import stop_runners

        if not stop_runners(timeout=1.0):
            _say("a point-to-point worker is still inside a collective")
        if not wait_workers_idle():
            _say(f"gloo's worker threads were still busy after {IDLE_TIMEOUT_S:g} s")
    except Exception as e:  # noqa: BLE001 - an exit guard must not change the exit
        _say(f"{type(e).__name__}: {e}")
