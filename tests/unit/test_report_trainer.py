"""`lorasync report` on a transformers Trainer's output directory, alone and
compared with a `lorasync train` run.

The fixtures in tests/fixtures/trainer_runs/ are real runs on an emulated 2-node
10 Mbit/s link (their README.md has the commands): a Trainer script with
lorasync.hf.attach(trainer, "fp16"), the same script without lorasync, and
`lorasync train --comm fp16` on the same tiny model and batch.
"""

import json
import os
import re
import shutil

import pytest

from lorasync.errors import LorasyncError
from lorasync.monitor import report

FIX = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures",
                   "trainer_runs")


def fixture(name):
    return os.path.join(FIX, name)


def history(name):
    with open(os.path.join(fixture(name), "trainer_state.json")) as fh:
        return json.load(fh)["log_history"]


def train_logs(hist):
    return [e for e in hist if "loss" in e and not any(k.startswith("eval_") for k in e)]


def table_rows(html_text, heading):
    """The cells of the table after <h2>heading</h2>, as lists of text."""
    part = html_text.split(f"<h2>{heading}</h2>", 1)[1].split("</table>", 1)[0]
    return [[re.sub(r"<[^>]+>", "", c).replace("&#x27;", "'") for c in
             re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row)]
            for row in re.findall(r"<tr>(.*?)</tr>", part, re.S)]


# ---------------------------------------------------------------- numbers


def test_trainer_with_lorasync_numbers_come_from_its_logs():
    run = report.load_run(fixture("trainer-fp16"))
    assert run.kind == "trainer" and run.records == []
    logs = train_logs(history("trainer-fp16"))
    assert [e["step"] for e in logs] == [2, 4, 6, 8]
    s = report.summarize_run(run)
    # steady state: the windows after the first one (it holds step 1), 2 steps each
    steady = logs[1:]
    time = sum(e["lorasync/step_s"] for e in steady)
    assert s["samples_per_s"] == pytest.approx(
        sum(e["lorasync/samples_per_s"] * e["lorasync/step_s"] for e in steady) / time)
    assert s["sync_share"] == pytest.approx(sum(e["lorasync/comm_s"] for e in steady) / time)
    assert s["comm_s_mean"] == pytest.approx(sum(e["lorasync/comm_s"] for e in steady) / 3)
    assert s["wire_bytes_per_step"] == 14336 and s["fp32_bytes_per_step"] == 2 * 14336
    assert s["world_size"] == 2 and s["strategies_used"] == ["fp16"]
    assert s["trainer_samples_per_s"] == history("trainer-fp16")[-2]["train_samples_per_second"]
    assert s["final_loss"] == logs[-1]["loss"]
    assert s["eval_after"]["eval_loss"] == history("trainer-fp16")[-1]["eval_loss"]
    assert s["eval_before"] is None and s["switches"] == []
    rows = report.trainer_series(run)
    assert [r["step"] for r in rows] == [2, 4, 6, 8]
    assert rows[1]["comm_s"] == logs[1]["lorasync/comm_s"]
    assert rows[1]["compute_s"] == pytest.approx(logs[1]["lorasync/step_s"]
                                                 - logs[1]["lorasync/comm_s"])


def test_plain_trainer_has_only_the_trainers_own_figures():
    run = report.load_run(fixture("trainer-plain"))
    s = report.summarize_run(run)
    for key in ("samples_per_s", "sync_share", "comm_s_mean", "wire_bytes_per_step",
                "world_size", "fp32_bytes_per_step"):
        assert s[key] is None, key
    assert s["trainer_samples_per_s"] == 124.674
    assert s["strategies_used"] == [] and report._strategy_label(s) == "Trainer, no lorasync"
    assert any("no lorasync/* timings" in n for n in run.notes)
    rows = dict(report._summary_rows(s))
    assert rows["Trainer's samples/s (whole run)"] == "124.67"
    assert rows["samples/s (all ranks)"] == rows["sent per step per rank"] == "-"
    assert rows["eval loss before → after"] == f"- → {history('trainer-plain')[-1]['eval_loss']:.4f}"


def test_trainer_and_train_runs_in_one_comparison(tmp_path):
    runs = [fixture("train-fp16"), fixture("trainer-plain"), fixture("trainer-fp16")]
    out = report.write_report(runs, str(tmp_path / "cmp.html"))
    text = open(out, encoding="utf-8").read()
    head, train, plain, hf = table_rows(text, "Comparison")
    assert head[3:5] == ["speedup vs train-fp16", "Trainer's samples/s, whole run"]
    assert train[:2] == ["train-fp16", "2 × fp16"] and train[4] == "-"
    with open(os.path.join(fixture("train-fp16"), "summary.json")) as fh:
        base = json.load(fh)["samples_per_s"]
    hf_s = report.summarize_run(report.load_run(fixture("trainer-fp16")))
    assert hf[:4] == ["trainer-fp16", "2 × fp16 (Trainer)", f"{hf_s['samples_per_s']:.2f}",
                      f"{hf_s['samples_per_s'] / base:.2f}x"]
    assert hf[5:7] == [f"{100 * hf_s['sync_share']:.1f}%", "0.014"]
    # the Trainer's own figure, relative to the first run that has one (the plain Trainer)
    assert plain[4] == "124.67 (1.00x)" and hf[4] == f"178.12 ({178.123 / 124.674:.2f}x)"
    # what the plain Trainer's logs lack is '-'
    assert plain[1:4] == ["- × Trainer, no lorasync", "-", "-"] and plain[5:7] == ["-", "-"]
    assert plain[7] == f"{history('trainer-plain')[-1]['eval_loss']:.4f}"
    assert len(re.findall(r'<img [^>]*src="data:image/png;base64,', text)) == 4
    assert "Run trainer-plain" in text and "Trainer&#x27;s samples/s (whole run)" in text
    # a plain Trainer first: the speedups are relative to the first run that has samples/s
    text = report.build_report([report.load_run(r) for r in runs[1:]])
    head, plain, hf = table_rows(text, "Comparison")
    assert head[3] == "speedup vs trainer-fp16" and (plain[3], hf[3]) == ("-", "1.00x")


def test_newest_checkpoint_when_save_state_was_not_called(tmp_path):
    """A Trainer that saved checkpoints only: checkpoint-N/trainer_state.json, written
    before the final log (so no train_samples_per_second in it)."""
    hist = history("trainer-fp16")
    with open(os.path.join(fixture("trainer-fp16"), "trainer_state.json")) as fh:
        state = json.load(fh)
    out = tmp_path / "out"
    for step in (4, 8):
        (out / f"checkpoint-{step}").mkdir(parents=True)
        st = dict(state, global_step=step,
                  log_history=[e for e in train_logs(hist) if e["step"] <= step])
        (out / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps(st))
    run = report.load_run(str(out))
    s = report.summarize_run(run)
    assert s["last_step"] == 8 and s["samples_per_s"] is not None
    assert s["trainer_samples_per_s"] is None and s["elapsed_s"] is None
    assert any("checkpoint-8/trainer_state.json" in n for n in run.notes)
    assert any("save_state()" in n and "ends at step 8" in n for n in run.notes)
    # transformers' example scripts also write the final metrics with save_metrics()
    shutil.copy(os.path.join(fixture("trainer-fp16"), "train_results.json"), out)
    s = report.summarize_run(report.load_run(str(out)))
    assert s["trainer_samples_per_s"] == 178.123 and s["elapsed_s"] == 0.3593


def test_auto_switches_in_the_logs_become_switches(tmp_path):
    with open(os.path.join(fixture("trainer-fp16"), "trainer_state.json")) as fh:
        state = json.load(fh)
    # the format lorasync.hf writes: "step N: FROM -> TO: reason", joined with "; "
    state["log_history"][1]["lorasync/switch"] = (
        "step 3: allreduce -> fp16: sync share 31% > 25%; step 4: fp16 -> int8: still slow")
    (tmp_path / "trainer_state.json").write_text(json.dumps(state))
    s = report.summarize_run(report.load_run(str(tmp_path)))
    assert s["switches"] == [
        {"step": 3, "from": "allreduce", "to": "fp16", "reason": "sync share 31% > 25%"},
        {"step": 4, "from": "fp16", "to": "int8", "reason": "still slow"}]


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("case, expect", [
    ("nothing", "not a lorasync run directory"),
    ("bad_json", "trainer_state.json: not valid JSON"),
    ("no_history", "no log_history list"),
    ("no_train_logs", "no training logs in log_history"),
])
def test_errors_name_the_path_and_fix(tmp_path, case, expect):
    from lorasync.cli import main

    path = tmp_path / "out"
    path.mkdir()
    state = path / "trainer_state.json"
    if case == "bad_json":
        state.write_text('{"log_history": [')
    elif case == "no_history":
        state.write_text('{"global_step": 3}')
    elif case == "no_train_logs":
        state.write_text(json.dumps({"log_history": [{"eval_loss": 1.0, "step": 0}]}))
    with pytest.raises(LorasyncError) as ei:
        report.load_run(str(path))
    msg = str(ei.value)
    assert expect in msg and str(path) in msg and "\n" not in msg
    if case == "nothing":
        assert "output_dir of a transformers Trainer" in msg
        assert main(["report", str(path)]) == 2
