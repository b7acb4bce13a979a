"""`lorasync report`: reading run directories, the numbers, the HTML, the errors."""

import base64
import io
import json
import math
import os
import random
import re
import sys
import types

import pytest

from conftest import run_cli
from lorasync.errors import LorasyncError
from lorasync.monitor import report

ADAPTER_BYTES = 921_600 * 4  # SmolLM2-135M + LoRA r=8 on q/k/v/o, fp32


def make_records(steps=30, world=2, switch_at=15, first="allreduce", second="fp16",
                 comm=(0.35, 0.15), seed=0, t0=1_700_000_000.0):
    """Records as the trainer writes them: 2 ranks, a slow first step, a switch."""
    rnd = random.Random(seed)
    out, t = [], t0
    for step in range(1, steps + 1):
        strategy = first if switch_at is None or step < switch_at else second
        wire = ADAPTER_BYTES if strategy == "allreduce" else ADAPTER_BYTES // 2
        comm_s = comm[0] if strategy == first else comm[1]
        step_recs = []
        for rank in range(world):
            compute = 0.62 + rnd.uniform(-0.03, 0.03) + (1.5 if step == 1 else 0.0)
            c = comm_s * rnd.uniform(0.9, 1.1)
            data = 0.02
            rec = {"step": step, "rank": rank, "world_size": world, "strategy": strategy,
                   "loss": 3.0 * math.exp(-step / 12) + 0.4 + rnd.uniform(-0.05, 0.05),
                   "lr": 2e-3, "samples": 8, "tokens": 8 * 60, "grad_accum": 2,
                   "compute_s": compute, "comm_s": c, "step_s": compute + c + data,
                   "wire_bytes": wire, "fp32_bytes": ADAPTER_BYTES, "encode_s": 0.001,
                   "time": 0.0}
            if switch_at is not None and step == switch_at:
                rec["switch"] = {"from": first, "to": second,
                                 "reason": "sync share 36% > 25% on a 10 Mbit/s link"}
            step_recs.append(rec)
        t += max(r["step_s"] for r in step_recs)
        for r in step_recs:
            r["time"] = t
        out += step_recs
    return out


def make_evals(steps=30, loss0=3.2, correct=(0, 22, 37), n=60, t0=1_700_000_000.0):
    pts = [0, steps // 2, steps]
    return [{"step": s, "eval_loss": loss0 * math.exp(-s / 15) + 0.3, "exact_match": c / n,
             "correct": c, "n": n, "time": t0 + 10 * s} for s, c in zip(pts, correct)]


def trainer_summary(records, evals, strategy="auto"):
    """summary.json exactly as the trainer computes it (the reference path)."""
    from lorasync.train.summary import summarize as _summarize

    world = max(r["world_size"] for r in records)
    per_rank = [[r for r in records if r["rank"] == k] for k in range(world)]
    cfg = types.SimpleNamespace(comm=types.SimpleNamespace(strategy=strategy),
                                model=types.SimpleNamespace(name="smollm2-135m"))
    before = next(e for e in evals if e["step"] == 0) if evals else None
    return _summarize(per_rank, cfg, world, 921_600, ADAPTER_BYTES, before,
                      evals[-1] if evals else None)


def make_run(path, records=None, evals=None, summary=True, strategy="auto"):
    os.makedirs(path, exist_ok=True)
    records = make_records() if records is None else records
    evals = make_evals() if evals is None else evals
    with open(os.path.join(path, "metrics.jsonl"), "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    if evals:
        with open(os.path.join(path, "evals.jsonl"), "w") as fh:
            fh.writelines(json.dumps(e) + "\n" for e in evals)
    if summary:
        with open(os.path.join(path, "summary.json"), "w") as fh:
            json.dump(trainer_summary(records, evals, strategy), fh, indent=1)
    return str(path)


def png_images(html_text):
    """Decoded PNG bytes of every <img> (all must be data URIs)."""
    srcs = re.findall(r'<img [^>]*src="([^"]+)"', html_text)
    out = []
    for src in srcs:
        assert src.startswith("data:image/png;base64,"), src[:60]
        data = base64.b64decode(src.split(",", 1)[1], validate=True)
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        out.append(data)
    return out


# ---------------------------------------------------------------- numbers


def test_step_series_global_throughput_and_means():
    recs = make_records()
    rows = report.step_series(recs)
    assert [r["step"] for r in rows] == list(range(1, 31))
    s5 = [r for r in recs if r["step"] == 5]
    row = rows[4]
    assert row["samples_per_s"] == pytest.approx(16 / max(r["step_s"] for r in s5))
    assert row["comm_s"] == pytest.approx(sum(r["comm_s"] for r in s5) / 2)
    assert row["other_s"] == pytest.approx(0.02)
    assert rows[0]["strategy"] == "allreduce" and rows[-1]["strategy"] == "fp16"
    assert rows[-1]["wire_bytes"] == ADAPTER_BYTES // 2


def test_switches_from_record_field_and_from_strategy_change():
    recs = make_records()
    assert report.find_switches(recs) == [
        {"step": 15, "from": "allreduce", "to": "fp16",
         "reason": "sync share 36% > 25% on a 10 Mbit/s link"}]
    for r in recs:  # an unannounced change still shows
        r.pop("switch", None)
    assert report.find_switches(recs) == [{"step": 15, "from": "allreduce", "to": "fp16",
                                           "reason": ""}]
    assert report.find_switches(make_records(switch_at=None)) == []


def test_computed_summary_matches_the_trainers(tmp_path):
    """Without summary.json the report computes the same numbers the trainer writes."""
    recs, evals = make_records(), make_evals()
    ref = trainer_summary(recs, evals)
    run = report.load_run(make_run(tmp_path / "r", recs, evals, summary=False))
    assert run.summary is None
    got = report.summarize_run(run)
    for key in ("samples_per_s", "step_s_median", "compute_s_mean", "comm_s_mean", "sync_share",
                "wire_bytes_per_step", "fp32_bytes_per_step", "final_loss", "steps"):
        assert got[key] == pytest.approx(ref[key]), key
    assert got["eval_before"] == evals[0] and got["eval_after"] == evals[-1]
    assert got["strategies_used"] == ["allreduce", "fp16"]
    assert got["source"] == "computed from metrics.jsonl"


def test_summary_json_wins_when_present(tmp_path):
    run = report.load_run(make_run(tmp_path / "r"))
    s = report.summarize_run(run)
    assert s["source"] == "summary.json" and s["strategy"] == "auto"
    assert s["adapter_params"] == 921_600


# ---------------------------------------------------------------- HTML


def test_single_run_report(tmp_path):
    path = make_run(tmp_path / "run1")
    out = report.write_report([path])
    assert out == os.path.join(path, "report.html")
    text = open(out, encoding="utf-8").read()
    imgs = png_images(text)
    assert len(imgs) == 4
    assert "http://" not in text and "https://" not in text  # self-contained
    for needle in ("Summary", "samples/s (all ranks)", "allreduce → fp16",
                   "sync share 36% &gt; 25%", "0.0% ± 0.0 (0/60)", "61.7% ± 6.3 (37/60)"):
        assert needle in text, needle
    from matplotlib.image import imread
    for data in imgs:
        img = imread(io.BytesIO(data), format="png")
        assert img.shape[1] == 1000 and img.shape[0] >= 300
        assert img.std() > 0.05  # not a blank canvas


def test_comparison_report_overlays_runs(tmp_path, monkeypatch):
    a = make_run(tmp_path / "base", make_records(switch_at=None, first="allreduce",
                                                 comm=(0.6, 0.6), seed=1),
                 make_evals(loss0=3.4, correct=(0, 20, 35)), strategy="allreduce")
    b = make_run(tmp_path / "auto", make_records(seed=2), make_evals(correct=(0, 21, 38)))
    monkeypatch.chdir(tmp_path)
    out = report.write_report([a, b])
    assert out == "lorasync-report.html"
    text = (tmp_path / out).read_text(encoding="utf-8")
    assert "Comparison" in text and "speedup vs base" in text
    sa = json.load(open(os.path.join(a, "summary.json")))
    sb = json.load(open(os.path.join(b, "summary.json")))
    assert f"{sb['samples_per_s'] / sa['samples_per_s']:.2f}x" in text
    assert "1.00x" in text
    assert "58.3% ± 6.4 (35/60)" in text and "63.3% ± 6.2 (38/60)" in text
    assert len(png_images(text)) == 4
    assert "Run base" in text and "Run auto" in text


def test_same_named_runs_get_distinct_names(tmp_path):
    a = make_run(tmp_path / "x" / "run")
    b = make_run(tmp_path / "y" / "run")
    text = report.build_report([report.load_run(a), report.load_run(b)])
    assert "x/run" in text and "y/run" in text


def test_unfinished_run_uses_rank_streams(tmp_path):
    run = tmp_path / "live"
    (run / "ranks").mkdir(parents=True)
    recs = make_records(steps=12)
    for k in (0, 1):
        with open(run / "ranks" / f"rank{k}.jsonl", "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in recs if r["rank"] == k)
            if k == 1:
                fh.write('{"step": 13, "rank": 1, "lo')  # killed mid-write
    text = open(report.write_report([str(run)]), encoding="utf-8").read()
    assert "run not finished" in text and "torn last line" in text
    assert len(png_images(text)) == 4


# ---------------------------------------------------------------- errors


def test_torn_last_line_is_tolerated(tmp_path):
    path = make_run(tmp_path / "r", summary=False)
    with open(os.path.join(path, "metrics.jsonl"), "a") as fh:
        fh.write('{"step": 31, "rank": 0, "strat')
    run = report.load_run(path)
    assert len(run.records) == 60
    assert any("torn last line (line 61" in n for n in run.notes)


@pytest.mark.parametrize("case, expect", [
    ("missing", "no such run directory"),
    ("file", "not a directory"),
    ("no_metrics", "metrics.jsonl: not found"),
    ("empty", "no step records (empty file)"),
    ("torn_middle", "metrics.jsonl:2: not valid JSON"),
    ("not_metrics", "metrics.jsonl:1: record lacks"),
])
def test_errors_name_the_path_and_fix(tmp_path, case, expect):
    path = tmp_path / "r"
    if case == "file":
        path.write_text("x")
    elif case != "missing":
        path.mkdir()
    metrics = path / "metrics.jsonl"
    if case == "empty":
        metrics.write_text("\n")
    elif case == "torn_middle":
        lines = [json.dumps(r) for r in make_records(steps=2)]
        lines[1] = lines[1][:20]
        metrics.write_text("\n".join(lines) + "\n")
    elif case == "not_metrics":
        metrics.write_text('{"hello": 1}\n')
    with pytest.raises(LorasyncError) as ei:
        report.write_report([str(path)])
    msg = str(ei.value)
    assert expect in msg and str(path) in msg and "\n" not in msg


def test_cli_exit_codes(tmp_path):
    path = make_run(tmp_path / "r")
    out = tmp_path / "sub" / "rep.html"
    p = run_cli("report", path, "-o", out, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"report: {out}" and out.is_file()
    p = run_cli("report", tmp_path / "nope", timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0
    assert "lorasync report: error:" in p.stderr and "no such run directory" in p.stderr


def test_report_code_does_not_import_torch(tmp_path):
    path = make_run(tmp_path / "r", summary=False)
    code = ("import sys; from lorasync.monitor import report_cli, report; "
            f"report.write_report([{path!r}]); "
            "assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    import subprocess
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr
