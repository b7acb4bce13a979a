"""Recovery logic without processes: checkpoint agreement, verification, safe loading,
stream history, fault counts, and the watchdog against a real in-process c10d store."""

import datetime
import json
import os
import random
import threading

import numpy as np
import pytest
import torch

from lorasync.errors import CheckpointError
from lorasync.monitor.metrics import RankStream, effective_records, read_jsonl_records
from lorasync.train import checkpoint as ckpt
from lorasync.train.recovery import fault_summary, history, resume_point_time


def _inv(*steps, world=2, ranks=(0, 1)):
    return {s: {"world_size": world, "ranks": list(ranks)} for s in steps}


@pytest.mark.parametrize("held, world, step, own, peer, source", [
    # every rank holds the same checkpoints: the newest, everyone its own file
    ([_inv(10, 20), _inv(10, 20)], 2, 20, [0, 1], [], None),
    # node-local disks, rank 1's node died while finalizing 30: 20 is the newest common one
    ([_inv(20, 30, ranks=(0,)), _inv(10, 20, ranks=(1,))], 2, 20, [0, 1], [], None),
    # rank 1's node-local disk has nothing (a node that joins): it takes rank 0's state
    ([_inv(10, 20, ranks=(0,)), {}], 2, 20, [0], [1], 0),
    # written by 3 ranks, resumed by 2: everyone takes the lowest holder's replicated state
    ([_inv(40, world=3, ranks=(0, 1, 2)), _inv(40, world=3, ranks=(0, 1, 2))], 2, 40, [], [0, 1], 0),
    # rank 1's own file of step 20 is damaged (shared disk): it takes rank 0's state of 20
    ([{**_inv(10), 20: {"world_size": 2, "ranks": [0], "damaged": [1]}},
      {**_inv(10), 20: {"world_size": 2, "ranks": [0], "damaged": [1]}}], 2, 20, [0], [1], 0),
    # node-local disks, rank 0's own file of 20 damaged: rank 1 (intact) is the source
    ([{**_inv(10, ranks=(0,)), 20: {"world_size": 2, "ranks": [], "damaged": [0]}},
      _inv(10, 20, ranks=(1,))], 2, 20, [1], [0], 1),
    # no file of step 20 verifies anywhere: 20 is never chosen
    ([{**_inv(10), 20: {"world_size": 2, "ranks": [], "damaged": [0, 1]}},
      {**_inv(10), 20: {"world_size": 2, "ranks": [], "damaged": [0, 1]}}], 2, 10, [0, 1], [], None),
    # no checkpoint in common: start from the beginning
    ([_inv(30, ranks=(0,)), _inv(20, ranks=(1,))], 2, 0, [], [], None),
    ([{}, {}], 2, 0, [], [], None),
])
def test_choose(held, world, step, own, peer, source):
    plan = ckpt.choose(held, world)
    assert (plan.step, plan.own, plan.peer, plan.source) == (step, own, peer, source), plan.note


def test_choose_takes_string_keys_from_a_gather():
    plan = ckpt.choose([{"8": {"world_size": 1, "ranks": [0]}}], 1)
    assert plan.step == 8 and plan.own == [0]


def _save(run, step, rank=0, world=1, keep=5, state=None):
    return ckpt.save(str(run), step, state or {"x": torch.tensor([step])}, {"k": 1}, rank=rank,
                     local_rank=0, world_size=world, barrier=lambda: None, keep=keep)


def test_damaged_state_file_is_not_held(tmp_path):
    _save(tmp_path, 2)
    final = _save(tmp_path, 4)
    assert ckpt.inventory(str(tmp_path)) == {
        2: {"world_size": 1, "ranks": [0], "damaged": []},
        4: {"world_size": 1, "ranks": [0], "damaged": []}}
    path = os.path.join(final, "lorasync", "rank0.pt")
    data = open(path, "rb").read()
    with open(path, "wb") as fh:  # cut short, as a disk that filled up would leave it
        fh.write(data[: len(data) // 2])
    assert not ckpt.verified(final, 0)
    damaged = {2: {"world_size": 1, "ranks": [0], "damaged": []},
               4: {"world_size": 1, "ranks": [], "damaged": [0]}}
    assert ckpt.inventory(str(tmp_path)) == damaged
    assert ckpt.choose([damaged], 1).step == 2
    with open(path, "wb") as fh:  # same size, other bytes
        fh.write(bytes(len(data)))
    assert ckpt.inventory(str(tmp_path)) == damaged
    assert ckpt.latest(str(tmp_path)).endswith("checkpoint-2")


def test_state_files_load_with_weights_only_and_restore_the_rngs(tmp_path):
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    st = ckpt.rng_state()
    expect = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    final = _save(tmp_path, 1, state={"rng": st, "opt": {"state": {}, "lr": 0.1}})
    loaded = ckpt.load_rank(final, 0)  # weights_only=True inside
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    ckpt.set_rng_state(loaded["rng"])
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expect


def test_earlier_versions_numpy_rng_state_still_loads(tmp_path):
    legacy = {"rng": {"torch": torch.random.get_rng_state(), "python": random.getstate(),
                      "numpy": np.random.get_state()}}
    folder = tmp_path / "checkpoints" / "step-000003"
    folder.mkdir(parents=True)
    torch.save(legacy, folder / "rank0.pt")
    (folder / "meta.json").write_text(json.dumps({"step": 3, "world_size": 1}))
    assert not ckpt.verified(str(folder), 0)  # no size/hash record: not trusted for a resume
    ckpt.set_rng_state(ckpt.load_rank(str(folder), 0)["rng"])


def test_a_pickled_object_is_refused(tmp_path):
    folder = tmp_path / "checkpoints" / "step-000001"
    folder.mkdir(parents=True)
    torch.save({"evil": threading.Lock}, folder / "rank0.pt")
    with pytest.raises(CheckpointError, match="loads safely"):
        ckpt.load_rank(str(folder), 0)


def test_pruning_keeps_the_newest(tmp_path):
    for s in (1, 2, 3):
        _save(tmp_path, s, keep=2)
    assert sorted(ckpt.inventory(str(tmp_path))) == [2, 3]


def _stream(run, rank, recs):
    os.makedirs(run / "ranks", exist_ok=True)
    (run / "ranks" / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def _step(s, t, rank=0):
    return {"step": s, "rank": rank, "time": t, "step_s": 1.0, "samples": 2}


def test_effective_records_drop_steps_run_again():
    a1 = [{"event": "start", "attempt": 1, "resumed_from": 0, "cause": "new"}]
    a1 += [_step(s, 100 + s) for s in range(1, 8)]  # failed after step 7
    a2 = [{"event": "start", "attempt": 2, "resumed_from": 5, "cause": "recover"}]
    a2 += [_step(s, 200 + s) for s in range(6, 10)]
    [recs] = effective_records([a1 + a2])
    assert [(r["step"], r["time"]) for r in recs] == \
        [(s, 100 + s) for s in range(1, 6)] + [(s, 200 + s) for s in range(6, 10)]
    # a rank that was not in the later attempt: its steps after 5 ran again without it
    gone = [{"event": "start", "attempt": 1, "resumed_from": 0}] + \
        [_step(s, 100 + s, rank=1) for s in range(1, 8)]
    _, kept = effective_records([a1 + a2, gone])
    assert [r["step"] for r in kept] == [1, 2, 3, 4, 5]


def test_history_and_fault_summary(tmp_path):
    recs = [{"event": "start", "attempt": 1, "resumed_from": 0, "cause": "new", "time": 99.0}]
    recs += [_step(s, 100 + s) for s in range(1, 8)]
    recs.append({"event": "fault", "time": 108.5, "kind": "silent", "peer": 1,
                 "message": "lorasync: rank 0: rank 1 stopped answering"})
    _stream(tmp_path, 0, recs)
    h = history(str(tmp_path), 0)
    assert h["attempt"] == 1 and not h["clean"] and h["last_step"] == 7
    assert [f["kind"] for f in h["faults"]] == ["silent"]
    assert resume_point_time(str(tmp_path), 0, 5) == 105
    recs += [{"event": "start", "attempt": 2, "resumed_from": 5, "cause": "recover",
              "restart_count": 1, "steps_redone": 2, "resume_point_time": 105.0}]
    recs += [_step(s, 130 + s) for s in range(6, 9)] + [{"event": "end", "how": "done"}]
    f = fault_summary([recs])
    # lost: from the end of step 5 (105) to the start of the first new step (136 - 1)
    assert (f["faults"], f["restarts"], f["steps_redone"], f["detected"]) == (1, 1, 2, 1)
    assert f["time_lost_s"] == pytest.approx(30.0)
    _stream(tmp_path, 0, recs)
    assert history(str(tmp_path), 0)["clean"]


def test_rank_stream_appends_and_repairs_a_torn_tail(tmp_path):
    s = RankStream(str(tmp_path), 0)
    s.write({"step": 1})
    s.close()
    with open(tmp_path / "ranks" / "rank0.jsonl", "a") as fh:
        fh.write('{"step": 2, "lo')  # a crash mid-write
    s = RankStream(str(tmp_path), 0)
    assert [r["step"] for r in s.records] == [1]
    s.write({"step": 2})
    s.close()
    s.write({"event": "fault"})  # after close: still appended (a failing attempt's last word)
    assert [r.get("step", r.get("event")) for r in
            read_jsonl_records(str(tmp_path / "ranks" / "rank0.jsonl"))] == [1, 2, "fault"]


# ---------------------------------------------------------------- the watchdog


def _members(n):
    return [{"rank": r, "node": r, "host": "h", "addr": f"10.0.0.{r + 1}", "pid": 1, "boot": ""}
            for r in range(n)]


def _dog(store_port, rank, members, fired, bound=3.0):
    from lorasync.train.watchdog import Watchdog

    def on_exit(code):
        fired.setdefault(rank, {})["code"] = code

    return Watchdog(rank=rank, members=members, store_addr="127.0.0.1", store_port=store_port,
                    prefix="t/", min_timeout_s=bound, steps=10,
                    on_fault=lambda e: fired.setdefault(rank, {}).update(event=e),
                    next_action=lambda: ("restart", "restarting (restart 1 of 3)"),
                    exit=on_exit)


def test_watchdog_names_the_peer_that_stops_beating():
    import torch.distributed as dist

    from lorasync.train.watchdog import EXIT_FAULT

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    members, fired = _members(3), {}
    dogs = [_dog(server.port, r, members, fired) for r in range(3)]
    for d in dogs:
        d.start()
    try:
        deadline = threading.Event()
        deadline.wait(1.5)
        assert not fired, fired  # everyone beats: no verdict
        dogs[2].stop()  # rank 2 freezes: its beats stop
        for _ in range(300):
            if 0 in fired and 1 in fired:
                break
            deadline.wait(0.1)
        for r in (0, 1):
            e = fired[r]["event"]
            assert fired[r]["code"] == EXIT_FAULT
            assert e["peer"] == 2 and e["kind"] == "silent" and e["next"] == "restart"
            assert "rank 2 (node 2" in e["message"] and "stopped answering" in e["message"]
            assert "restarting" in e["message"]
        # the first verdict is shared: the other rank reports that one
        assert sum("reported" in fired[r]["event"]["message"] for r in (0, 1)) == 1
    finally:
        for d in dogs:
            d.stop()


def test_peer_named_from_a_gloo_error():
    from lorasync.train.watchdog import peer_in_error

    members = _members(3)
    err = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [10.0.0.3]:41234: "
           "Connection reset by peer. This is typically caused by ...")
    assert peer_in_error(err, members, 0)["rank"] == 2
    assert peer_in_error("Connection reset by peer", members[:2], 0)["rank"] == 1


def test_classify_attempts(tmp_path):
    from lorasync.train.recovery import classify

    kw = dict(resumed_from=10, world=2, restart_count=0, run_dir=str(tmp_path), rank=0)
    assert classify([{"attempt": 0, "records": False}] * 2, {}, **kw).cause == "new"
    clean = {"attempt": 1, "records": True, "clean": True, "last_step": 10, "world_size": 2}
    assert classify([clean, clean], clean, **kw).cause == "resume"
    failed = dict(clean, clean=False, last_step=13, faults=[
        {"time": 1.0, "rank": 0, "step": 13, "what": "rank 1 stopped answering",
         "message": "lorasync: rank 0 (node 0): rank 1 stopped answering; restarting"}])
    a = classify([failed, clean], failed, **dict(kw, restart_count=1))
    assert (a.number, a.cause, a.steps_redone, a.reached) == (2, "recover", 3, 13)
    assert a.reason == "rank 0 at step 13: rank 1 stopped answering"
    assert "restart 1 of" in a.describe(10, 2)
    grew = classify([failed, {"attempt": 0, "records": False}, failed], failed,
                    **dict(kw, world=3, restart_count=1))
    assert grew.membership == "grew" and grew.reason.startswith("a node joined: 2 -> 3")
    shrank = classify([failed], failed, **dict(kw, world=1, restart_count=1))
    assert shrank.membership == "shrank" and shrank.reason.endswith("going on with 1 of 2 ranks")


def test_a_corrupt_middle_line_hides_nothing_after_it(tmp_path):
    """A damaged line inside a rank stream is skipped and counted; every record
    after it (later appends, later attempts) still counts.  A torn last line is
    still cut before the next attempt appends."""
    a1 = [{"event": "start", "attempt": 1, "resumed_from": 0, "cause": "new", "time": 1.0}]
    a1 += [_step(s, 100 + s) for s in range(1, 5)]
    a2 = [{"event": "start", "attempt": 2, "resumed_from": 2, "cause": "recover", "time": 200.0}]
    a2 += [_step(s, 200 + s) for s in range(3, 7)]
    path = tmp_path / "ranks" / "rank0.jsonl"
    _stream(tmp_path, 0, a1)
    with open(path, "a") as fh:
        fh.write('{"step": 5, "lo\x00\x00\x00ss": 1.2}\n')   # damaged, then appended to
        fh.write("[1, 2]\n")                                  # valid JSON, not a record
        fh.write("".join(json.dumps(r) + "\n" for r in a2))
        fh.write('{"step": 7, "lo')                            # a crash mid-write
    with pytest.warns(RuntimeWarning, match=r"skipped 2 corrupt line\(s\) \(line 6, 7\)"):
        recs = read_jsonl_records(str(path))
    assert recs == a1 + a2
    h = history(str(tmp_path), 0)
    assert h["attempt"] == 2 and h["last_step"] == 6
    s = RankStream(str(tmp_path), 0)   # cuts the torn tail, keeps everything else
    assert s.records == a1 + a2
    s.write(_step(7, 207))
    s.close()
    assert read_jsonl_records(str(path))[-1]["step"] == 7
    [steps] = effective_records([read_jsonl_records(str(path))])
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6, 7]


def test_a_user_error_is_said_once_across_restarts(tmp_path, monkeypatch):
    """Workers restarted after a user error stop at once; rank 0 says the error
    only if no earlier try of rank 0 said it, then never again."""
    from lorasync.errors import LorasyncError
    from lorasync.train.worker import _mark_fatal, _stop_if_fatal_before

    monkeypatch.setenv("LORASYNC_FATAL_DIR", str(tmp_path))
    _stop_if_fatal_before(0)                       # nothing marked: goes on
    _mark_fatal(1, "data.path: bad")               # rank 1's error; rank 0 died of it
    with pytest.raises(LorasyncError):
        _stop_if_fatal_before(1)                   # (train/cli.py: exit 2, silently, not rank 0)
    with pytest.raises(LorasyncError, match="data.path: bad"):
        _stop_if_fatal_before(0)                   # rank 0 says it, once
    for rank in (0, 1):
        with pytest.raises(SystemExit) as stop:
            _stop_if_fatal_before(rank)
        assert stop.value.code == 2
