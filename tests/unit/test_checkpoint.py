"""Checkpoint files: what counts, what is pruned, what a group resumes from, and
that none of it loses the last good checkpoint, whatever dies when."""

import hashlib
import json
import os
import shutil
import tempfile
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lorasync.errors import CheckpointError
from lorasync.train import checkpoint as ckpt
from lorasync.train.checkpoint import format as fmt


def _ck(run, step):
    """The folder of ``step``'s checkpoint (``RUN/checkpoint-N``)."""
    return os.path.join(str(run), f"checkpoint-{step}")


def _names(run):
    """The checkpoint folders of a run, by name."""
    return sorted((n for n in os.listdir(run) if n.startswith("checkpoint-")),
                  key=lambda n: int(n.split("-")[1]))


def _save(run, step, keep=2):
    return ckpt.save(str(run), step, {"x": step}, {"k": 1}, rank=0, local_rank=0, world_size=1,
                     barrier=lambda: None, keep=keep)


def test_latest_skips_torn_and_partial(tmp_path):
    _save(tmp_path, 4)
    _save(tmp_path, 8)
    root = tmp_path / "checkpoints"
    # a crash while writing: the hidden temp folder and a folder without meta
    os.makedirs(root / ".tmp-step-000012")
    (root / ".tmp-step-000012" / "rank0.pt").write_bytes(b"garbage")
    os.makedirs(root / "step-000016")
    (root / "step-000020").mkdir()
    (root / "step-000020" / "meta.json").write_text("{not json")
    os.makedirs(tmp_path / ".tmp-checkpoint-24" / "lorasync")
    (tmp_path / "checkpoint-28").mkdir()
    assert ckpt.latest(str(tmp_path)).endswith("checkpoint-8")
    assert ckpt.load_rank(ckpt.latest(str(tmp_path)), 0) == {"x": 8}
    assert ckpt.read_meta(ckpt.latest(str(tmp_path)))["step"] == 8


def test_keeps_only_the_newest(tmp_path):
    for s in (1, 2, 3, 4):
        _save(tmp_path, s, keep=2)
    assert _names(tmp_path) == ["checkpoint-3", "checkpoint-4"]
    meta = json.loads((tmp_path / "checkpoint-4" / "lorasync" / "meta.json").read_text())
    assert meta["world_size"] == 1 and meta["k"] == 1


def test_no_checkpoint(tmp_path):
    assert ckpt.latest(str(tmp_path)) is None


# ---------------------------------------------------------------- the cases


def _damage(folder, rank, how):
    """``flip``: same size, other bytes; ``cut``: cut short and its record gone;
    ``norecord``: the record gone."""
    folder = fmt._state(str(folder))
    path = os.path.join(folder, f"rank{rank}.pt")
    data = open(path, "rb").read()
    if how == "flip":
        with open(path, "r+b") as fh:
            fh.seek(len(data) // 2)
            fh.write(bytes(b ^ 0xFF for b in data[len(data) // 2:len(data) // 2 + 8]))
    if how == "cut":
        with open(path, "wb") as fh:
            fh.write(data[: len(data) // 2])
    if how in ("cut", "norecord"):
        os.remove(os.path.join(folder, f"rank{rank}.json"))


def test_a_stale_later_folder_never_displaces_the_new_checkpoint(tmp_path):
    """The issue's case: keep 2, a run went back to step 4 (its 6 was damaged, an 8
    of another timeline is stale).  Saving 5 must keep 5 (and 4), never 6 or 8."""
    for s in (2, 4, 6, 8):
        _save(tmp_path, s, keep=10)
    _damage(_ck(tmp_path, 6), 0, "flip")
    assert ckpt.choose([ckpt.inventory(str(tmp_path))], 1).step == 8
    _damage(_ck(tmp_path, 8), 0, "norecord")
    assert ckpt.choose([ckpt.inventory(str(tmp_path))], 1).step == 4
    _save(tmp_path, 5, keep=2)
    assert _names(tmp_path) == ["checkpoint-4", "checkpoint-5"]
    assert ckpt.choose([ckpt.inventory(str(tmp_path))], 1).step == 5


def test_pruning_keeps_the_newest_verified_when_the_new_one_is_damaged(tmp_path, monkeypatch):
    for s in (1, 2, 3):
        _save(tmp_path, s, keep=1)
    assert _names(tmp_path) == ["checkpoint-3"]
    real = fmt._write_atomic

    def bad_disk(path, data):  # the state file lands with a bit flipped
        real(path, data[:-1] + bytes([data[-1] ^ 1]) if path.endswith(".pt") else data)
    monkeypatch.setattr(fmt, "_write_atomic", bad_disk)
    _save(tmp_path, 4, keep=1)
    assert not ckpt.intact(_ck(tmp_path, 4))
    # the one just written stays, and so does the newest that verifies
    assert _names(tmp_path) == ["checkpoint-3", "checkpoint-4"]
    assert ckpt.latest(str(tmp_path)).endswith("checkpoint-3")


def test_a_truncated_checkpoint_without_record_is_not_loaded(tmp_path):
    _save(tmp_path, 2)
    final = _save(tmp_path, 4)
    _damage(final, 0, "cut")
    inv = ckpt.inventory(str(tmp_path))
    assert inv[4] == {"world_size": 1, "ranks": [], "damaged": [0]}
    assert ckpt.choose([inv], 1).step == 2
    # the launcher's last word names a checkpoint a resume can start from
    assert ckpt.latest(str(tmp_path)).endswith("checkpoint-2")
    # an intact file whose record is missing is not trusted either
    _damage(_ck(tmp_path, 2), 0, "norecord")
    assert not ckpt.verified(_ck(tmp_path, 2), 0)
    assert ckpt.choose([ckpt.inventory(str(tmp_path))], 1).step == 0
    assert ckpt.latest(str(tmp_path)) is None


@pytest.mark.parametrize("content", [
    b"",                                   # EOFError
    b"hello world\n",                      # stray bytes read as pickle opcodes
    "zip-cut",                             # RuntimeError: failed finding central directory
    "zip-hole",                            # RuntimeError: invalid header
])
def test_a_corrupt_state_file_is_one_checkpoint_error(tmp_path, content):
    """Even with a record that matches (written corrupt, or replaced with its
    record): one line naming the file and the fix, never torch's traceback."""
    ck = _ck(tmp_path, 1)
    folder = tmp_path / "checkpoint-1" / "lorasync"
    folder.mkdir(parents=True)
    path = folder / "rank0.pt"
    torch.save({"x": torch.zeros(256)}, path)
    data = path.read_bytes()
    data = {"zip-cut": data[: len(data) // 2],
            "zip-hole": data[:100] + bytes(200) + data[300:]}.get(content, content)
    path.write_bytes(data)
    (folder / "rank0.json").write_text(json.dumps(
        {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}))
    assert ckpt.verified(ck, 0)
    with pytest.raises(CheckpointError) as err:
        ckpt.load_rank(ck, 0)
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg and "move" in msg and "Traceback" not in msg
    assert err.value.exit_code == 2


# ---------------------------------------------------------------- restore, in one process


class _Sync:
    name, world_size, rank = "allreduce", 1, 0

    def state_dict(self):
        return {"n": 1}

    def load_state_dict(self, st):
        self.loaded = st


def _parts(r=4):
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.lora_A = torch.nn.Parameter(torch.randn(r, 8))
    opt = torch.optim.AdamW([model.lora_A], lr=0.1)
    model.lora_A.grad = torch.ones_like(model.lora_A)
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return {"model": model, "opt": opt, "sched": sched, "sync": _Sync()}


@pytest.fixture
def group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _checkpointer(run):
    return ckpt.Checkpointer(str(run), rank=0, local_rank=0, world_size=1,
                             barrier=lambda: None, interval=1, keep=2)


def test_restore_loads_the_newest_restorable_and_refuses_what_does_not_fit(tmp_path, group):
    c = _checkpointer(tmp_path)
    saved = _parts()
    for step in (2, 4):
        c.save(ckpt.Progress(step=step, sample_offset=8 * step), meta={}, **saved)
    _damage(c.folder(4), 0, "cut")
    plan, _, _ = c.agree(resume=True, history={})
    assert plan.step == 2
    fresh, prog = _parts(), ckpt.Progress()
    with torch.no_grad():
        fresh["model"].lora_A.zero_()
    c.restore(plan, prog, 8, seed=0, **fresh)
    assert prog.step == 2 and prog.sample_offset == 16
    assert torch.equal(fresh["model"].lora_A, saved["model"].lora_A)
    # lora.r changed since the checkpoint was written: one line, naming what differs
    with pytest.raises(CheckpointError, match=r"does not fit .*lora_A is \(4, 8\) there, "
                                                   r"\(2, 8\) here"):
        c.restore(plan, ckpt.Progress(), 8, seed=0, **_parts(r=2))
    # a state file that verifies but does not load: every rank raises the same error
    path = os.path.join(c.folder(2), "lorasync", "rank0.pt")
    data = open(path, "rb").read()[:500]
    open(path, "wb").write(data)
    with open(os.path.join(c.folder(2), "lorasync", "rank0.json"), "w") as fh:
        json.dump({"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, fh)
    with pytest.raises(CheckpointError, match="cannot be loaded"):
        c.restore(plan, ckpt.Progress(), 8, seed=0, **_parts())


# ---------------------------------------------------------------- kill at every step of save()


class _Crash(Exception):
    """The process dies here."""


def _ops(monkeypatch, crash_at: dict, partial: bool, ranks_of: dict, counts: dict):
    """Count every file operation of train/checkpoint/ per rank (thread) and raise
    ``_Crash`` at ``crash_at[rank]``; ``partial``: a crashing rmtree has already
    deleted a state file of its folder (a kill in the middle of a delete)."""
    real = {"replace": os.replace, "rmtree": shutil.rmtree, "makedirs": os.makedirs,
            "write": fmt._write_atomic, "fsync": fmt._fsync_dir}

    inside = threading.local()   # os.makedirs calls itself for missing parents

    def wrap(name):
        def op(*a, **kw):
            rank = ranks_of.get(threading.get_ident())
            if name == "makedirs" and getattr(inside, "makedirs", False):
                # a parent folder made inside one call: on a shared disk whether it is
                # still missing depends on which rank got there first, so the count of
                # operations (and where a kill lands) would depend on the interleaving
                return real[name](*a, **kw)
            if rank is not None:
                counts[rank] = counts.get(rank, 0) + 1
                if counts[rank] == crash_at.get(rank):
                    if partial and name == "rmtree" and os.path.isdir(a[0]):
                        for dirpath, _, files in os.walk(a[0]):
                            if files:
                                # the last name: a state file, so that meta.json stays
                                os.remove(os.path.join(dirpath, sorted(files)[-1]))
                                break
                    raise _Crash(name)
            if name != "makedirs":
                return real[name](*a, **kw)
            inside.makedirs = True
            try:
                return real[name](*a, **kw)
            finally:
                inside.makedirs = False
        return op

    monkeypatch.setattr(os, "replace", wrap("replace"))
    monkeypatch.setattr(shutil, "rmtree", wrap("rmtree"))
    monkeypatch.setattr(os, "makedirs", wrap("makedirs"))
    monkeypatch.setattr(fmt, "_write_atomic", wrap("write"))
    monkeypatch.setattr(fmt, "_fsync_dir", wrap("fsync"))
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # durability is not what is tested here


def _group_save(dirs, step, keep, ranks_of):
    """Both ranks of a 2-rank group save ``step`` in threads (a real barrier);
    a rank that dies breaks the barrier for the other, as a dead peer would."""
    bar = threading.Barrier(2, timeout=20)
    died = {}

    def rank_main(r):
        ranks_of[threading.get_ident()] = r
        try:
            ckpt.save(dirs[r], step, {"r": r, "step": step}, {}, rank=r,
                      local_rank=0 if len(set(dirs)) == 2 else r, world_size=2,
                      barrier=bar.wait, keep=keep)
        except (_Crash, threading.BrokenBarrierError) as exc:
            died[r] = exc
            bar.abort()
        finally:
            ranks_of.pop(threading.get_ident(), None)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return died


def _history(dirs, layout):
    """Saves 2, 4, 6, 8 done; the group went back to 4: on a shared disk 6 is
    damaged everywhere and 8 has no records; on node-local disks node 0 alone
    finalized 6 (node 1 died first) and 8 is damaged on both."""
    ranks_of: dict = {}
    for s in (2, 4, 6, 8):
        assert not _group_save(dirs, s, 10, ranks_of)
    f = _ck
    if layout == "shared":
        for r in (0, 1):
            _damage(f(dirs[0], 6), r, "flip")
            _damage(f(dirs[0], 8), r, "norecord")
    else:
        shutil.rmtree(f(dirs[1], 6))
        _damage(f(dirs[0], 8), 0, "flip")
        _damage(f(dirs[1], 8), 1, "cut")
    plan = ckpt.choose([ckpt.inventory(d) for d in dirs], 2)
    assert plan.step == 4, plan.note


def _restorable(dirs, plan):
    """Every rank can restore the plan: its own file verifies, or the source's does."""
    f = lambda r: _ck(dirs[r], plan.step)  # noqa: E731
    for r in plan.own:
        assert ckpt.verified(f(r), r)
    if plan.peer:
        assert any(ckpt.verified(f(plan.source), k) for k in (0, 1))


def _snapshot(dirs):
    """{(disk, folder): sorted file names} of every complete step folder."""
    out = {}
    for i, d in enumerate(sorted(set(dirs))):
        for s, path in fmt._steps(d):
            out[(i, s)] = sorted(os.listdir(fmt._state(path)))
    return out


@pytest.mark.parametrize("layout", ["shared", "node-local"])
def test_a_kill_at_any_step_of_save_and_prune_loses_no_checkpoint(tmp_path, monkeypatch, layout):
    """Kill rank 0 or rank 1 at each file operation of saving step 5 (writing,
    finalizing, discarding the abandoned timeline, pruning; deletes cut in the
    middle too), with keep=1: the group can always resume from 4 or 5, never
    from the abandoned 6 or 8; a disk that finalized 5 holds nothing later; no
    folder that counts lost a file; and the restarted group's save of 5 leaves
    exactly 5."""
    def fresh(k):
        base = tmp_path / f"{layout}-{k}"
        dirs = [str(base / "a")] * 2 if layout == "shared" else [str(base / "a"), str(base / "b")]
        _history(dirs, layout)
        return dirs

    monkeypatch.setattr(os, "fsync", lambda fd: None)  # durability is not what is tested here
    # how many file operations each rank does in a clean save of 5
    counts: dict = {}
    dirs = fresh("count")
    with monkeypatch.context() as m:
        _ops(m, {}, False, ranks_of := {}, counts)
        assert not _group_save(dirs, 5, 1, ranks_of)
    assert counts[0] > 10
    cases = [(r, k, partial) for r in (0, 1) for k in range(1, counts[r] + 1)
             for partial in (False, True)]
    for n, (rank, k, partial) in enumerate(cases):
        dirs = fresh(n)
        before = _snapshot(dirs)
        with monkeypatch.context() as m:
            _ops(m, {rank: k}, partial, ranks_of := {}, {})
            died = _group_save(dirs, 5, 1, ranks_of)
        case = (rank, k, partial)
        assert rank in died and isinstance(died[rank], _Crash), case
        plan = ckpt.choose([ckpt.inventory(d) for d in dirs], 2)
        assert plan.step in (4, 5), (case, plan.note)
        _restorable(dirs, plan)
        for d in set(dirs):
            steps = [s for s, _ in fmt._folders(d)]
            if 5 in steps:
                assert max(steps) == 5, (case, d, steps)
        for key, files in _snapshot(dirs).items():
            assert key[1] == 5 or files == before[key], (case, key, files, before.get(key))
        # the restarted group saves 5 again; keep=1 leaves exactly that
        assert not _group_save(dirs, 5, 1, {}), case
        for d in set(dirs):
            assert _names(d) == ["checkpoint-5"], case
            assert not [n for n in os.listdir(d) if n.startswith(".")], case
        assert ckpt.choose([ckpt.inventory(d) for d in dirs], 2).step == 5


# ---------------------------------------------------------------- random inventories


@st.composite
def _inventories(draw):
    """Per rank what its disk holds: a step's folder with some intact and some
    damaged rank files, sometimes written by a group of another size; some
    ranks hold nothing (a new node)."""
    world = draw(st.integers(1, 4))
    held = []
    for _ in range(world):
        inv = {}
        for step in draw(st.sets(st.integers(1, 8), max_size=6)):
            ws = draw(st.sampled_from([world, world, world, world + 1]))
            state = draw(st.lists(st.sampled_from(["intact", "damaged", "absent"]),
                                  min_size=ws, max_size=ws))
            ranks = [r for r, s in enumerate(state) if s == "intact"]
            damaged = [r for r, s in enumerate(state) if s == "damaged"]
            if ranks or damaged:
                inv[draw(st.sampled_from([step, str(step)]))] = {
                    "world_size": ws, "ranks": ranks, "damaged": damaged}
        held.append(inv)
    return world, held


@settings(max_examples=300, deadline=None)
@given(_inventories())
def test_choose_always_picks_a_step_every_rank_can_restore(case):
    world, held = case
    plan = ckpt.choose(held, world)
    h = [{int(k): v for k, v in inv.items()} for inv in held]
    hist = [r for r in range(world) if h[r]]

    def usable(s):  # every rank with history holds it, and some rank an intact file
        return all(s in h[r] for r in hist) and any(h[r][s]["ranks"] for r in hist)

    steps = {s for r in hist for s in h[r]}
    assert plan.step == max((s for s in steps if usable(s)), default=0), plan.note
    if not plan.step:
        assert plan.own == plan.peer == [] and plan.source is None
        return
    assert sorted(plan.own + plan.peer) == list(range(world))
    for r in plan.own:  # its own file, intact, written by a group of this size
        e = h[r][plan.step]
        assert r in e["ranks"] and e["world_size"] == world
    if plan.peer:  # the source holds an intact file: never a damaged-only step
        assert plan.source in hist and h[plan.source][plan.step]["ranks"]
        damaged = [r for r in plan.peer if h[r] and r in h[r][plan.step]["damaged"]]
        if damaged and {h[r][plan.step]["world_size"] for r in hist} == {world}:
            assert "damaged" in plan.note
    else:
        assert plan.source is None


_KINDS = ["intact", "intact", "flip", "cut", "norecord", "incomplete"]


def _plant(run, step, kind, world, old=False):
    """A checkpoint folder of ``step`` in the layout of now, or (``old``) of the
    versions before (``RUN/checkpoints/step-N``)."""
    folder = os.path.join(run, "checkpoints", f"step-{step:06d}") if old else _ck(run, step)
    state = fmt._state(folder)
    os.makedirs(state)
    for r in range(world):
        data = f"state of rank {r} at step {step}".encode() * 20
        with open(os.path.join(state, f"rank{r}.pt"), "wb") as fh:
            fh.write(data)
        with open(os.path.join(state, f"rank{r}.json"), "w") as fh:
            json.dump({"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, fh)
    if kind in ("flip", "cut", "norecord"):
        _damage(folder, world - 1, kind)
    if kind != "incomplete":
        with open(os.path.join(state, "meta.json"), "w") as fh:
            json.dump({"step": step, "world_size": world}, fh)
    return folder


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.integers(1, 12), st.sampled_from(_KINDS), min_size=1, max_size=8),
       st.data(), st.integers(1, 3), st.integers(1, 2))
def test_pruning_never_removes_the_new_or_the_newest_verified(disk, data, keep, world):
    """Over both layouts: a run that resumed from checkpoints of the versions
    before holds some of each."""
    step = data.draw(st.sampled_from(sorted(disk)), label="just written")
    old = data.draw(st.sets(st.sampled_from(sorted(disk))), label="in the older layout")
    with tempfile.TemporaryDirectory() as tmp:
        folders = {s: _plant(tmp, s, kind, world, old=s in old and s != step)
                   for s, kind in disk.items()}
        verified = sorted((s for s, k in disk.items() if k == "intact" and s <= step),
                          reverse=True)
        fmt._prune(tmp, step, keep)
        left = [s for s, _ in fmt._folders(tmp)]
        assert step in left                                  # the one just written
        assert max(left) == step                             # no abandoned timeline
        kept = set(verified[:keep]) | {step}                 # keep newest that verify
        assert set(left) == kept, (disk, step, keep, left)
        if verified:
            newest = folders[verified[0]]
            assert ckpt.intact(newest)
            if disk[step] == "intact" or not any(
                    ckpt.verified(folders[step], r) for r in range(world)):
                assert ckpt.latest(tmp) == newest
        assert not [n for n in os.listdir(tmp) if n.startswith(".")]
        if os.path.isdir(os.path.join(tmp, "checkpoints")):
            assert not [n for n in os.listdir(os.path.join(tmp, "checkpoints"))
                        if n.startswith(".")]


def test_a_shared_disk_with_a_local_rank_0_per_node_keeps_every_rank_s_files(tmp_path):
    """Nodes sharing one file system (NFS, or emulated nodes on one host) each
    have a local rank 0 that clears a stale temp folder: another node's clearing,
    done while this rank is at the barrier before writing, must not take the
    folder this rank writes into (it did: FileNotFoundError in a 3-node fault test)."""
    tmp = tmp_path / ".tmp-checkpoint-4"
    calls = []

    def barrier():   # node 1's local rank 0 clears before the first barrier lets anyone on
        if not calls:
            shutil.rmtree(tmp, ignore_errors=True)
        calls.append(1)

    final = ckpt.save(str(tmp_path), 4, {"x": 4}, {"k": 1}, rank=0, local_rank=0, world_size=1,
                      barrier=barrier, keep=2)
    assert os.path.exists(os.path.join(final, ckpt.STATE_DIR, "rank0.pt"))
