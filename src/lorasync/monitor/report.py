"""Self-contained HTML report of one or more run directories.

Reads what a run leaves behind (``metrics.jsonl``, ``evals.jsonl``,
``summary.json``; see docs/contracts.md) and writes one HTML file whose plots
are PNGs embedded as base64 data URIs, so the report can be mailed or
attached to an issue and opens offline.

A transformers Trainer's output directory is one more kind of input: its
``trainer_state.json`` (or the newest ``checkpoint-N/trainer_state.json``)
holds the log history, with the ``lorasync/*`` entries ``lorasync.hf.attach``
adds (docs/huggingface.md).  Those are means per logging window, so a Trainer
run's numbers are per window, not per step; what a Trainer run does not log
(a plain Trainer has no sync timings or bytes) shows as '-'.

The numbers are :mod:`lorasync.monitor.runstats`' (its definitions are the
trainer's ``summary.json``'s), the runs are read by
:mod:`lorasync.monitor.readers`, the plots drawn by
:mod:`lorasync.monitor.plots`; this module formats them and writes the HTML.
"""

from __future__ import annotations

import datetime as _dt
import html
import math
import os
import re

from lorasync.errors import LorasyncError
from lorasync.monitor.plots import (
    plot_loss, plot_throughput, plot_time_split, plot_wire, run_colors,
)
from lorasync.monitor.readers import Run, load_run
from lorasync.monitor.runstats import (
    find_switches, step_series, summarize_run, summarize_trainer, trainer_series,
)

__all__ = ["Run", "load_run", "step_series", "trainer_series", "find_switches", "summarize_run",
           "summarize_trainer", "build_report", "write_report", "default_output"]


# ---------------------------------------------------------------- formatting


def _em_parts(e: dict | None) -> tuple[float, float, int, int] | None:
    """(p, standard error, correct, n) of an eval record's exact-match."""
    if not e or not e.get("n"):
        return None
    n = int(e["n"])
    if e.get("correct") is not None:
        correct = int(e["correct"])
    elif e.get("exact_match") is not None:
        correct = round(e["exact_match"] * n)
    else:
        return None
    p = correct / n
    return p, math.sqrt(p * (1 - p) / n), correct, n


def _fmt(v, spec: str = ".3f", unit: str = "") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    return f"{v:{spec}}{unit}"


def _fmt_em(e: dict | None) -> str:
    parts = _em_parts(e)
    if parts is None:
        return "n/a"
    p, se, c, n = parts
    return f"{100 * p:.1f}% ± {100 * se:.1f} ({c}/{n})"


def _fmt_duration(s: float | None) -> str:
    if s is None:
        return "n/a"
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else \
        f"{s // 60}m{s % 60:02d}s"


def _eval_loss(e: dict | None) -> float | None:
    return e.get("eval_loss") if e else None


def _strategy_label(s: dict) -> str:
    """"fp16", "allreduce → fp16", or "auto (allreduce → fp16)" when the
    configured strategy (summary.json) is not one that ran."""
    if s.get("trainer"):
        used = s.get("strategies_used") or []
        return (" → ".join(str(x) for x in used) + " (Trainer)" if used
                else "Trainer, no lorasync")
    strategies = s.get("strategies_used") or [s.get("strategy")]
    strat = " → ".join(str(x) for x in strategies)
    if s.get("strategy") and s["strategy"] not in strategies:
        strat = f"{s['strategy']} ({strat})"
    return strat


def _ranks(s: dict) -> str:
    """The rank count, '?' for a lorasync run that does not say, '-' for a
    Trainer run whose logs do not (a Trainer without lorasync)."""
    return str(s.get("world_size") or ("-" if s.get("trainer") else "?"))


def _summary_rows(s: dict) -> list[tuple[str, str]]:
    eb, ea = s.get("eval_before"), s.get("eval_after")
    strat = _strategy_label(s)
    wire, fp32 = s.get("wire_bytes_per_step"), s.get("fp32_bytes_per_step")
    ratio = f", {fp32 / wire:.1f}x less" if wire and fp32 and wire < fp32 else ""
    rows = [
        ("ranks × strategy", f"{_ranks(s)} × {strat}"),
        ("steps", f"{s.get('steps')} (last step {s.get('last_step')}, "
                  f"{_fmt_duration(s.get('elapsed_s'))})"),
        ("samples/s (all ranks)", _fmt(s.get("samples_per_s"), ".2f")),
        ("step time median", _fmt(s.get("step_s_median"), ".3f", " s")),
        ("compute vs exposed sync per step",
         f"{_fmt(s.get('compute_s_mean'), '.3f', ' s')} vs "
         f"{_fmt(s.get('comm_s_mean'), '.3f', ' s')}"
         f" ({_fmt(100 * s['sync_share'] if s.get('sync_share') is not None else None, '.1f', '%')}"
         " waiting on sync)"),
        ("sent per step per rank",
         f"{_fmt(wire / 1e6 if wire is not None else None, '.3f', ' MB')} (fp32 all-reduce: "
         f"{_fmt(fp32 / 1e6 if fp32 is not None else None, '.3f', ' MB')}{ratio})"),
        ("train loss (last step)", _fmt(s.get("final_loss"), ".4f")),
        ("eval loss before → after", f"{_fmt(_eval_loss(eb), '.4f')} → "
                                     f"{_fmt(_eval_loss(ea), '.4f')}"),
        ("eval exact-match before", _fmt_em(eb)),
        ("eval exact-match after", _fmt_em(ea)),
    ]
    if s.get("adapter_params"):
        rows.insert(1, ("adapter parameters", f"{s['adapter_params']:,}"))
    if s.get("model"):
        rows.insert(1, ("model", str(s["model"])))
    if s.get("trainer"):
        # per-window means: a median of steps cannot be had from them
        rows[3] = ("step time mean", _fmt(s.get("step_s_mean"), ".3f", " s"))
        rows.insert(3, ("Trainer's samples/s (whole run)",
                        _fmt(s.get("trainer_samples_per_s"), ".2f")))
        rows.append(("numbers from", str(s.get("source"))))
        # what the Trainer's logs do not have is '-', a row with nothing at all one '-'
        return [(k, v.replace("n/a", "-") if re.search(r"\d", re.sub(r"n/a|fp32", "", v))
                 else "-") if "n/a" in v else (k, v) for k, v in rows]
    rows.append(("numbers from", f"{s.get('source')}; steady state (first step left out), "
                                 "compute/sync/bytes are rank 0's"))
    return rows


# ---------------------------------------------------------------- HTML

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px auto;
       max-width: 1060px; color: #222; padding: 0 16px; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; }
h2 { font-size: 1.25em; margin-top: 1.6em; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
.meta { color: #666; font-size: 0.9em; }
table { border-collapse: collapse; margin: 8px 0 16px; font-size: 0.92em; }
th, td { border: 1px solid #ddd; padding: 5px 10px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.note { background: #fff8dc; border: 1px solid #e6d58a; padding: 6px 10px; margin: 8px 0; }
figure { margin: 12px 0 20px; }
figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.88em; }
code { background: #f4f4f4; padding: 1px 4px; }
"""


def _e(x) -> str:
    return html.escape(str(x))


def _table(header: list[str] | None, rows: list[list[str]], num_cols: set[int] = frozenset(),
           cls: str = "") -> str:
    out = [f'<table class="{cls}">' if cls else "<table>"]
    if header:
        out.append("<tr>" + "".join(f"<th>{_e(h)}</th>" for h in header) + "</tr>")
    for row in rows:
        cells = []
        for i, v in enumerate(row):
            tag = "th" if header is None and i == 0 else "td"
            attr = ' class="num"' if i in num_cols else ""
            cells.append(f"<{tag}{attr}>{_e(v)}</{tag}>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def _figure(b64: str, alt: str, caption: str) -> str:
    return (f'<figure><img alt="{_e(alt)}" src="data:image/png;base64,{b64}">'
            f"<figcaption>{_e(caption)}</figcaption></figure>")


def _comparison(runs: list[Run], sums: list[dict]) -> str:
    # the baseline is the first run; a Trainer without lorasync timings cannot be one
    ref = next((i for i, s in enumerate(sums) if s.get("samples_per_s")), 0)
    base = sums[ref].get("samples_per_s")
    trainers = any(s.get("trainer") for s in sums)
    # the Trainer's own figure compares Trainer runs with each other (plain or not)
    tbase = next((s["trainer_samples_per_s"] for s in sums if s.get("trainer_samples_per_s")),
                 None)
    rows = []
    for run, s in zip(runs, sums):
        sps = s.get("samples_per_s")
        speed = f"{sps / base:.2f}x" if sps and base else "-"
        strat = _strategy_label(s)
        wire = s.get("wire_bytes_per_step")
        share = s.get("sync_share")
        ea = s.get("eval_after")
        row = [run.name, f"{_ranks(s)} × {strat}", _fmt(sps, ".2f"), speed,
               _fmt(100 * share if share is not None else None, ".1f", "%"),
               _fmt(wire / 1e6 if wire is not None else None, ".3f"),
               _fmt(_eval_loss(ea), ".4f"), _fmt_em(ea)]
        if trainers:
            whole = s.get("trainer_samples_per_s")
            row.insert(4, f"{whole:.2f} ({whole / tbase:.2f}x)" if whole and tbase else "-")
        rows.append(["-" if c == "n/a" else c for c in row])
    header = ["run", "ranks × strategy", "samples/s", f"speedup vs {runs[ref].name}",
              "sync share", "wire MB/step/rank", "eval loss", "exact-match ± s.e. (n)"]
    if trainers:
        header.insert(4, "Trainer's samples/s, whole run")
    return _table(header, rows, num_cols=set(range(2, len(header))))


def _unique_names(runs: list[Run]) -> None:
    """Runs named alike (runs/a/x, runs/b/x) get enough parent folders to differ."""
    depth = 1
    while len({r.name for r in runs}) < len(runs) and depth < 6:
        depth += 1
        for r in runs:
            parts = os.path.normpath(os.path.abspath(r.path)).split(os.sep)
            r.name = "/".join(parts[-depth:])


def build_report(runs: list[Run], title: str | None = None) -> str:
    """The report as one HTML string (images embedded)."""
    if not runs:
        raise LorasyncError("report: no run directories given; pass one or more")
    _unique_names(runs)
    sums = [summarize_run(r) for r in runs]
    series = [trainer_series(r) if r.kind == "trainer" else step_series(r.records) for r in runs]
    switches = [s["switches"] for s in sums]
    colors = run_colors(len(runs))
    title = title or ("lorasync report: " + (runs[0].name if len(runs) == 1
                                             else f"{len(runs)} runs"))
    now = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    parts = [f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
             f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>",
             f"<h1>{_e(title)}</h1>",
             f"<p class=\"meta\">written {_e(now)} from "
             + ", ".join(f"<code>{_e(os.path.abspath(r.path))}</code>" for r in runs) + "</p>"]
    for run in runs:
        for note in run.notes:
            parts.append(f'<div class="note">{_e(run.name)}: {_e(note)}</div>')

    if len(runs) > 1:
        parts.append("<h2>Comparison</h2>")
        parts.append(_comparison(runs, sums))
        parts.append('<p class="meta">samples/s: steady state (first step left out), all '
                     "ranks; sync share: exposed sync time / step time; eval: the run's last "
                     "evaluation; s.e.: binomial standard error of exact-match. Differences "
                     "smaller than about two standard errors are noise."
                     + (" Trainer runs: from the lorasync/* entries of the Trainer's logs "
                        "(means per logging window, the first window left out); the Trainer's "
                        "own samples/s covers the whole run (start-up and first step included) "
                        "and is what a Trainer without lorasync has; '-': not in the run's "
                        "logs." if any(r.kind == "trainer" for r in runs) else "") + "</p>")
    else:
        parts.append("<h2>Summary</h2>")
        parts.append(_table(None, [list(r) for r in _summary_rows(sums[0])]))

    parts.append("<h2>Where the time goes</h2>")
    parts.append(_figure(plot_throughput(runs, series, switches, colors), "samples per second",
                         "Global samples/s per step (sum of samples over ranks / slowest "
                         "rank's step time). Dashed lines: strategy switches."))
    parts.append(_figure(plot_time_split(runs, series, switches, colors),
                         "compute vs exposed sync",
                         "Per step, mean over ranks: compute (forward, backward, optimizer), "
                         "exposed sync (time the step waited on gradient sync), and the rest "
                         "(data loading)."))
    parts.append(_figure(plot_wire(runs, series, switches, colors), "wire bytes per step",
                         "Payload bytes each rank handed to collectives per step, at the dtype "
                         "sent (not ring traffic)."))
    parts.append("<h2>Quality</h2>")
    parts.append(_figure(plot_loss(runs, series, switches, colors), "loss",
                         "Train loss per step (mean over ranks); eval loss from evals.jsonl."))

    any_sw = [(run, sw) for run, sw in zip(runs, switches) if sw]
    if any_sw:
        parts.append("<h2>Strategy switches</h2>")
        rows = [[run.name, str(sw["step"]), str(sw["from"]), str(sw["to"]), sw["reason"] or ""]
                for run, sws in any_sw for sw in sws]
        parts.append(_table(["run", "from step", "from", "to", "reason"], rows, num_cols={1}))

    if len(runs) > 1:
        for run, s in zip(runs, sums):
            parts.append(f"<h2>Run {_e(run.name)}</h2>")
            parts.append(_table(None, [list(r) for r in _summary_rows(s)]))
    parts.append("</body></html>\n")
    return "\n".join(parts)


def default_output(run_dirs: list[str]) -> str:
    """RUN_DIR/report.html for one run, ./lorasync-report.html for several."""
    if len(run_dirs) == 1:
        return os.path.join(run_dirs[0], "report.html")
    return "lorasync-report.html"


def write_report(run_dirs: list[str], output: str | None = None,
                 title: str | None = None) -> str:
    """Read the runs, write the report (atomically); returns its path."""
    runs = [load_run(d) for d in run_dirs]  # all errors before any plotting
    text = build_report(runs, title=title)
    path = output or default_output(run_dirs)
    folder = os.path.dirname(os.path.abspath(path))
    tmp = path + ".part"
    try:
        os.makedirs(folder, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        raise LorasyncError(f"{path}: cannot write the report ({exc.strerror}); pass "
                            "-o PATH in a folder you can write to") from None
    return path

