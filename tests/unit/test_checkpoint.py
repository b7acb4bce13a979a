import json
import os

from lorasync.train import checkpoint as ckpt


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
    assert ckpt.latest(str(tmp_path)).endswith("step-000008")
    assert ckpt.load_rank(ckpt.latest(str(tmp_path)), 0) == {"x": 8}
    assert ckpt.read_meta(ckpt.latest(str(tmp_path)))["step"] == 8


def test_keeps_only_the_newest(tmp_path):
    for s in (1, 2, 3, 4):
        _save(tmp_path, s, keep=2)
    names = sorted(os.listdir(tmp_path / "checkpoints"))
    assert names == ["step-000003", "step-000004"]
    meta = json.loads((tmp_path / "checkpoints" / "step-000004" / "meta.json").read_text())
    assert meta["world_size"] == 1 and meta["k"] == 1


def test_no_checkpoint(tmp_path):
    assert ckpt.latest(str(tmp_path)) is None
