#!/usr/bin/env python3
"""The tables in README.md and docs/, generated from the code and bench/reference/.

    python bench/tables.py            # rewrite every generated table in place
    python bench/tables.py --check    # exit 1 if a table differs from its data (a test runs this)

A generated table sits between two markers in a Markdown file:

    <!-- BEGIN table:NAME -->
    ...
    <!-- END table:NAME -->

and ``NAME`` is one of the renderers below, each reading the catalog (the
strategies table) or the committed result files of one bench (``bench/
reference/NAME``, kept with ``bench/reference.py``).  A table and its data
therefore cannot drift apart: change the data, run this, commit both.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
REF = ROOT / "bench" / "reference"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"(<!-- BEGIN table:(?P<name>[\w.+-]+) -->\n)(?P<body>.*?)(<!-- END table:(?P=name) -->)",
                  re.S)

sys.path.insert(0, str(ROOT / "src"))


class Missing(Exception):
    """A table's result file is not committed (yet)."""


def _load(*parts: str):
    path = REF.joinpath(*parts)
    if not path.is_file():
        raise Missing(f"bench/reference/{'/'.join(parts)}")
    return json.loads(path.read_text())


def _mb(x: float) -> str:
    return f"{x / 1e6:.3f}"


# --------------------------------------------------------------------------- renderers


def strategies() -> str:
    """Every strategy of the catalog: what it sends, its bytes for the embedded
    default, its options with their defaults."""
    from lorasync import catalog
    from lorasync.plan.costmodel import MODELS, lora_matrices

    smol = lora_matrices(MODELS["smollm2-135m"], 8)
    fp32 = catalog.wire_bytes("allreduce", smol, 2)
    lines = ["| strategy | what a rank sends | MB per step, steady state (SmolLM2-135M r=8, "
             "2 ranks) | options (default) |", "|---|---|---|---|"]
    for name in catalog.SPECS:
        spec = catalog.spec(name)
        if spec.wire is not None:
            b = catalog.wire_bytes(name, smol, 2)
            size = f"{_mb(b)} ({fp32 / b:.1f}x less)" if b and b < fp32 else _mb(b)
        else:
            size = "measured"
        opts = ", ".join(f"`{k}={str(v).lower() if isinstance(v, bool) else v}`"
                         for k, v, _ in catalog.option_help(name)
                         if name != "auto" or k in ("candidates", "interval"))
        lines.append(f"| `{name}` | {spec.summary} | {size} | {opts or '-'} |")
    return "\n".join(lines)


def _bench() -> dict:
    return _load("bench", "results.json")["results"]


def _eff(cells: list[dict], key: str) -> dict | None:
    return next((c for c in cells if c.get("key") == key and c.get("samples_per_s")), None)


def _last_strategy(prof: str, row: str) -> str | None:
    """The strategy of a row's last step, from its committed metrics."""
    path = REF / "bench" / prof / row / "metrics.jsonl"
    if not path.is_file():
        return None
    recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return max(recs, key=lambda r: r["step"]).get("strategy") if recs else None


def headline() -> str:
    """Scaling efficiency on each link (samples/s against the no-sync ceiling):
    plain DDP, torch's hooks, lorasync auto (lorasync bench)."""
    res = _bench()
    lines = ["| link | plain DDP | torch fp16 hook | torch PowerSGD (rank 1) | lorasync `auto` "
             "(its pick) | auto vs plain DDP |", "|---|---|---|---|---|---|"]
    for prof, cells in res.items():
        ddp, auto = _eff(cells, "ddp"), _eff(cells, "auto")
        row = [prof.replace("mbit", " Mbit/s").replace("gbit", " Gbit/s").replace("+", " + ")]
        for key in ("ddp", "torch_fp16", "torch_powersgd"):
            c = _eff(cells, key)
            row.append(f"{100 * c['efficiency']:.0f}%" if c else "-")
        if auto:
            pick = auto.get("final_strategy") or _last_strategy(prof, "auto") or "auto"
            row.append(f"**{100 * auto['efficiency']:.0f}%** ({pick})")
            row.append(f"{auto['samples_per_s'] / ddp['samples_per_s']:.2f}x" if ddp else "-")
        else:
            row += ["-", "-"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def bench_profile(prof: str) -> str:
    """One profile's progressive-optimization table with its verdicts."""
    from lorasync.bench.tables import progressive_table, progressive_verdicts

    res = _bench()
    if prof not in res:
        raise Missing(f"bench/reference/bench/results.json (profile {prof})")
    cells = res[prof]
    table = progressive_table(prof, cells).split("\n", 3)[3]  # without the heading
    return table + "\n\n" + "\n".join(f"- {v}" for v in progressive_verdicts(cells))


def plan_accuracy() -> str:
    """Measured / predicted step time - 1, every strategy on every link (bench/plan_accuracy.py)."""
    base = REF / "plan-accuracy"
    if not base.is_dir():
        raise Missing("bench/reference/plan-accuracy")
    profiles = sorted((p for p in base.iterdir() if (p / "rows.json").is_file()),
                      key=lambda p: _rate_key(p.name))
    names: list[str] = []
    table: dict[str, dict[str, dict]] = {}
    probes = {}
    for pdir in profiles:
        rows = json.loads((pdir / "rows.json").read_text())
        table[pdir.name] = {r["row"]: r for r in rows if not r["row"].startswith("ceiling")}
        names += [r["row"] for r in rows if not r["row"].startswith("ceiling")
                  and r["row"] not in names]
        probe = json.loads((pdir / "probe.json").read_text())
        probes[pdir.name] = probe["model"]["bandwidth_Bps"]
    from lorasync.units import fmt_rate

    lines = ["| link (probe) | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    within = total = 0
    worst = (0.0, "")
    for prof, rows in table.items():
        cells = []
        for n in names:
            r = rows.get(n, {})
            if "plan_error" not in r:
                cells.append(r.get("status", "-"))
                total += 1
                continue
            e = r["plan_error"]
            total += 1
            within += abs(e) <= 0.15
            worst = max(worst, (abs(e), f"{n} at {prof}"))
            cells.append(f"{100 * e:+.1f}%")
        lines.append(f"| {prof} ({fmt_rate(probes[prof])}) | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"{within} of {total} within the 15% target; worst {100 * worst[0]:.1f}% "
                 f"({worst[1]}).")
    return "\n".join(lines)


def quality() -> str:
    """bench/strategies.py: bytes, encode cost and eval quality of every strategy."""
    import math

    data = _load("strategies", "strategies.json")
    runs, limit = data["runs"], data["limit"]
    refs = [v["eval_after"]["eval_loss"] for k, v in runs.items() if k.startswith("allreduce")
            and "error" not in v]
    lines = [f"Reference: fp32 all-reduce over {len(refs)} seeds, eval loss {min(refs):.4f} .. "
             f"{max(refs):.4f}; quality limit (worst + 5%): {limit:.4f}. "
             f"{data['args']['steps']} steps x 2 ranks, {data['args']['eval_size']} eval examples.",
             "", "| strategy (options) | wire MB/step | compression | encode+decode ms/step "
             "(share of compute) | eval loss | exact-match | quality |", "|---|---|---|---|---|---|---|"]
    for k, v in runs.items():
        if "error" in v:
            lines.append(f"| {k} | failed: {v['error']} | | | | | |")
            continue
        ea = v["eval_after"]
        n = ea["n"]
        p = ea["correct"] / n if n else float("nan")
        se = math.sqrt(p * (1 - p) / n) if n else float("nan")
        comp = v["fp32_bytes_per_step"] / v["wire_bytes_per_step"] if v["wire_bytes_per_step"] \
            else float("inf")
        share = v["encode_s"] / v["compute_s_mean"] if v["compute_s_mean"] else 0.0
        verdict = "reference" if k.startswith("allreduce") else (
            "pass" if ea["eval_loss"] <= limit else "fail")
        name = k.replace(":", " ", 1).replace(":", ", ")
        lines.append(f"| {name} | {_mb(v['wire_bytes_per_step'])} | {comp:.1f}x | "
                     f"{1000 * v['encode_s']:.1f} ({100 * share:.1f}%) | {ea['eval_loss']:.4f} | "
                     f"{100 * p:.0f}% +-{100 * se:.0f} | {verdict} |")
    return "\n".join(lines)


def auto_cut() -> str:
    """bench/auto_adapt.py: auto against fixed strategies through a link cut."""
    data = _load("auto-cut", "results.json")
    a, rows = data["args"], data["rows"]
    c, end = a["cut_at"], a["steps"]
    lines = [f"| run | strategies | {a['rate']} (steps 2-{c}) | {a['cut_rate']}, first 50 steps "
             f"after the cut | {a['cut_rate']} steady ({min(end, c + 21)}-{end}) |",
             "|---|---|---|---|---|"]

    def f(x, k):
        v, e = x.get(k), x.get(k + "_eff")
        return "-" if v is None else f"{v:.2f} ({e:.0%})"

    for x in rows:
        if x["error"]:
            lines.append(f"| {x['label']} | {x['error']} | | | |")
            continue
        lines.append(f"| {x['label']} | {x['sequence']} | {f(x, 'before')} | {f(x, 'adapt')} "
                     f"| {f(x, 'steady')} |")
    r = data["ratios"]
    lines += ["", f"auto against the best fixed strategy (samples/s): {r['before']:.0%} before "
              f"the cut (target 95%), {r['adapt']:.0%} over the 50 steps after it (target 80%), "
              f"{r['steady']:.0%} in the steady state (target 95%); by compute share "
              f"{r['before_eff']:.0%}, {r['adapt_eff']:.0%}, {r['steady_eff']:.0%}."]
    return "\n".join(lines)


def scaling() -> str:
    """bench/train_scaling.py: samples/s with 1 and 2 ranks on this machine."""
    data = _load("scaling", "scaling.json")
    base = data["1"]["samples_per_s"]
    lines = ["| ranks | samples/s | vs 1 rank | step s (median) | sync share | wire MB/step |",
             "|---|---|---|---|---|---|"]
    for n, s in sorted(data.items()):
        lines.append(f"| {n} | {s['samples_per_s']:.2f} | {s['samples_per_s'] / base:.2f}x | "
                     f"{s['step_s_median']:.3f} | {100 * s['sync_share']:.1f}% | "
                     f"{_mb(s['wire_bytes_per_step'])} |")
    return "\n".join(lines)


def hf_exits() -> str:
    """bench/hf_exits.py: runs of the Trainer exit script that did not exit 0
    cleanly, with the exit guard (this checkout) and, in the same rounds,
    without it (the checkout before it); then the guard's own 20-run series."""
    paired = _load("hf", "exits-paired.json")
    alone = _load("hf", "exits.json")
    after, before = paired["strategies"], paired["before"]["strategies"]
    lines = ["| strategy | without the guard: not clean | with the guard: not clean | "
             "with the guard, alone: not clean |", "|---|---|---|---|"]

    def cell(r: dict | None) -> str:
        return "-" if r is None else f"{r['runs'] - r['clean']} of {r['runs']}"

    for name in after:
        lines.append(f"| {name} | {cell(before.get(name))} | {cell(after[name])} | "
                     f"{cell(alone['strategies'].get(name))} |")
    tb, ta, t1 = paired["before"]["total"], paired["total"], alone["total"]
    lines.append(f"| **all** | **{tb['runs'] - tb['clean']} of {tb['runs']}** | "
                 f"**{ta['runs'] - ta['clean']} of {ta['runs']}** | "
                 f"**{t1['runs'] - t1['clean']} of {t1['runs']}** |")
    lines.append("")
    lines.append(f"Host load (1-minute average) {paired['load_before']:.1f} before and "
                 f"{paired['load_after']:.1f} after the paired rounds; {alone['load_before']:.1f} "
                 f"and {alone['load_after']:.1f} for the series alone.")
    return "\n".join(lines)


def trl() -> str:
    """bench/trl_vs_train.py: lorasync train against TRL's SFTTrainer on one machine,
    and lorasync train's default strategy against --comm allreduce."""
    d = _load("trl", "trl_vs_train.json")
    a, q, sp, default = d["args"], d["quality"], d["speed"], d["default_strategy"]
    rounds, mean = sp["rounds"], sp["mean"]

    def cells(xs, spec=".2f"):
        return ", ".join("-" if x is None else format(x, spec) for x in xs)

    def verdict(ok):
        return {True: "pass", False: "**fail**", None: "-"}[ok]

    lines = [f"{a['steps']} steps x 2 ranks (one thread each), {a['batch_size']} examples x "
             f"<= {a['seq_len']} tokens per rank per step, lr {a['lr']:g} cosine, "
             f"{a['warmup']} warm-up steps; {len(rounds['trl'])} rounds, round k with seed k, "
             f"the rows' order rotated each round; eval loss on {a['eval_size']} held-out "
             f"examples. Host load (1-minute average) {d['load_before']:.1f} before, "
             f"{d['load_after']:.1f} after.", "",
             "| run | samples/s by round | mean | median | mean vs TRL | eval loss by seed | "
             "quality |", "|---|---|---|---|---|---|---|"]
    limit = q["limit"]
    for key, name, qk in (("trl", "TRL `SFTTrainer` (plain DDP)", None),
                          ("allreduce", "`lorasync train --comm allreduce`", "allreduce"),
                          ("default", f"`lorasync train` (default: `{default}`)", "default")):
        if not rounds.get(key):
            continue
        m = mean[key]
        vs = f"{m / mean['trl']:.3f}x" if mean.get("trl") and m else "-"
        losses = q["trl_eval_losses"] if qk is None else q[qk]["eval_losses"]
        med = sorted(rounds[key])[len(rounds[key]) // 2]
        lines.append(f"| {name} | {cells(rounds[key])} | {m:.2f} | {med:.2f} | {vs} | "
                     f"{cells(losses, '.4f')} | "
                     f"{'reference' if qk is None else verdict(q[qk]['pass'])} |")
    if limit:
        lines += ["", f"Quality limit (the worst TRL seed + 5%): {limit:.4f}."]
    if "default_vs_allreduce" in sp:
        first = [x for x in sp.get("default_to_first_step_s") or [] if x is not None]
        first_ar = [x for x in sp.get("allreduce_to_first_step_s") or [] if x is not None]
        lines.append(f"Default (`{default}`) against `--comm allreduce`: "
                     f"{sp['default_vs_allreduce']:.3f}x the samples/s by the means (by round: "
                     f"{cells(sp['default_vs_allreduce_rounds'], '.3f')}); launch to the end "
                     f"of step 1 {cells(first, '.1f')} s against {cells(first_ar, '.1f')} s.")
        # auto's own set-up, from its log lines: encode timing and the start probe
        own = []
        for r in d["rows"]:
            if r.get("comm") == "default" and r.get("auto_log"):
                secs = [float(x) for line in r["auto_log"][:3]
                        for x in re.findall(r"\((\d+(?:\.\d+)?) s\)", line)]
                if secs:
                    own.append(sum(secs))
        if own:
            lines[-1] += (f" Of that, auto's own set-up as its log times it (each "
                          f"candidate's encode+decode, the start probe; its timing of the DiLoCo "
                          f"variants is not logged in seconds) took {cells(own, '.1f')} s.")
    mem = d.get("memory") or {}
    if mem:
        lines += ["", "| mode | TRL peak resident MiB, rank 0 / 1 | lorasync train, rank 0 / 1 "
                  "| lorasync vs TRL (rank 0) | samples/s TRL / lorasync |",
                  "|---|---|---|---|---|"]

        def mib(x):
            return "-" if not x else " / ".join(f"{b / 2**20:.0f}" for b in x)

        for mode, m in mem.items():
            t, lo = m.get("trl"), m.get("lorasync")
            ratio = f"{lo[0] / t[0]:.2f}x" if t and lo else "-"
            sps = (f"{cells([m.get('trl_samples_per_s')])} / "
                   f"{cells([m.get('lorasync_samples_per_s')])}")
            lines.append(f"| {mode} ({m['steps']} steps) | {mib(t)} | {mib(lo)} | {ratio} | "
                         f"{sps} |")
    return "\n".join(lines)


def switch_bench() -> str:
    """bench/hf_trainer.py --sft: one TRL SFTTrainer script run plain, with
    accelerate's fp16 hook and with the switch, beside ``lorasync train``."""
    from lorasync.units import fmt_bytes, fmt_rate, parse_rate_bps

    d = _load("hf", "switch_10mbit.json")
    rate, startup_rate = (fmt_rate(parse_rate_bps(d[k]), unit="bit") for k in ("rate", "startup_rate"))
    names = {"sft-plain": "TRL script, plain (the Trainer's DDP)",
             "sft-accelerate_fp16": "TRL script, accelerate's fp16 comm hook",
             f"sft-switch-{d['switch_strategy']}":
                 f"TRL script, `LORASYNC_STRATEGY={d['switch_strategy']}`",
             f"lorasync-train-{d['switch_strategy']}":
                 f"`lorasync train --comm {d['switch_strategy']}`"}
    rows = {r["label"]: r for r in d["rows"]}
    plain = rows.get("sft-plain", {}).get("samples_per_s")
    lines = ["| run | samples/s | vs plain | start-up sync | gradient sync at the end |",
             "|---|---|---|---|---|"]
    for label, name in names.items():
        r = rows.get(label)
        if r is None:
            continue
        if "error" in r:
            lines.append(f"| {name} | failed ({r['error'].split(';')[0]}) | | | |")
            continue
        sps = r["samples_per_s"]
        sync = {"sft-plain": "fp32 all-reduce", "sft-accelerate_fp16": "fp16 all-reduce"}.get(
            label, r.get("final_strategy"))
        start = r.get("startup_bytes")
        start = "-" if start is None else fmt_bytes(start) + (
            " (DDP's broadcast)" if label in ("sft-plain", "sft-accelerate_fp16") else "")
        lines.append(f"| {name} | {sps:.2f} | {sps / plain:.2f}x | {start} | {sync} |"
                     if plain else f"| {name} | {sps:.2f} | - | {start} | {sync} |")
    t = d.get("targets", {})
    lines.append("")
    parts = []
    if "speedup_vs_plain" in t:
        x = t["speedup_vs_plain"]
        parts.append(f"switch vs plain {x['ratio']:.2f}x (target >= 1.5x: "
                     f"{'met' if x['met'] else 'not met'})")
    if "parity_vs_lorasync_train" in t:
        x = t["parity_vs_lorasync_train"]
        parts.append(f"switch vs `lorasync train` {x['ratio']:.3f} (target within 5%: "
                     f"{'met' if x['met'] else 'not met'})")
    lines.append("; ".join(parts) + "." if parts else "Targets: no figures (a row failed).")
    lines.append("")
    lines.append(f"{d['steps']} steps x 2 ranks, {d['batch_size']} examples of <= {d['seq_len']} "
                 f"tokens per rank per step, link {rate}; the plain and fp16 rows start on "
                 f"{startup_rate} and are cut to {rate} before step 1. Host load "
                 f"(1-minute average) {d['load_before']:.1f} before, {d['load_after']:.1f} after.")
    return "\n".join(lines)


def switch_parity() -> str:
    """bench/hf_trainer.py --sft --sft-rows train,switch --rounds N: the switch
    row and ``lorasync train`` alternating, with rank 0's time per step."""
    d = _load("hf", "switch_10mbit_parity.json")
    s = d["switch_strategy"]
    names = {f"sft-switch-{s}": f"TRL script, `LORASYNC_STRATEGY={s}`",
             f"lorasync-train-{s}": f"`lorasync train --comm {s}`"}
    rows = {r["label"]: r for r in d["rows"]}
    lines = ["| run | samples/s, each round | mean | s/step (rank 0, best round) | of which computing | "
             "sync share | gradient sync at the end |", "|---|---|---|---|---|---|---|"]
    for label, name in names.items():
        r = rows.get(label)
        if r is None or "error" in r:
            lines.append(f"| {name} | failed | | | | | |")
            continue
        rounds = [x for x in r["rounds"] if x]
        lines.append(f"| {name} | {', '.join(f'{x:.2f}' for x in r['rounds'])} | "
                     f"{sum(rounds) / len(rounds):.2f} | {r['step_s']:.3f} | {r['compute_s']:.3f} | "
                     f"{100 * r['sync_share']:.1f}% | {r.get('final_strategy')} |")
    t = d["targets"].get("parity_vs_lorasync_train")
    lines.append("")
    if t:
        lines.append(f"Switch vs `lorasync train`, means of the rounds: {t.get('mean_ratio', t['ratio']):.3f} "
                     f"(target within 5%: {'met' if t['met'] else 'not met'}). Host load (1-minute "
                     f"average) {d['load_before']:.1f} before, {d['load_after']:.1f} after.")
    return "\n".join(lines)


def switch_ceilings() -> str:
    """bench/hf_trainer.py --sft --sft-rows train,switch,ceilings --rounds N:
    each path beside its own no-sync ceiling (``--comm none``,
    ``LORASYNC_STRATEGY=none``), rounds alternating."""
    d = _load("hf", "switch_10mbit_ceilings.json")
    s = d["switch_strategy"]
    rows = {r["label"]: r for r in d["rows"]}
    paths = [("TRL script", f"sft-switch-{s}", "sft-switch-none", f"`LORASYNC_STRATEGY={s}`"),
             ("`lorasync train`", f"lorasync-train-{s}", "lorasync-train-none", f"`--comm {s}`")]
    lines = [f"| path | {s}: samples/s, each round | no sync: samples/s, each round | "
             "share of its ceiling, means (best rounds) | computing, s/step (no sync) |",
             "|---|---|---|---|---|"]

    def mean(r):
        xs = [x for x in r["rounds"] if x]
        return sum(xs) / len(xs)

    for name, run, ceil, how in paths:
        r, c = rows.get(run), rows.get(ceil)
        if r is None or c is None or "error" in r or "error" in c:
            lines.append(f"| {name} | failed | | | |")
            continue
        lines.append(f"| {name}, {how} | {', '.join(f'{x:.2f}' for x in r['rounds'])} | "
                     f"{', '.join(f'{x:.2f}' for x in c['rounds'])} | "
                     f"{mean(r) / mean(c):.3f} ({max(r['rounds']) / max(c['rounds']):.3f}) | "
                     f"{c.get('compute_s', float('nan')):.3f} |")
    t = d["targets"].get("parity_of_ceiling_shares")
    p = d["targets"].get("parity_vs_lorasync_train")
    lines.append("")
    if t and p:
        lines.append(
            f"Switch vs `lorasync train` in samples/s, means of the rounds: "
            f"{p.get('mean_ratio', p['ratio']):.3f} (target within 5%: "
            f"{'met' if p['met'] else 'not met'}); the TRL script's own no-sync ceiling is "
            f"{t['ceiling_ratio']:.3f} of `lorasync train`'s; as shares of their ceilings "
            f"{t['switch_share']:.3f} vs {t['train_share']:.3f}, ratio {t['ratio']:.3f} "
            f"(within 5%: {'met' if t['met'] else 'not met'}). Host load (1-minute average) "
            f"{d['load_before']:.1f} before, {d['load_after']:.1f} after.")
    return "\n".join(lines)


def switch_shares() -> str:
    """bench/hf_trainer.py --sft --sft-rows train,switch,ceilings --rounds N, timed
    alike on both paths (lorasync's final sync left out of the switch rows too):
    each path beside its own no-sync ceiling, TRL's per-step metric gathers, and
    every run's host CPU pressure."""
    from lorasync.units import fmt_bytes, fmt_rate, parse_rate_bps

    d = _load("hf", "switch_10mbit_shares.json")
    s = d["switch_strategy"]
    rows = {r["label"]: r for r in d["rows"]}
    names = [(f"sft-switch-{s}", f"TRL script, `LORASYNC_STRATEGY={s}`"),
             ("sft-switch-none", "TRL script, `LORASYNC_STRATEGY=none` (its ceiling)"),
             (f"lorasync-train-{s}", f"`lorasync train --comm {s}`"),
             ("lorasync-train-none", "`lorasync train --comm none` (its ceiling)")]
    f = lambda x, spec=".3f": "-" if x is None else format(x, spec)  # noqa: E731
    lines = ["| run | samples/s, each round | mean | s/step, steps 2..N (best round) | "
             "TRL's metric gathers, s/step (worst step) | final sync after step N, not counted | "
             "gradient sync at the end |", "|---|---|---|---|---|---|---|"]

    def mean(r):
        xs = [x for x in r["rounds"] if x]
        return sum(xs) / len(xs)

    for label, name in names:
        r = rows.get(label)
        if r is None or "error" in r:
            lines.append(f"| {name} | failed | | | | | |")
            continue
        g = "-" if r.get("gather_s") is None else \
            f"{r['gather_s']:.3f} ({r['gather_max_s']:.3f})"
        fs = (f"{r['final_sync_s']:.2f} s ({fmt_bytes(r['final_sync_bytes'])})"
              if r.get("final_sync_bytes") else "-")
        lines.append(f"| {name} | {', '.join(f(x, '.2f') for x in r['rounds'])} | "
                     f"{mean(r):.2f} | {f(r.get('step_s'))} | {g} | {fs} | "
                     f"{r.get('final_strategy')} |")
    t = d["targets"].get("parity_of_ceiling_shares")
    p = d["targets"].get("parity_vs_lorasync_train")
    lines.append("")
    if t and p:
        sw, tr = rows[f"sft-switch-{s}"], rows[f"lorasync-train-{s}"]
        cs, ct = rows["sft-switch-none"], rows["lorasync-train-none"]
        best_sw = sw["samples_per_s"] / cs["samples_per_s"]
        best_tr = tr["samples_per_s"] / ct["samples_per_s"]
        lines.append(
            f"Switch vs `lorasync train` in samples/s, means of the rounds: "
            f"{p.get('mean_ratio', p['ratio']):.3f} (target within 5%: "
            f"{'met' if p['met'] else 'not met'}). The TRL script's own no-sync ceiling is "
            f"{t['ceiling_ratio']:.3f} of `lorasync train`'s. Share of its own ceiling, means of "
            f"the rounds: switch {t['switch_share']:.3f}, `lorasync train` {t['train_share']:.3f}, "
            f"ratio {t['ratio']:.3f} (within 5%: {'met' if t['met'] else 'not met'}); best "
            f"rounds {best_sw:.3f} vs {best_tr:.3f}, ratio {best_sw / best_tr:.3f}.")
        if sw.get("gather_s") is not None and cs.get("gather_s") is not None and sw.get("step_s"):
            extra = sw["gather_s"] - cs["gather_s"]
            lines.append("")
            lines.append(
                f"TRL's metric gathers took {extra:.3f} s/step more under {s} than without sync "
                f"({100 * extra / sw['step_s']:.1f}% of the switch's {sw['step_s']:.3f} s step, "
                "best rounds).")
    runs = d.get("runs") or []
    if runs:
        lines.append("")
        lines.append("Every run in order, samples/s (host CPU pressure: share of the run's time "
                     "in which some task waited for a CPU): " + "; ".join(
                         f"{x['label']} {f(x['samples_per_s'], '.2f')} "
                         f"({f(x.get('cpu_pressure'), '.2f')})" for x in runs) + ".")
    lines.append("")
    lines.append(f"{d['steps']} steps x 2 ranks, {d['batch_size']} examples of <= {d['seq_len']} "
                 f"tokens per rank per step, link {fmt_rate(parse_rate_bps(d['rate']), unit='bit')}. "
                 f"Host load (1-minute average) {d['load_before']:.1f} before, "
                 f"{d['load_after']:.1f} after.")
    return "\n".join(lines)


def bytes_to_target(res: dict | None = None) -> str:
    """bench/bytes_to_target.py: bytes per node until fp32 DDP's eval loss, and
    the ratio to fp32 DDP's (``res``: a result JSON; default the committed one)."""
    res = res if res is not None else _load("bytes", "results.json")
    ref, a = res["references"], res["args"]
    mb = lambda b: "-" if b is None else f"{b / 1e6:.3f}"  # noqa: E731
    curve = lambda ev: " ".join(f"{s_}: {x:.2f}" for s_, x in ev) if ev else "-"  # noqa: E731
    lines = [f"{a['nodes']} ranks over loopback, `{a['model']}`, batch {a['batch_size']} per "
             f"rank, schedule {a['max_steps']} steps, DiLoCo not streamed; target: fp32 "
             f"all-reduce's eval loss at step {a['steps']} "
             f"({ref['target']:.4f}); quality limit {ref['quality_limit']:.4f} (worst of "
             f"{len(ref['reference'])} seeds + 5%); {a['eval_size']} eval examples after every "
             f"outer step (the references every {ref.get('eval_interval', 8)} steps).", "",
             "| outer sync | MB per node to target | x fewer than fp32 DDP | steps to target | "
             f"eval loss at step {a['steps']} (quality rule) | eval loss (step: loss) |",
             "|---|---|---|---|---|---|",
             f"| fp32 DDP (`--comm allreduce`, seed 0: the target) | "
             f"{mb(ref['ddp_bytes_to_target'])} | 1x | {ref['ddp_reached_step']} | "
             f"{ref['target']:.4f} (reference) | {curve(ref.get('evals_seed0'))} |"]
    for c in res["cells"]:
        q = "-" if c["quality"] is None else ("pass" if c["quality"] else "FAIL")
        done = c["status"] == "ok" or c["status"].startswith("stopped: reached")
        got = (mb(c["bytes_to_target"]) if c["reached_step"] else
               f"not reached in {c['steps_run']} steps ({mb(c.get('bytes_spent'))} sent)")
        lines.append(f"| {c['label']}{'' if done else ' (' + c['status'] + ')'} | {got} | "
                     f"{'-' if c['ratio'] is None else format(c['ratio'], '.0f') + 'x'} | "
                     f"{c['reached_step'] or '-'} | "
                     f"{'-' if c['eval_at_steps'] is None else format(c['eval_at_steps'], '.4f')}"
                     f" ({q}) | {curve(c.get('evals'))} |")
    return "\n".join(lines + ["", f"Verdict: {res['verdict']}."])


def long_link_text(d: dict) -> str:
    """bench/long_link.py: auto's start figure on a long, thin link, before and
    after the probe was sized by latency (probe part, train part: either may be absent)."""
    from statistics import median

    out = []
    probe = [r for r in d.get("probe", []) if r.get("rc") == 0]
    if probe:
        out += ["| link (one-way delay) | version | real rate | start figure, probe=quick (default) | "
                "start / real | took | start figure, probe=live | start / real | took |",
                "|---|---|---|---|---|---|---|---|---|"]
        keys = list(dict.fromkeys((r["profile"], r["version"]) for r in probe))
        for prof, ver in keys:
            rs = [r for r in probe if (r["profile"], r["version"]) == (prof, ver)]
            cells = []
            for mode in ("quick", "live"):
                ratio = [r[mode]["over_real"] for r in rs]
                spread = f" ({min(ratio):.2f}-{max(ratio):.2f})" if len(rs) > 1 else ""
                cells.append(f"{median(r[mode]['start_Bps'] for r in rs) * 8e-6:.2f} Mbit/s | "
                             f"**{median(ratio):.2f}x**{spread} | "
                             f"{median(r[mode]['start_s'] for r in rs):.1f} s")
            out.append(f"| {prof.replace('/', ', ')} | {ver}{f' ({len(rs)} rounds)' if len(rs) > 1 else ''} | "
                       f"{median(r['real_Bps'] for r in rs) * 8e-6:.2f} Mbit/s | " + " | ".join(cells) + " |")
    train = [r for r in d.get("train", []) if r.get("rc") == 0]
    if train:
        ceil = max((r["samples_per_s"] for r in train if r["label"] == "ceiling"), default=None)
        a = d.get("args", {})
        first, end = a.get("measure_steps", 4) + 1, a.get("measure_steps", 4) + a.get("interval", 10)
        if out:
            out.append("")
        out += [f"| run ({train[0]['profile'].replace('/', ', ')} one way, {a.get('steps')} steps) | "
                "start figure | auto's decisions (step: strategy, outer sync) | first sync exposed | "
                f"exposed, steps {first}-{end} | exposed, whole run | samples/s (of the ceiling) |",
                "|---|---|---|---|---|---|---|"]
        for label in dict.fromkeys(r["label"] for r in train):
            rs = [r for r in train if r["label"] == label]
            for r in rs:
                seq = "; ".join(_auto_steps(r.get("auto_log", []))) or "-"
                share = f" ({r['samples_per_s'] / ceil:.0%})" if ceil and label != "ceiling" else ""
                rnd = f", round {r['round']}" if len(rs) > 1 else ""
                if label == "ceiling":
                    out.append(f"| no sync (the ceiling){rnd} | - | - | - | - | - | "
                               f"{r['samples_per_s']:.2f} |")
                    continue
                out.append(f"| auto, {r['version']}{rnd} | {r.get('start_figure') or '-'} | {seq} | "
                           f"{r['first_sync_exposed_s']:.2f} s | {r['first_window_exposed_s']:.2f} s | "
                           f"{r['exposed_share']:.0%} | {r['samples_per_s']:.2f}{share} |")
    if out:
        out += ["", f"Host load (1-minute average) {d['load_before'][0]:.1f} before, "
                f"{d['load_after'][0]:.1f} after; {d.get('date')}."]
    return "\n".join(out)


def _auto_steps(log: list[str]) -> list[str]:
    """``step N: STRATEGY, OUTER SYNC`` of each decision line auto logged."""
    out = []
    for line in log:
        m = re.match(r"auto: step (\d+): (?:keep (\w+)|(\w+) (?:outer sync )?->)", line)
        if not m:
            continue
        sync = re.search(r"; outer sync ([^;]+)$", line)
        out.append(f"{m.group(1)}: {m.group(2) or m.group(3)}" + (f" {sync.group(1)}" if sync else ""))
    return out


def long_link_probe() -> str:
    d = _load("slow-links", "long_link.json")
    return long_link_text({k: v for k, v in d.items() if k != "train"})


def long_link_train() -> str:
    d = _load("slow-links", "long_link.json")
    return long_link_text({k: v for k, v in d.items() if k != "probe"})


def long_link_rounds() -> str:
    return long_link_text(_load("slow-links", "long_link_rounds.json"))


def _peer_cells(d: dict) -> tuple[str, list[dict]]:
    link, res = next(iter(d["links"].items()))
    return link, res.get("rows") or res["cells"]


def _fig(x, fmt: str) -> str:
    """A figure of one run, or of several rounds: median (lowest-highest)."""
    if x is None:
        return "-"
    if not isinstance(x, dict):
        return fmt.format(x)
    if x["n"] == 1:
        return fmt.format(x["median"])
    return f"{fmt.format(x['median'])} ({fmt.format(x['min'])}-{fmt.format(x['max'])})"


def _peers_table(name: str) -> str:
    """bench/time_to_quality.py with peer rows (docs/peers.md): time to the
    target loss, its ratio to the no-network ideal and share of the ceiling,
    per candidate (median and range over the rounds)."""
    d = _load("slow-links", name)
    link, rows = _peer_cells(d)
    cells = d["links"][link]["cells"]
    a = d["args"]
    lines = [f"{link}, {a['nodes']} emulated nodes, batch {a['batch_size']} per rank, target = "
             f"exact all-reduce's eval loss at step {a['steps']} ({d['target']:.4f}), "
             f"{a.get('rounds', 1)} round(s) interleaved; ideal {d['ideal_s']:.0f} s of "
             f"training, ceiling {d['ceiling_samples_per_s']:.2f} samples/s", "",
             "| candidate | reached the target | time to target | x ideal | % of ceiling | "
             f"exposed sync | eval loss at step {a['steps']} |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["key"] == "ceiling":
            continue
        why = sorted({x.split(":")[0] if x.startswith("failed") else
                      x.replace("stopped: ", "").split(" (")[0]
                      for x in r.get("statuses", []) if "reached the target" not in x
                      and x != "ok"}) or [f"not within {a['max_steps']} steps"]
        reached = (f"{r['reached']}/{r['rounds']} rounds" + (f" ({'; '.join(why)})" if why
                                                             and r["reached"] < r["rounds"]
                                                             else "") if "rounds" in r else
                   f"at step {r['reached_step']}" if r.get("reached_step") else
                   f"no ({r['steps_run']} steps)")
        bounds = [c["ratio_lower_bound"] for c in cells if c["key"] == r["key"]
                  and c.get("ratio_lower_bound")]
        ratio = _fig(r.get("ratio_to_ideal"), "{:.2f}x") if r.get("ratio_to_ideal") or not bounds \
            else f"> {min(bounds):.2f}x"
        lines.append(f"| {r['label']} | {reached} | {_fig(r.get('time_to_target_s'), '{:.0f} s')} | "
                     f"{ratio} | "
                     f"{_fig(r.get('efficiency'), '{:.0%}')} | {_fig(r.get('sync_share'), '{:.0%}')} | "
                     f"{_fig(r.get('eval_at_steps'), '{:.4f}')} |")
    if d.get("workload"):   # --workload: the link is a GPU user's, emulated dilated
        w = d["workload"]
        lines += ["", f"- {w['text']}", f"- {d['links'][link]['probe']}"]
    if d.get("workload") or a.get("rounds", 1) > 1:
        from time_to_quality import peer_verdicts

        lines += [f"- {v}" for v in peer_verdicts(link, d["links"][link]["rows"])]
    return "\n".join(lines)


#: the headline on a GPU user's links (lorasync bench --workload, one invocation a link)
GPU_EQ_LINKS = ("1gbit", "100mbit", "10mbit", "1mbit", "100mbit+50ms")


def _gpu_eq(prof: str, folder: str = "") -> dict:
    d = _load(folder or f"gpu-eq-{prof.replace('+', '_')}", "results.json")
    return {"workload": d["workload"], "args": d["args"], **d["results"][prof]}


def _gpu_eq_cell(c: dict | None) -> str:
    if c is None:
        return "not run"
    if c.get("efficiency") is None:
        st = c.get("status", "")
        return ("< 3 steps in " + st.split("after ")[1].split(" s")[0] + " s"
                if st.startswith("capped") else st or "-")
    cell = f"{100 * c['efficiency']:.0f}%"
    if c.get("capped_steps"):
        cell += f" ({c['capped_steps']} steps, capped)"
    return cell


def headline_gpu(notes_too: bool = True) -> str:
    """lorasync bench --workload smollm2-h200 on a GPU user's links:
    share of the no-sync ceiling per row, the emulated link beside the user's;
    ``notes_too``: also the workload and each run's dilation (docs; the README
    says them in a sentence)."""
    lines = ["| user link (emulated here) | plain DDP | torch fp16 hook | torch PowerSGD "
             "(rank 1) | accelerate LocalSGD (every 8) | lorasync `auto` (its pick) |",
             "|---|---|---|---|---|---|"]
    notes = []
    for prof in GPU_EQ_LINKS:
        try:
            r = _gpu_eq(prof)
        except Missing:
            lines.append(f"| {_user(prof)} | not run | | | | |")
            continue
        cells = r["cells"]
        by = {c.get("key"): c for c in cells}
        w = r["workload"]
        emu = r["link"].partition("emulated as ")[2]
        row = [f"{_user(prof)} ({emu})"]
        row += [_gpu_eq_cell(by.get(k)) for k in ("ddp", "torch_fp16", "torch_powersgd")]
        from lorasync.bench.tables import never_synced

        lsgd = by.get("localsgd_8")
        # stopped before its first average: its share is of no sync at all
        row.append(f"no sync within the cap ({lsgd['capped_steps']} steps)"
                   if lsgd and never_synced(lsgd) else _gpu_eq_cell(lsgd))
        a = by.get("auto")
        # a pick auto no longer makes (the result file says why): shown, not in bold
        gone = (r.get("superseded") or {}).get("auto")
        row.append(f"{_gpu_eq_cell(a)} ({a.get('final_strategy') or a.get('strategy')}: {gone})"
                   if a and gone else
                   f"**{_gpu_eq_cell(a)}** ({a.get('final_strategy') or a.get('strategy')})"
                   if a and a.get("efficiency") is not None else _gpu_eq_cell(a))
        lines.append("| " + " | ".join(row) + " |")
        notes.append(f"{_user(prof)}: this host's no-sync step {w['cpu_step_s']:.2f} s, rate / "
                     f"{w['rate_div']:.1f}, delay x {w['delay_mul']:.1f}")
    if not notes:
        raise Missing("bench/reference/gpu-eq-*/results.json")
    if not notes_too:
        return "\n".join(lines)
    w = _gpu_eq(next(p for p in GPU_EQ_LINKS if (REF / f"gpu-eq-{p.replace('+', '_')}")
                     .is_dir()))["workload"]["workload"]
    return "\n".join(lines) + (
        f"\n\nWorkload {w['name']}: {w['description']}, {w['sync_bytes'] / 1e6:.2f} MB a sync "
        f"every {w['gpu_step_s']:g} s ({w['source']}). Each link is emulated so that sync bytes "
        "per second of compute match that workload; the dilation of each run (one invocation "
        "a link, its own no-sync calibration): " + "; ".join(notes) + ".")


def _user(prof: str) -> str:
    return re.sub(r"(\d)ms", r"\1 ms", prof.replace("mbit", " Mbit/s").replace(
        "gbit", " Gbit/s").replace("+", " + "))


def gpu_eq_profile(prof: str, folder: str = "") -> str:
    """One link of the GPU-equivalent headline: its full table and verdicts."""
    from lorasync.bench.tables import peer_share_verdict, progressive_table, progressive_verdicts

    r = _gpu_eq(prof, folder)
    cells = r["cells"]
    table = progressive_table(prof, cells).split("\n", 3)[3]
    verdicts = [r["workload"]["text"], r["link"], r.get("reference", ""),
                *progressive_verdicts(cells),
                *peer_share_verdict(cells)]
    return table + "\n\n" + "\n".join(f"- {v}" for v in verdicts)


def connectivity() -> str:
    """bench/connectivity.py: the overlay's transports at 100 Mbit/s (throughput
    as a share of the direct link) and a 20 s outage on each."""
    tp, og = _load("connectivity", "throughput.json"), _load("connectivity", "outage.json")
    lines = ["| transport | MTU | TCP goodput | share of direct | all-reduce bus bandwidth "
             "(16 MiB) | share of direct |", "|---|---|---|---|---|---|"]
    for r in tp["rows"]:
        bw = f"{r['busbw_Bps'] * 8 / 1e6:.1f} Mbit/s" if "busbw_Bps" in r else "-"
        share = f"{r['busbw_share']:.2f}" if "busbw_share" in r else "-"
        lines.append(f"| {r['kind']} | {r['mtu']} | {r['tcp_rate_bps'] / 1e6:.1f} Mbit/s | "
                     f"{r['tcp_share']:.2f} | {bw} | {share} |")
    lines += ["", "| transport | outage | the same TCP connection carried on | data flowed "
              "again after the outage |", "|---|---|---|---|"]
    for r in og["rows"]:
        back = "never" if r["resumed_after_s"] is None else f"{r['resumed_after_s']:.1f} s"
        lines.append(f"| {r['kind']} | {r['outage_s']:.1f} s | "
                     f"{'yes' if r['same_connection'] else 'no (' + str(r['error']) + ')'} | {back} |")
    return "\n".join(lines)


def _matrix_negative(neg: dict) -> str:
    if not neg:
        return "none (nothing is forbidden)"
    text = f"{neg['check']}: " + ("fails, as it must" if neg["failed"] else
                                  "PASSES (the condition is not real)")
    mp = neg.get("mapping") or {}
    if mp.get("seen_ports"):
        ports = mp["seen_ports"]
        text += (f" ({mp['node']}'s one UDP socket reached two ports of node0 from "
                 + (f"port {ports[0]} both times)" if len(set(ports)) == 1 else
                    "ports " + " and ".join(str(p) for p in ports) + ")"))
    return text


def connectivity_matrix_targets(parts: list[dict] | None = None) -> str:
    """bench/connectivity.py --parts matrix, run in parts (--cells): issue 32's
    cells with overlay=auto, the transport each node got, whether the tiny model
    trained, each cell's negative control, and the speed through the cell's
    overlay as a share of the direct link's in the same invocation: the
    all-reduce bus bandwidth and auto's samples/s on the embedded default."""
    if parts is None:
        paths = sorted((REF / "connectivity").glob("matrix-[0-9]*-cells*.json"))
        if not paths:
            raise Missing("bench/reference/connectivity/matrix-N-cells*.json")
        parts = [json.loads(p.read_text()) for p in paths]
    from lorasync.units import fmt_rate, parse_rate_bps

    m0 = parts[0]
    pct = f"{m0['direct_figures']['within']:.0%}"
    ar_rate, tr_rate = (fmt_rate(parse_rate_bps(m0[k]), unit="bit") for k in ("allreduce_rate", "train_rate"))
    lines = ["| node1 / node2 | node1 joins over | node2 joins over | node1 to node2 | "
             "trains (tiny, 3 ranks) | "
             "negative control (without the overlay) | all-reduce bus bandwidth, 16 MB at "
             f"{ar_rate} (share of direct) | auto on the embedded default at "
             f"{tr_rate}, samples/s (share of direct) | within {pct} of direct |",
             "|---|---|---|---|---|---|---|---|---|"]
    rows, verdicts, runs = [], [], []
    # a later invocation may supersede a cell's earlier runs (the code it measured changed)
    gone: dict[int, tuple[int, str]] = {}
    for k, m in enumerate(parts, 1):
        for cell in (m.get("supersedes") or {}).get("cells", []):
            gone[cell] = (k, m["supersedes"]["why"])
    for k, m in enumerate(parts, 1):
        # a verdict only where the invocation's direct runs agree within the margin
        f = m["direct_figures"]
        resolved = f["samples_per_s_spread"] is None or f["samples_per_s_spread"] <= f["within"]
        for r in m["rows"]:
            rows.append(r)
            runs.append(k)
            old = r["index"] in gone and k < gone[r["index"]][0]
            verdicts.append("-" if r.get("train_within") is None else
                            f"superseded ({gone[r['index']][1]})" if old else
                            f"unresolved (direct runs {f['samples_per_s_spread']:.0%} apart)"
                            if not resolved else "yes" if r["train_within"] else "no")
    # a cell run in several invocations: its rows together, each with its invocation
    order = sorted(range(len(rows)), key=lambda i: (rows[i]["index"], runs[i]))
    repeated = {rows[i]["index"] for i in order if sum(r["index"] == rows[i]["index"] for r in rows) > 1}
    for i in order:
        r, within = rows[i], verdicts[i]
        if r["index"] in repeated:
            r = dict(r, cell=f"{r['cell']} (invocation {runs[i]})")
        tr = [r.get("transports", {}).get(f"node{i}", {}).get("transport", "-") for i in (1, 2)]
        ok = f"yes ({r['steps']} steps)" if r["trained"] else \
            f"NO ({r.get('error') or 'exit ' + str(r.get('rc'))})"
        bw = r.get("allreduce", {}).get("busbw_Bps")
        bw_text = "-" if bw is None else f"{bw * 8 / 1e6:.1f} Mbit/s ({_fig(r.get('busbw_share'), '{:.2f}')})"
        t = r.get("train", {})
        t_text = (f"{t['samples_per_s']:.2f} ({_fig(r.get('train_share'), '{:.2f}')})"
                  if t.get("samples_per_s") is not None else t.get("status", "-"))
        pair = r.get("pair") or {}
        pair_text = "not recorded" if not pair else pair.get("route") or "-"
        lines.append(f"| {r['cell']} | {tr[0]} | {tr[1]} | {pair_text} | {ok} | "
                     f"{_matrix_negative(r.get('negative'))} "
                     f"| {bw_text} | {t_text} | {within} |")
    lines += ["", "| invocation (cells) | direct link | all-reduce bus bandwidth | auto, samples/s |",
              "|---|---|---|---|"]
    for k, m in enumerate(parts, 1):
        cells = f"{k} (" + ", ".join(str(r["index"]) for r in m["rows"]) + ")"
        for d in m["direct"]:
            bw = d.get("allreduce", {}).get("busbw_Bps")
            sps = d.get("train", {}).get("samples_per_s")
            lines.append(f"| {cells} | {d['when']} | {_fig(None if bw is None else bw * 8 / 1e6, '{:.1f} Mbit/s')} "
                         f"| {_fig(sps, '{:.2f}')} |")
        f = m["direct_figures"]
        lines.append(f"| {cells} | mean (spread) | {_fig(f['busbw_Bps_mean'] and f['busbw_Bps_mean'] * 8 / 1e6, '{:.1f} Mbit/s')} "
                     f"({_fig(f['busbw_spread'], '{:.0%}')}) | {_fig(f['samples_per_s_mean'], '{:.2f}')} "
                     f"({_fig(f['samples_per_s_spread'], '{:.0%}')}) |")
    trained = sum(m["trained"] for m in parts)
    # per cell: "no" if any resolved run missed, "yes" if every resolved run met it
    per_cell: dict[int, list[str]] = {}
    for r, v in zip(rows, verdicts):
        if v != "-" and not v.startswith("superseded"):
            per_cell.setdefault(r["index"], []).append(v.split(" ")[0])
    cell_verdict = ["no" if "no" in v else "yes" if "yes" in v else "unresolved"
                    for v in per_cell.values()]
    shares = [r["busbw_share"] for r, v in zip(rows, verdicts)
              if r.get("busbw_share") is not None and not v.startswith("superseded")]
    lines += ["", f"{trained} of {len(rows)} cell runs trained; auto within {pct} of the direct "
              f"link (a cell run in several invocations: every run with a verdict): "
              f"yes in {cell_verdict.count('yes')}, no in {cell_verdict.count('no')}, unresolved in "
              f"{cell_verdict.count('unresolved')} of {len(cell_verdict)} cells"
              + (f"; all-reduce share of the direct link {min(shares):.2f} to {max(shares):.2f}."
                 if shares else ".")]
    return "\n".join(lines)


def overlay_cpu(res: dict | None = None) -> str:
    """bench/overlay.py --parts cpu: wireguard-go's CPU seconds per MB through
    the overlay, Go's default threads against one, per link rate (median of
    the rounds, lowest-highest)."""
    from statistics import median

    res = res if res is not None else _load("overlay", "cpu.json")
    rows = res["rows"]
    lines = ["| link | Go threads (GOMAXPROCS) | CPU s per MB, 3 daemons (lowest-highest) | goodput | "
             "CPU s idle, per 10 s | one thread / default |", "|---|---|---|---|---|---|"]
    for rate in dict.fromkeys(r["rate"] for r in rows):
        meds = {}
        for g in sorted({r["gomaxprocs"] for r in rows if r["rate"] == rate}, reverse=True):
            rs = [r for r in rows if r["rate"] == rate and r["gomaxprocs"] == g]
            per = [r["cpu_s_per_mb"] for r in rs]
            meds[g] = median(per)
            ratio = f"{meds[g] / meds[max(meds)]:.2f}" if g == 1 and len(meds) > 1 else "-"
            lines.append(f"| {rate} | {g} | {meds[g]:.3f} ({min(per):.3f}-{max(per):.3f}) | "
                         f"{median(r['goodput_bps'] for r in rs) / 1e6:.1f} Mbit/s | "
                         f"{median(r['idle_cpu_s_per_10s'] for r in rs):.2f} | {ratio} |")
    return "\n".join(lines)


def encode_share(res: dict | None = None) -> str:
    """bench/encode_share.py: encode+decode of DiLoCo's outer syncs per sync,
    and as a share of each workload's GPU step at one sync a period."""
    res = res if res is not None else _load("encode", "cpu.json")
    dev = res["device"] + (f", {res['threads']} thread(s)" if res["device"] == "cpu" else "")
    lines = [f"| workload (GPU step) | outer sync | encode+decode on {dev}, ms a sync "
             "(lowest-highest) | share of a GPU step, one sync every "
             f"{res['period']} steps | within {100 * res['bar']:g}% |", "|---|---|---|---|---|"]
    for w in res["workloads"]:
        wl = w["workload"]
        for r in w["rows"]:
            lines.append(f"| {wl['name']} ({wl['gpu_step_s']:g} s; {w['adapter_values']:,} values) "
                         f"| {r['variant']} | {r['ms_per_sync']:.1f} ({r['min_ms']:.1f}-"
                         f"{r['max_ms']:.1f}) | {100 * r['share_of_step']:.2f}% | "
                         f"{'yes' if r['within_bar'] else '**no**'} |")
    return "\n".join(lines)


def _runs_sps(train: dict) -> list[float]:
    """The samples/s of every training run a matrix figure stands for."""
    runs = train.get("rounds") or [train]
    return [r["samples_per_s"] for r in runs if r.get("samples_per_s") is not None]


def matrix_share(cell: list[float], direct: list[float], within: float = 0.05) -> dict:
    """A cell's mean samples/s as a share of the direct link's mean, with two
    standard errors of that ratio (from both sets of runs), and the verdict:
    "yes" at or above 1 - ``within``; "no" where even the share plus two
    standard errors stays below it; else "unresolved"."""
    from statistics import fmean, stdev

    if not cell or not direct:
        return {"share": None, "two_se": None, "verdict": "-"}
    mc, md = fmean(cell), fmean(direct)
    rel = lambda xs, m: (stdev(xs) / m) ** 2 / len(xs) if len(xs) > 1 else 0.0  # noqa: E731
    share = mc / md
    two_se = 2 * share * (rel(cell, mc) + rel(direct, md)) ** 0.5
    verdict = ("yes" if share >= 1 - within else "no" if share + two_se < 1 - within
               else "unresolved")
    return {"share": share, "two_se": two_se, "verdict": verdict}


def connectivity_matrix_capped(m: dict | None = None) -> str:
    """bench/connectivity.py --parts matrix --rank-cores C --train-rounds N: the
    matrix with every training run's ranks held to C cores (the direct link's
    too), auto's speed as the mean of N runs per cell, its share of the direct
    link's mean with two standard errors, and the 5% verdict on that."""
    if m is None:
        m = _load("connectivity", "matrix-5-capped.json")
    from statistics import fmean

    from lorasync.units import fmt_rate, parse_rate_bps

    pct = m["direct_figures"]["within"]
    ar_rate, tr_rate = (fmt_rate(parse_rate_bps(m[k]), unit="bit") for k in ("allreduce_rate", "train_rate"))
    direct = [x for d in m["direct"] for x in _runs_sps(d.get("train", {}))]
    d_compute = [d["train"]["compute_s_mean"] for d in m["direct"] if d.get("train", {}).get("compute_s_mean")]
    cores = m["direct"][0].get("train", {}).get("rank_cores")
    lines = [f"Every training run's ranks held to {cores:g} of the host's cores (the direct link's "
             "too); the tunnels' processes ran on the rest. "
             f"auto on the embedded default at {tr_rate}: {len(_runs_sps(m['rows'][0].get('train', {})))} "
             f"runs per cell, {len(direct)} on the direct link (before and after the cells).", "",
             "| node1 / node2 | joins over (node1, node2) | node1 to node2 | trains (tiny, 3 ranks) | "
             f"negative control | all-reduce, 16 MB at {ar_rate} (share of direct) | auto, samples/s: "
             "mean (lowest-highest) | share of direct (± 2 SE) | compute s/step | "
             f"within {pct:.0%} of direct |", "|---|---|---|---|---|---|---|---|---|---|"]
    counts = {"yes": 0, "no": 0, "unresolved": 0}
    for r in m["rows"]:
        tr = ", ".join(r.get("transports", {}).get(f"node{i}", {}).get("transport", "-") for i in (1, 2))
        ok = f"yes ({r['steps']} steps)" if r["trained"] else f"NO ({r.get('error') or 'exit ' + str(r.get('rc'))})"
        bw = r.get("allreduce", {}).get("busbw_Bps")
        bw_text = "-" if bw is None else f"{bw * 8 / 1e6:.1f} Mbit/s ({_fig(r.get('busbw_share'), '{:.2f}')})"
        t = r.get("train", {})
        sps = _runs_sps(t)
        sh = matrix_share(sps, direct, pct)
        if sh["verdict"] in counts:
            counts[sh["verdict"]] += 1
        sps_text = (f"{fmean(sps):.2f} ({min(sps):.2f}-{max(sps):.2f})" if sps else t.get("status", "-"))
        sh_text = "-" if sh["share"] is None else f"{sh['share']:.2f} ± {sh['two_se']:.2f}"
        pair = (r.get("pair") or {}).get("route") or ("via node0 (SSH path)" if "ssh" in tr else "-")
        lines.append(f"| {r['cell']} | {tr} | {pair} | {ok} | {_matrix_negative(r.get('negative'))} | "
                     f"{bw_text} | {sps_text} | {sh_text} | {_fig(t.get('compute_s_mean'), '{:.2f}')} | "
                     f"{sh['verdict']} |")
    lines.append(f"| direct link | - | - | - | - | "
                 f"{_fig(m['direct_figures']['busbw_Bps_mean'] and m['direct_figures']['busbw_Bps_mean'] * 8 / 1e6, '{:.1f} Mbit/s')} | "
                 f"{fmean(direct):.2f} ({min(direct):.2f}-{max(direct):.2f}) | 1 | "
                 f"{_fig(fmean(d_compute) if d_compute else None, '{:.2f}')} | - |")
    trained = sum(r["trained"] for r in m["rows"])
    lines += ["", f"{trained} of {len(m['rows'])} cells trained; auto within {pct:.0%} of the direct link: "
              f"yes in {counts['yes']}, no in {counts['no']}, unresolved (the margin within two standard "
              f"errors) in {counts['unresolved']} of {len(m['rows'])} cells."]
    return "\n".join(lines)


def _rate_key(prof: str) -> float:
    from lorasync.units import parse_rate_bps

    return parse_rate_bps(prof.split("+")[0].split("_")[0])


RENDERERS: dict[str, Callable[[], str]] = {
    "strategies": strategies,
    "headline": headline,
    "plan-accuracy": plan_accuracy,
    "quality": quality,
    "auto-cut": auto_cut,
    "scaling": scaling,
    "hf-exits": hf_exits,
    "trl": trl,
    "switch-bench": switch_bench,
    "switch-parity": switch_parity,
    "switch-ceilings": switch_ceilings,
    "switch-shares": switch_shares,
    "bytes-to-target": bytes_to_target,
    "long-link-probe": long_link_probe,
    "long-link-train": long_link_train,
    "long-link-rounds": long_link_rounds,
    "peers": lambda: _peers_table("peers-10mbit.json"),
    "peers-sweep": lambda: _peers_table("peers-sweep-10mbit.json"),
    "peers-torchft": lambda: _peers_table("peers-torchft-10mbit.json"),
    "peers-gpu-eq-10mbit": lambda: _peers_table("peers-gpu-eq-10mbit.json"),
    "peers-gpu-eq-1mbit": lambda: _peers_table("peers-gpu-eq-1mbit.json"),
    "peers-gpu-eq-10mbit-torchft": lambda: _peers_table("peers-gpu-eq-10mbit-torchft.json"),
    "connectivity": connectivity,
    "connectivity-matrix-targets": connectivity_matrix_targets,
    "connectivity-matrix-capped": connectivity_matrix_capped,
    "overlay-cpu": overlay_cpu,
    "encode-share": encode_share,
    "headline-gpu": headline_gpu,
    "headline-gpu-short": lambda: headline_gpu(notes_too=False),
    # the 7B-class workload (llama2-7b-r16-h100) at a GPU user's 1 Gbit/s
    "gpu-eq-llama7b-1gbit": lambda: gpu_eq_profile("1gbit", "gpu-eq-llama7b-1gbit"),
    # ... and at 100 and 10 Mbit/s (one invocation, both links)
    "gpu-eq-llama7b-100mbit": lambda: gpu_eq_profile("100mbit", "gpu-eq-llama7b-slow"),
    "gpu-eq-llama7b-10mbit": lambda: gpu_eq_profile("10mbit", "gpu-eq-llama7b-slow"),
}


def renderer(name: str) -> Callable[[], str] | None:
    if name in RENDERERS:
        return RENDERERS[name]
    if name.startswith("bench-"):
        return lambda: bench_profile(name[len("bench-"):])
    if name.startswith("gpu-eq-rounds-"):
        prof = name[len("gpu-eq-rounds-"):]
        return lambda: gpu_eq_profile(prof, f"gpu-eq-rounds-{prof.replace('+', '_')}")
    if name.startswith("gpu-eq-"):
        return lambda: gpu_eq_profile(name[len("gpu-eq-"):])
    return None


# --------------------------------------------------------------------------- files


def render(text: str, path: Path) -> str:
    def sub(m: re.Match) -> str:
        name = m.group("name")
        fn = renderer(name)
        if fn is None:
            raise SystemExit(f"{path.relative_to(ROOT)}: no renderer for table {name!r} "
                             f"(known: {', '.join(sorted(RENDERERS))}, bench-PROFILE)")
        try:
            body = fn()
        except Missing as exc:
            # no figures without their data: say so, and how the table gets filled
            body = (f"*No committed result yet: `{exc}` is missing. Run the command above, "
                    "keep its output with `python bench/reference.py DIR NAME`, then "
                    "`python bench/tables.py`.*")
        return m.group(1) + body.rstrip("\n") + "\n" + m.group(4)
    return MARK.sub(sub, text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="change nothing; exit 1 if a generated table differs from its data")
    a = ap.parse_args()
    stale = []
    for path in DOCS:
        old = path.read_text()
        new = render(old, path)
        if new != old:
            stale.append(path.relative_to(ROOT))
            if not a.check:
                path.write_text(new)
    if a.check and stale:
        print("stale generated tables in: " + ", ".join(map(str, stale))
              + " (run python bench/tables.py)", file=sys.stderr)
        return 1
    print(("up to date: " if a.check else "rewritten: " if stale else "unchanged: ")
          + (", ".join(map(str, stale)) if stale and not a.check else f"{len(DOCS)} files"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
