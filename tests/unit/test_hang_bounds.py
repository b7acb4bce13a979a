"""No hang in any phase, in one process: the watchdog tells a stuck peer from a
slow one, the verdict exits when its record cannot be written, the start of a
group and a rendezvous round after a failure name who did not arrive, and a
teardown that does not return is left behind.  (The same on real gloo runs:
tests/dist/test_hangs.py.)"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time

import pytest

from lorasync.train import watchdog as wd


def _members(n):
    return [{"rank": r, "node": r, "host": "h", "addr": f"10.0.0.{r + 1}", "pid": 100 + r,
             "boot": ""} for r in range(n)]


@pytest.fixture
def store():
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))


def _dogs(store, n, fired, bound=1.0):
    members = _members(n)

    def make(rank):
        return wd.Watchdog(rank=rank, members=members, store_addr="127.0.0.1",
                           store_port=store.port, prefix="t/", min_timeout_s=bound, steps=10,
                           on_fault=lambda e: fired.setdefault(rank, {}).update(event=e),
                           next_action=lambda: ("give up", "giving up"),
                           exit=lambda code: fired.setdefault(rank, {}).update(code=code))
    dogs = [make(r) for r in range(n)]
    for d in dogs:
        d.mark("checkpoint", 4)
        d.start()
    return dogs


def _wait_for(cond, seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end and not cond():
        time.sleep(0.05)
    return cond()


def test_a_stuck_peer_behind_the_others_is_named_with_its_phase(store):
    """Ranks 0 and 2 wait at a checkpoint barrier; rank 1 beats (its thread
    lives) but its main thread makes no progress before that barrier."""
    fired = {}
    dogs = _dogs(store, 3, fired)
    with contextlib.ExitStack() as waits:
        try:
            for r in (0, 2):
                waits.enter_context(dogs[r].waiting("the barrier after writing"))
            t0 = time.monotonic()
            assert _wait_for(lambda: 0 in fired and 2 in fired, 30), fired
            took = time.monotonic() - t0
        finally:
            for d in dogs:
                d.stop()
    assert 1 not in fired                       # the stuck rank does not judge itself
    for r in (0, 2):
        e = fired[r]["event"]
        assert fired[r]["code"] == wd.EXIT_FAULT and e["peer"] == 1, e
        assert (e["peer_phase"], e["peer_step"]) == ("checkpoint", 4)
        assert "rank 1 (node 1" in e["message"] and "alive but stuck" in e["message"]
    first = [fired[r]["event"] for r in (0, 2) if "reported" not in fired[r]["event"]["what"]]
    assert first and first[0]["kind"] == "stuck"
    assert "waits at the barrier after writing" in first[0]["message"]
    assert took < 15  # the bound is 1 s here: named, not the process group's 10 minutes


def test_a_slow_peer_that_makes_progress_is_not_stuck(store):
    """Rank 1 takes twice the bound to reach the barrier, but ticks on its
    way: no verdict.  Once it stops ticking, it is named.  (Bounds of 3 s where
    nothing may be named: a loaded host can starve a thread for a second.)"""
    fired = {}
    dogs = _dogs(store, 2, fired, bound=3.0)
    try:
        with dogs[0].waiting("the evaluation's all-reduce"):
            for _ in range(30):              # 6 s of work, a mark every 0.2 s
                dogs[1].tick("batch")
                time.sleep(0.2)
            assert not fired, fired
            assert _wait_for(lambda: 0 in fired, 20), fired   # now it stops
        assert fired[0]["event"]["peer"] == 1 and fired[0]["event"]["kind"] == "stuck"
    finally:
        for d in dogs:
            d.stop()


def test_a_peer_ahead_or_level_is_never_stuck(store):
    """Both ranks wait at the same point (the network, not a rank, is slow),
    or the one that makes no progress is ahead: nobody is named."""
    fired = {}
    dogs = _dogs(store, 2, fired, bound=3.0)
    try:
        with dogs[0].waiting("a barrier"), dogs[1].waiting("a barrier"):
            time.sleep(5)
        with dogs[0].waiting("the next barrier"):
            for _ in range(25):              # rank 1 works, rank 0 ahead waits for it
                dogs[1].tick()
                time.sleep(0.2)
        assert not fired, fired
    finally:
        for d in dogs:
            d.stop()


def test_the_model_load_has_no_bound_of_its_own(store):
    fired = {}
    dogs = _dogs(store, 2, fired, bound=3.0)
    try:
        dogs[1].tick("load", allow_s=float("inf"))
        with dogs[0].waiting("the gather of every rank's checkpoints"):
            time.sleep(5)
        assert not fired, fired
    finally:
        for d in dogs:
            d.stop()


def test_a_bound_grows_with_the_measured_pause():
    d = wd.Watchdog(rank=0, members=_members(1), store_addr="", store_port=0, prefix="",
                    min_timeout_s=2, steps=10, on_fault=print,
                    next_action=lambda: ("", ""))
    d.mark("eval", 3)
    assert d.stage_bound() == 2
    d._moved -= 0.5                        # a batch took half a second
    d.tick("batch")
    assert d.stage_bound() == pytest.approx(5, rel=0.05)   # 10 x 0.5 s
    d.tick(allow_s=40)
    assert d.stage_bound() == 40
    d.step_done(1.0)
    assert d.stage_bound("train", 0) == 10 and d.stage_bound("checkpoint", 1) == 10


def test_the_verdict_exits_when_its_record_hangs(monkeypatch):
    """The rank stream sits on a disk that hangs: the line is said, the worker
    exits 75 anyway, within the verdict's write deadline."""
    monkeypatch.setattr(wd, "_VERDICT_WRITE_S", 0.5)
    said, exited, hung = [], [], threading.Event()
    monkeypatch.setattr(wd, "_say", said.append)
    d = wd.Watchdog(rank=0, members=_members(2), store_addr="", store_port=0, prefix="",
                    min_timeout_s=2, steps=10, on_fault=lambda e: hung.wait(),
                    next_action=lambda: ("give up", "giving up"), exit=exited.append)
    t0 = time.monotonic()
    d.connection_lost(RuntimeError("Connection reset by peer"))
    assert exited == [wd.EXIT_FAULT] and time.monotonic() - t0 < 3
    assert said and "lost the connection to rank 1" in said[0]
    hung.set()


def test_bounded_call():
    assert wd.bounded_call(lambda: None, 1)
    stop = threading.Event()
    t0 = time.monotonic()
    assert not wd.bounded_call(stop.wait, 0.3)
    assert time.monotonic() - t0 < 2
    stop.set()
    with pytest.raises(ValueError):
        wd.bounded_call(lambda: int("x"), 1)


def test_stall_hook_is_off_unless_it_names_this_rank(monkeypatch):
    """Each call runs in a helper thread with a bound: a hook that stalls where
    it should not fails within that bound, not at the suite's timeout."""
    def returns(*where):
        return wd.bounded_call(lambda: wd.stall_here(*where), 10)

    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setenv(wd.STALL_ENV, "eval.batch:0,checkpoint:1")
    assert returns("eval", "batch"), "stalled at rank 0's point"
    assert returns("checkpoint", "write"), "stalled at a point not named"
    # the one it names blocks (its thread stays behind, asleep, until the process ends)
    assert not wd.bounded_call(lambda: wd.stall_here("checkpoint"), 0.5), "did not stall"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert returns("checkpoint"), "stalled in a restarted group"
    monkeypatch.delenv(wd.STALL_ENV)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    assert returns("checkpoint"), "stalled with the hook unset"


# ---------------------------------------------------------------- the start of the group


def _guard(store, rank, world, said, exited):
    return wd.StartGuard(rank=rank, world=world, bound_s=1.0, store_addr="127.0.0.1",
                         store_port=store.port, bound_text="1 s",
                         next_action=lambda: ("give up", "giving up"), exit=exited.append)


@pytest.mark.parametrize("rank1, expect", [
    (None, "rank 1 (its worker never connected to the group's store at 127.0.0.1:"),
    ("store", "rank 1 (node 0, "),
])
def test_the_start_names_the_rank_that_did_not_arrive(store, monkeypatch, rank1, expect):
    said, exited = [], []
    monkeypatch.setattr(wd, "_say", said.append)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    g0 = _guard(store, 0, 2, said, exited).start()
    g0.connecting()
    g0.reached("store", store)
    g0.reached("group", store)
    if rank1:   # rank 1's own marks (its guard is not what is tested here)
        _guard(store, 1, 2, [], []).reached(rank1, store)
    assert _wait_for(lambda: exited, 15)
    assert exited == [wd.EXIT_FAULT]
    msg = said[0]
    assert msg.startswith("lorasync: rank 0 (node 0), start of the group (created the "
                          "process group") and expect in msg, msg
    assert ("did not connect to the group's store" if rank1 is None else
            "connected to the group's store but did not create the process group") in msg


def test_a_start_that_completes_in_time_says_nothing(store, monkeypatch):
    said, exited = [], []
    g = _guard(store, 0, 1, said, exited).start()
    g.reached("members", store)
    g.done()
    time.sleep(1.5)
    assert not exited and not said


# ---------------------------------------------------------------- the rendezvous


def test_a_round_after_a_failure_is_bounded_and_names_the_node_not_back(monkeypatch):
    """Two agents meet; after a failure one comes back for the next round and
    the other never leaves the round before (its agent is stuck stopping a
    worker): the one that came back stops with a line naming the other after
    the restart bound, not torch's 600 s."""
    import socket

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import \
        C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler, create_handler)

    from lorasync.launch import EXIT_FAULT
    from lorasync.launch import rendezvous as rdzv

    # as lorasync's launchers run it: a fresh store per round (no store server
    # for the workers created by the handler); installed once, undone after the test
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    monkeypatch.setattr(DynamicRendezvousHandler, "next_rendezvous",
                        DynamicRendezvousHandler.next_rendezvous)
    rdzv.install_rendezvous_bound("node-a", restart_join_s=2.0)
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=30))
    params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{host.port}",
                                  run_id="hangs", min_nodes=2, max_nodes=2,
                                  local_addr=socket.gethostname(), last_call_timeout=1)
    # each agent with a connection of its own (one TCPStore client is not for two threads)
    clients = [dist.TCPStore("127.0.0.1", host.port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=30)) for _ in range(2)]
    handlers = [create_handler(c, C10dRendezvousBackend(c, "hangs"), params) for c in clients]
    try:
        with_both = [None, None]
        threads = [threading.Thread(target=lambda i=i: with_both.__setitem__(
            i, handlers[i].next_rendezvous())) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(with_both), "the first round did not complete"
        t0 = time.monotonic()
        with pytest.raises(rdzv.RendezvousStalled) as stalled:
            handlers[0].next_rendezvous()
        assert time.monotonic() - t0 < 20
        msg = str(stalled.value)
        assert msg.startswith("node-a: the rendezvous 'hangs' timed out after ")
        assert "bound 2 s for a round after a failure" in msg
        other = handlers[1]._this_node
        assert f"{other.addr} (agent pid {other.pid}) never left the round before" in msg
        assert stalled.value.exit_code == EXIT_FAULT == 75
    finally:
        for h in handlers:
            h.shutdown()


def _judge(fired: dict):
    """Rank 0 of 2 with a 3 s bound; a verdict lands in ``fired``."""
    return wd.Watchdog(rank=0, members=_members(2), store_addr="", store_port=0, prefix="",
                       min_timeout_s=3, steps=10,
                       on_fault=lambda e: fired.setdefault("event", e),
                       next_action=lambda: ("give up", "giving up"),
                       exit=lambda code: fired.setdefault("code", code))


def test_a_stale_beat_of_a_peer_waiting_at_a_point_passed_is_not_stuck():
    """The race CI met: both ranks waited 5 s at one barrier; this rank left it
    and waits at the next one before the peer's next beat says it left too.
    Its beat still shows it waiting at the barrier, unchanged for 5 s: that
    wait counts from when this rank saw it behind, not from 5 s ago.  A peer
    that stays behind, waiting, is still named once the bound has passed."""
    fired = {}
    d = _judge(fired)
    d.mark("checkpoint", 4)
    with d.waiting("a barrier"):
        pass
    with d.waiting("the next barrier"):
        peer = {"s": 4, "p": "checkpoint", "i": 1, "t": 0, "w": "a barrier", "q": True,
                "b": 3.0, "x": ""}
        pos = {1: ((4, "checkpoint", 1, 0), 100.0)}          # unchanged since t=100
        d._check_stuck({1: peer}, pos, now=105.0)           # 5 s: the stale beat
        assert not fired, fired
        d._check_stuck({1: peer}, pos, now=107.0)           # 2 s seen behind
        assert not fired, fired
        d._check_stuck({1: peer}, pos, now=108.5)           # 3.5 s seen behind
        assert fired["code"] == wd.EXIT_FAULT and fired["event"]["peer"] == 1
        # working (not waiting) and behind: counted from its last progress, as before
    fired.clear()
    d2 = _judge(fired)
    d2.mark("checkpoint", 4)
    with d2.waiting("a barrier"):
        peer = dict(peer, i=0, w="", q=False)
        d2._check_stuck({1: peer}, {1: ((4, "checkpoint", 0, 0), 100.0)}, now=104.0)
        assert fired["event"]["peer"] == 1 and fired["event"]["kind"] == "stuck"


def test_a_peer_leaving_a_long_bulk_wait_late_is_not_stuck():
    """At 0.3 Mbit/s the replicas' 3.7 MB mean ended on this rank about 50 s
    before on the peer (this rank's last chunk still queued on the link), and
    the peer's beat then showed it leaving that wait with the same point and
    marks: it was named stuck for the 124 s since it entered the wait.  Now
    the peer may lag by this rank's own wait there, and leaving a wait is
    progress.  A peer that stays stuck after it is still named."""
    fired = {}
    d = _judge(fired)
    d.mark("eval", 10)
    d._waited[("eval", 1)] = 75.0      # this rank's own wait in the bulk all-reduce
    d._point = 1
    with d.waiting("the evaluation's all-reduce"):
        peer = {"s": 10, "p": "eval", "i": 1, "t": 0, "w": "the mean", "q": True,
                "b": 3.0, "x": ""}
        pos = {1: (wd._progress(peer), 100.0)}
        d._check_stuck({1: peer}, pos, now=175.0)    # seen behind from 175 s
        d._check_stuck({1: peer}, pos, now=225.0)    # 50 s behind, waiting: in bounds
        assert not fired, fired
        left = dict(peer, q=False, x="train/evaluate.py:50 evaluate")
        assert wd._progress(left) != pos[1][0]       # leaving the wait is progress
        pos = {1: (wd._progress(left), 226.0)}
        d._check_stuck({1: left}, pos, now=227.0)
        assert not fired, fired
        d._check_stuck({1: left}, pos, now=226.0 + 3.0 + 1.0)   # then working, no progress
        assert fired["event"]["peer"] == 1 and fired["event"]["kind"] == "stuck"


def test_a_peer_still_in_a_long_periodic_average_is_not_stuck():
    """LocalSGD's fp32 average at 0.3 Mbit/s: ~95 s in after_step on every rank.
    This rank left it and went on two steps; the peer, still receiving this
    rank's last chunk, waits in the same step's sync: within this rank's own
    longest wait there (plus the 3 s bound), it is not stuck; past that it is.
    Before, after_step was no common point and the peer was judged as working,
    from its last progress, against the step bound."""
    fired = {}
    d = _judge(fired)
    d.mark("train", 8)
    d._waited[("train", 1)] = 95.0   # this rank's longest after_step wait
    d.mark("train", 10)
    with d.waiting("the step's sync (after_step)"):
        pass
    peer = {"s": 8, "p": "train", "i": 1, "t": 0, "w": "the step's sync (after_step)",
            "q": True, "b": 30.0, "x": ""}
    pos = {1: (wd._progress(peer), 0.0)}
    d._check_stuck({1: peer}, pos, now=113.0)    # in it for 113 s, seen behind from now
    d._check_stuck({1: peer}, pos, now=113.0 + 90.0)   # 90 s behind: within 3 + 95 s
    assert not fired, fired
    d._check_stuck({1: peer}, pos, now=113.0 + 3.0 + 95.0 + 1.0)
    assert fired["event"]["peer"] == 1
