"""End-to-end runs of ``lorasync train`` on the tiny model: 2 gloo ranks via torchrun."""

import json
import os

import pytest
import torch

from conftest import run_cli

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

TINY = ["--model", "tiny", "--nproc", "2", "--batch-size", "2", "--eval-size", "8",
        "--max-new-tokens", "4", "--no-progress"]


def read_metrics(run):
    with open(os.path.join(run, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


# dropout on: an exact resume must restore the RNG too (test_resume_...); plain all-reduce
# named (the default is auto, whose first steps run DiLoCo): these tests check its bytes and
# replicas identical after every step, which a damaged rank's resume relies on
FINISHED = [*TINY, "--max-steps", "6", "--ckpt-interval", "3", "--tensorboard",
            "--lora-dropout", "0.1", "--comm", "allreduce"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run = str(tmp_path_factory.mktemp("runs") / "r")
    p = run_cli("train", *FINISHED, "--output-dir", run)
    assert p.returncode == 0, p.stderr[-3000:]
    return run, p


def test_run_directory_contents(finished_run):
    run, p = finished_run
    for name in ("config.yaml", "metrics.jsonl", "evals.jsonl", "summary.json",
                 "adapter/adapter_config.json", "adapter/adapter_model.safetensors",
                 "checkpoint-6/lorasync/meta.json", "checkpoint-6/lorasync/rank1.pt",
                 "checkpoint-6/adapter_model.safetensors", "checkpoint-6/tokenizer.json"):
        assert os.path.exists(os.path.join(run, name)), name
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(run, "tensorboard")))
    assert "lorasync run summary" in p.stdout and "exact-match before" in p.stdout


def test_metrics_one_record_per_rank_per_step(finished_run):
    run, _ = finished_run
    recs = read_metrics(run)
    assert [(r["step"], r["rank"]) for r in recs] == [(s, k) for s in range(1, 7) for k in (0, 1)]
    required = {"step", "rank", "strategy", "loss", "samples", "compute_s", "comm_s",
                "wire_bytes", "step_s"}
    for r in recs:
        assert required <= set(r)
        assert r["strategy"] == "allreduce" and r["samples"] == 2
        assert r["comm_s"] >= 0 and r["compute_s"] >= 0
        # fp32 all-reduce hands over every adapter gradient once per step
        assert r["wire_bytes"] == r["fp32_bytes"] == 4 * 7168


def test_replicas_stay_identical(finished_run):
    run, _ = finished_run
    a = torch.load(os.path.join(run, "checkpoint-6/lorasync/rank0.pt"), weights_only=False)
    b = torch.load(os.path.join(run, "checkpoint-6/lorasync/rank1.pt"), weights_only=False)
    assert a["adapter"].keys() == b["adapter"].keys()
    for k in a["adapter"]:
        assert torch.equal(a["adapter"][k], b["adapter"][k]), k
    # and training moved them: lora_B starts at zero
    assert any(k.endswith("lora_B.default.weight") and a["adapter"][k].abs().sum() > 0
               for k in a["adapter"])


def test_adapter_loads_in_peft(finished_run):
    from peft import PeftModel

    from lorasync.train.model import ModelSource, load_base

    run, _ = finished_run
    saved = torch.load(os.path.join(run, "checkpoint-6/lorasync/rank0.pt"),
                       weights_only=False)["adapter"]
    for folder in ("adapter", "checkpoint-6"):   # the final adapter, and the last checkpoint's
        base, _ = load_base(ModelSource.resolve("tiny"))
        model = PeftModel.from_pretrained(base, os.path.join(run, folder))
        params = dict(model.named_parameters())
        for k, v in saved.items():
            assert torch.equal(params[k].detach(), v), (folder, k)


def _flip(path):
    with open(path, "r+b") as fh:
        fh.seek(os.path.getsize(path) // 2)
        fh.write(b"\0\0\0\0\0\0\0\0")


def test_resume_equals_uninterrupted_and_skips_a_damaged_checkpoint(finished_run, tmp_path):
    """The same run stopped after step 5 (checkpoints at 3 and 5), then resumed
    twice from copies.  Both state files of step 5 damaged (same size, bytes
    flipped): no file of 5 is ever loaded, the run goes on from step 3, and every
    step's loss equals the uninterrupted run's (data order, adapter, optimizer,
    RNG).  Only rank 1's damaged: the group resumes from 5, rank 1 taking rank
    0's replicated state (its RNG reseeded), rank 0 exactly as uninterrupted."""
    import shutil

    full, _ = finished_run
    part = str(tmp_path / "part")
    p = run_cli("train", *FINISHED, "--stop-after", "5", "--output-dir", part)
    assert p.returncode == 0, p.stderr[-3000:]
    assert not os.path.exists(os.path.join(part, "metrics.jsonl"))
    one = str(tmp_path / "one")
    shutil.copytree(part, one)
    for r in (0, 1):
        _flip(os.path.join(part, "checkpoint-5", "lorasync", f"rank{r}.pt"))
    p = run_cli("train", "--resume", "--output-dir", part, "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resumed from" in p.stderr and "checkpoint-3 at step 3" in p.stderr
    a, b = read_metrics(full), read_metrics(part)
    assert [(r["step"], r["rank"]) for r in a] == [(r["step"], r["rank"]) for r in b]
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-6), (x["step"], x["rank"])

    _flip(os.path.join(one, "checkpoint-5", "lorasync", "rank1.pt"))
    p = run_cli("train", "--resume", "--output-dir", one, "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "checkpoint-5 at step 5" in p.stderr and "rank 1: own file damaged" in p.stderr
    b = read_metrics(one)
    assert [(r["step"], r["rank"]) for r in a] == [(r["step"], r["rank"]) for r in b]
    for x, y in zip(a, b):
        if x["rank"] == 0:
            assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-6), x["step"]
    from lorasync.monitor.metrics import read_jsonl_records
    start = [r for r in read_jsonl_records(os.path.join(one, "ranks", "rank1.jsonl"))
             if r.get("event") == "start"][-1]
    assert start["state"] == "peer" and start["resumed_from"] == 5
    assert start["reset"] == ["RNG reseeded"]


def test_jsonl_data_and_epochs(tmp_path):
    data = tmp_path / "d.jsonl"
    rows = [{"prompt": f"say {i}", "completion": str(i)} for i in range(20)]
    rows += [{"text": "plain text row"}, {"messages": [{"role": "user", "content": "hi"},
                                                       {"role": "assistant", "content": "yo"}]}]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    run = str(tmp_path / "r")
    p = run_cli("train", *TINY, "--data", data, "--max-steps", "0", "--epochs", "1",
                "--eval-size", "4", "--output-dir", run)
    assert p.returncode == 0, p.stderr[-3000:]
    # 22 rows, 4 held out for eval, global batch 4 -> 4 steps in one epoch
    assert max(r["step"] for r in read_metrics(run)) == 4


def test_adaptive_accumulation_stays_in_bounds(tmp_path):
    run = str(tmp_path / "r")
    p = run_cli("train", *TINY, "--comm", "auto", "--comm-opt", "interval=3", "--grad-accum", "1",
                "--max-grad-accum", "3", "--max-steps", "12", "--eval-size", "0",
                "--output-dir", run)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = read_metrics(run)
    for r in recs:
        assert 1 <= r["grad_accum"] <= 3
        assert r["samples"] == 2 * r["grad_accum"]  # batch 2 per micro-batch
    # ranks always agree on the number of micro-batches of a step
    by_step = {}
    for r in recs:
        by_step.setdefault(r["step"], set()).add(r["grad_accum"])
    assert all(len(v) == 1 for v in by_step.values())


def test_max_grad_accum_below_grad_accum_is_refused(tmp_path):
    p = run_cli("train", *TINY, "--grad-accum", "4", "--max-grad-accum", "2",
                "--output-dir", tmp_path / "r")
    assert p.returncode == 2 and "train.max_grad_accum" in p.stderr


def test_evaluations_mid_run_settle_a_streamed_outer_sync(tmp_path):
    """--eval-interval with DiLoCo's outer sync always in flight (4 fragments,
    one launched every step, each 2 steps late): waiting a step would not
    help, so each evaluation settles what is in flight on time; training and
    the evaluations go on, and the replicas end identical."""
    run = str(tmp_path / "r")
    p = run_cli("train", *TINY, "--max-steps", "8", "--eval-interval", "2", "--comm", "diloco",
                "--comm-opt", "period=4", "--comm-opt", "streaming=true", "--comm-opt", "delay=2",
                "--comm-opt", "fragments=4", "--comm-opt", "delta_dtype=int8",
                "--ckpt-interval", "0", "--output-dir", run)
    assert p.returncode == 0, p.stderr[-3000:]
    with open(os.path.join(run, "evals.jsonl")) as fh:
        evals = [json.loads(line) for line in fh]
    assert [e["step"] for e in evals] == [0, 2, 4, 6, 8]
    recs = read_metrics(run)
    assert all(r["strategy"] == "diloco" for r in recs)
    assert sum(r["wire_bytes"] for r in recs) > 0


def test_an_evaluation_due_at_an_outer_sync_launch_waits_one_step(tmp_path):
    """DiLoCo every 4 steps, streamed 1 step late, evaluated every 2 steps:
    the evaluation due at step 4, where the outer sync leaves, runs after
    step 5, where it landed (settling it at step 4 would expose all of it);
    the others run on time.  A run stopped at step 4 (--stop-after) does
    not defer past its end."""
    common = [*TINY, "--max-steps", "8", "--eval-interval", "2", "--comm", "diloco",
              "--comm-opt", "period=4", "--comm-opt", "streaming=true",
              "--comm-opt", "delay=1", "--ckpt-interval", "0"]
    for extra, want in (([], [0, 2, 5, 6, 8]), (["--stop-after", "4"], [0, 2, 4])):
        run = str(tmp_path / f"r{len(extra)}")
        p = run_cli("train", *common, *extra, "--output-dir", run)
        assert p.returncode == 0, p.stderr[-3000:]
        with open(os.path.join(run, "evals.jsonl")) as fh:
            assert [json.loads(line)["step"] for line in fh] == want, extra


def test_eval_mean_evaluates_the_replicas_mean_and_leaves_training_alone(tmp_path):
    """--eval-mean under DiLoCo (period 4, not streamed): the evaluations
    between outer syncs (steps 2, 6) are of the ranks' mean adapter, the ones
    where the replicas agree (0, 4 after the sync, 8 after finish) are not
    averaged and equal the plain run's; training is the same step for step,
    to the bit, and so is the saved adapter."""
    runs = {}
    for mean in (False, True):
        run = str(tmp_path / f"r{int(mean)}")
        p = run_cli("train", *TINY, "--max-steps", "8", "--eval-interval", "2", "--comm",
                    "diloco", "--comm-opt", "period=4", "--ckpt-interval", "0",
                    *(["--eval-mean"] if mean else []), "--output-dir", run)
        assert p.returncode == 0, p.stderr[-3000:]
        with open(os.path.join(run, "evals.jsonl")) as fh:
            evals = {e["step"]: e for e in map(json.loads, fh)}
        runs[mean] = (run, evals)
    (plain, ev0), (meaned, ev1) = runs[False], runs[True]
    assert sorted(ev1) == [0, 2, 4, 6, 8]
    assert [s for s, e in sorted(ev1.items()) if e.get("replicas") == "mean"] == [2, 6]
    assert not any("replicas" in e for e in ev0.values())
    for s in (0, 4, 8):
        assert ev1[s]["eval_loss"] == ev0[s]["eval_loss"], s
    for s in (2, 6):  # another model: each rank's own replica on half the examples before
        assert ev1[s]["eval_loss"] != ev0[s]["eval_loss"], s
    losses = [[(r["step"], r["rank"], r["loss"]) for r in read_metrics(x)] for x in (plain, meaned)]
    assert losses[0] == losses[1]
    from safetensors.torch import load_file
    a, b = (load_file(os.path.join(x, "adapter", "adapter_model.safetensors"))
            for x in (plain, meaned))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_eval_mean_under_hierarchical_diloco(tmp_path):
    """2 nodes x 2 ranks, DiLoCo across the node leaders every 4 steps, with
    --eval-mean: the evaluations between outer syncs (steps 2, 6) are of the
    mean of the ranks' adapters, the one after the outer sync (4) and the
    final one (8, after finish) are not; the run went hierarchical."""
    run = str(tmp_path / "r")
    p = run_cli("train", *TINY, "--nproc", "4",  # the later --nproc wins
                "--max-steps", "8", "--eval-interval", "2", "--comm", "diloco",
                "--comm-opt", "period=4", "--hierarchy", "node", "--ranks-per-node", "2",
                "--ckpt-interval", "0", "--eval-mean", "--output-dir", run)
    assert p.returncode == 0, p.stderr[-3000:]
    with open(os.path.join(run, "evals.jsonl")) as fh:
        evals = [json.loads(line) for line in fh]
    assert [e["step"] for e in evals] == [0, 2, 4, 6, 8]
    assert [e["step"] for e in evals if e.get("replicas") == "mean"] == [2, 6]
    recs = read_metrics(run)
    assert {r["rank"] for r in recs} == {0, 1, 2, 3}
    assert sum(r["intra_bytes"] for r in recs) > 0
