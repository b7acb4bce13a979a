"""How bench results read as text: a profile's markdown table and the verdicts under it.

Owns the format of a number in a cell, the table of the progressive 2-node
bench and that of the N x G topology bench, and the verdict lines of each:
every target of the bench with its number, and how close the cost model
came to the measured step times.  Pure: cells (the dicts the benches save
in results.json) in, text out.
"""

from __future__ import annotations

__all__ = ["fmt_number", "progressive_table", "progressive_verdicts", "topology_table",
           "topology_verdicts", "median_range", "fmt_spread", "gap_verdict",
           "peer_share_verdict"]

#: rows of fixed lorasync strategies in the progressive bench (auto is compared
#: with the best of them)
FIXED_ROWS = ("ddp", "tcp", "fp16", "best", "overlap", "periodic")
#: the cost model's target: predicted step time within this share of the measured one
PLAN_TOLERANCE = 0.15


def fmt_number(v, digits=2, pct=False) -> str:
    """A cell's number: ``digits`` decimals, or a whole percentage; ``-`` for None."""
    if v is None:
        return "-"
    return f"{100 * v:.0f}%" if pct else f"{v:.{digits}f}"


def median_range(values) -> dict | None:
    """A figure over interleaved rounds: median, lowest, highest and how many
    rounds gave it (None where none did)."""
    import statistics

    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals),
            "n": len(vals)}


def fmt_spread(fig: dict | None, fmt: str) -> str:
    """'median (min-max)' of a :func:`median_range` figure; the value alone for one round."""
    if fig is None:
        return "-"
    if fig["n"] == 1:
        return fmt.format(fig["median"])
    return f"{fmt.format(fig['median'])} ({fmt.format(fig['min'])}-{fmt.format(fig['max'])})"


def gap_verdict(a: dict, b: dict, higher_is_better: bool) -> str:
    """``a`` against ``b`` (:func:`median_range` figures): "ahead" or "behind"
    by more than the spread only where every round of one beats every round
    of the other; with one round of either there is no spread to beat."""
    if a["n"] < 2 or b["n"] < 2:
        return "one round: no spread measured, no verdict"
    lo_a, hi_a, lo_b, hi_b = a["min"], a["max"], b["min"], b["max"]
    if not higher_is_better:
        lo_a, hi_a, lo_b, hi_b = -hi_a, -lo_a, -hi_b, -lo_b
    if lo_a > hi_b:
        return "ahead by more than the spread"
    if hi_a < lo_b:
        return "behind by more than the spread"
    return "within the spread"


def _figure(cell: dict, name: str) -> dict | None:
    """A cell's figure as a :func:`median_range` (one round: its value, n = 1)."""
    fig = (cell.get("spread") or {}).get(name)
    if fig is None and cell.get(name) is not None:
        v = cell[name]
        fig = {"median": v, "min": v, "max": v, "n": 1}
    return fig


def _first_sync(key: str) -> int | None:
    """The step at which a peer row's first sync is applied (``localsgd_K``:
    K; a torchft row: sync_every / fragments, its first fragment's step)."""
    from lorasync.bench.peers import LOCALSGD_PREFIX, torchft_row

    try:
        ft = torchft_row(key)
    except ValueError:   # a key this version does not read: no sync rule
        return None
    if ft is not None:
        return int(ft[1]["sync_every"]) // int(ft[1].get("fragments", 1))
    k = key[len(LOCALSGD_PREFIX):] if key.startswith(LOCALSGD_PREFIX) else ""
    return int(k) if k.isdigit() else None


def never_synced(c: dict) -> bool:
    """A periodic peer row stopped (capped) before its first sync: its share is
    of training without any sync, not a figure for the peer on the link."""
    first = _first_sync(c.get("key") or "")
    return bool(first and c.get("capped_steps") and c["capped_steps"] < first)


def peer_share_verdict(cells: list[dict]) -> list[str]:
    """auto against the best peer row (cells with ``peer`` set) by share of the
    no-sync ceiling, median over rounds, "ahead" only beyond the spread; a
    peer stopped before its first sync is left out, and said so."""
    raw = [c for c in cells if c.get("peer") and _figure(c, "efficiency")]
    unsynced = [c for c in raw if never_synced(c)]
    peers = [c for c in raw if c not in unsynced]
    auto = next((c for c in cells if c.get("key") == "auto" and _figure(c, "efficiency")), None)
    if auto is None:
        return []
    note = [f"{c['row']}: stopped after {c['capped_steps']} steps, before its first sync (at "
            f"step {_first_sync(c['key'])}): its share is of training without any sync, so it is not "
            "compared" for c in unsynced]
    if not peers:
        return note
    best = max(peers, key=lambda c: _figure(c, "efficiency")["median"])
    a, b = _figure(auto, "efficiency"), _figure(best, "efficiency")
    return note + [f"auto vs the best peer ({best['row']}): {a['median']:.0%} vs {b['median']:.0%} "
                   f"of the no-sync ceiling = {a['median'] / b['median']:.2f}x "
                   f"({gap_verdict(a, b, higher_is_better=True)}; {a['n']} and {b['n']} rounds)"]


def _plan_accuracy(errors: list[tuple[str, float]]) -> str:
    """'N/M rows within 15%, worst +E% (ROW)' for (row, measured / predicted - 1) pairs."""
    within = sum(abs(e) <= PLAN_TOLERANCE for _, e in errors)
    row, worst = max(errors, key=lambda x: abs(x[1]))
    return (f"{within}/{len(errors)} rows within {PLAN_TOLERANCE:.0%}, worst "
            f"{100 * worst:+.0f}% ({row})")


def progressive_table(title: str, cells: list[dict]) -> str:
    """A profile of the progressive bench: one line per row, under a ``###`` heading."""
    head = ("| row | samples/s | speedup vs DDP | scaling eff. | exposed sync | wire MB/step "
            "| s/step measured / planned | eval loss | exact-match |\n"
            "|---|---|---|---|---|---|---|---|---|")
    lines = [f"\n### {title}\n", head]
    for c in cells:
        if "samples_per_s" not in c:
            lines.append(f"| {c['row']} | {c['status']} | | | | | | | |")
            continue
        em = "-" if c["exact_match"] is None else \
            f"{100 * c['exact_match']:.0f}% (n={c['eval_n']})"
        label = c["row"] + (f" [{c['strategy']}]" if c["row"].startswith("+ best") else "")
        if c.get("capped_steps"):
            label += f" (capped: {c['capped_steps']} steps)"
        if c.get("rounds", 1) > 1 and c.get("rounds_ok") != c.get("rounds"):
            label += f" ({c['rounds_ok']}/{c['rounds']} rounds ran)"
        sp = c.get("spread") or {}
        plan = "-" if c.get("predicted_step_s") is None else (
            f"{c['measured_step_s']:.2f} / {c['predicted_step_s']:.2f} "
            f"({100 * c['plan_error']:+.0f}%)")
        sps = (fmt_spread(sp["samples_per_s"], "{:.2f}") if sp.get("samples_per_s")
               else fmt_number(c["samples_per_s"]))
        eff = (fmt_spread(sp["efficiency"], "{:.0%}") if sp.get("efficiency")
               else fmt_number(c["efficiency"], pct=True))
        lines.append(f"| {label} | {sps} | "
                     f"{fmt_number(c['speedup'])}x | {eff} | "
                     f"{fmt_number(c['sync_share'], pct=True)} | "
                     f"{fmt_number(c['wire_mb'], digits=3)} | "
                     f"{plan} | {fmt_number(c['eval_loss'], digits=3)} | {em} |")
    return "\n".join(lines)


def progressive_verdicts(cells: list[dict]) -> list[str]:
    """Lines under a profile's table: plan accuracy, auto vs the best fixed row."""
    out = []
    errs = [(c["row"], c["plan_error"]) for c in cells if c.get("plan_error") is not None
            and c.get("key") not in ("ceiling", "ceiling_end")]
    if errs:
        out.append(f"plan vs measured step time: {_plan_accuracy(errs)}")
    fixed = [c for c in cells if c.get("samples_per_s") and c.get("key") in FIXED_ROWS]
    auto = next((c for c in cells if c.get("key") == "auto" and c.get("samples_per_s")), None)
    if auto and fixed:
        best = max(fixed, key=lambda c: c["samples_per_s"])
        ref = best["samples_per_s"]
        pick = auto.get("final_strategy") or auto["strategy"]
        line = (f"auto ({pick} at the end): {auto['samples_per_s']:.2f} samples/s = "
                f"{100 * auto['samples_per_s'] / ref:.0f}% of the best fixed lorasync row "
                f"({best['row']}, {ref:.2f})")
        steady = auto.get("samples_per_s_after_switch")
        if steady:
            line += (f"; after its choice at step {auto['last_switch_step']} "
                     f"({auto['steps_after_switch']} steps): {steady:.2f} = "
                     f"{100 * steady / ref:.0f}%")
        out.append(line)
    return out


def topology_table(title: str, cells: list[dict], ceiling_sps: float | None) -> str:
    """A profile of the topology bench: one line per row, efficiency against
    ``ceiling_sps``, under a ``###`` heading."""
    lines = [f"\n### {title}\n",
             "| row | samples/s | eff. | sync s/step | inter-node MB/step/node | eth0 MB/step "
             "(all nodes, sync only) | s/step measured / planned |",
             "|---|---|---|---|---|---|---|"]
    for c in cells:
        if c.get("status") != "ok":
            lines.append(f"| {c['label']} | {c.get('status')} | | | | | |")
            continue
        eff = c["samples_per_s"] / ceiling_sps if ceiling_sps else None
        plan = "-" if c.get("predicted_step_s") is None else (
            f"{c['step_s']:.2f} / {c['predicted_step_s']:.2f} ({100 * c['plan_error']:+.0f}%)")
        label = c["label"] + (f" [{c['strategy_end']}]" if c["key"] == "auto" else "")
        lines.append(f"| {label} | {fmt_number(c['samples_per_s'])} | "
                     f"{fmt_number(eff, pct=True)} | {fmt_number(c['sync_s'], 3)} | "
                     f"{fmt_number(c['inter_bytes_per_node'] / 1e6, 3)} | "
                     f"{fmt_number(c.get('eth0_bytes_per_step', 0) / 1e6, 3)} | {plan} |")
    return "\n".join(lines)


def topology_verdicts(cells: dict[str, dict], ceiling_sps: float | None,
                      profile: str) -> list[str]:
    """The topology bench's targets, each with its number, for the cells of
    one profile by row key."""
    out = []

    def get(k, f):
        c = cells.get(k) or {}
        return c.get(f) if c.get("status") == "ok" else None

    if ceiling_sps:
        a = get("auto", "samples_per_s")
        if a:
            out.append(f"auto: {a / ceiling_sps:.0%} of the no-sync ceiling "
                       f"(target >= 90% on the 10 Mbit/s profile; ended on "
                       f"{cells['auto'].get('strategy_end')})")
    for s in ("topk", "int8"):
        f, h = get(f"{s}/flat", "inter_bytes_per_node"), get(f"{s}/node", "inter_bytes_per_node")
        fe, he = get(f"{s}/flat", "eth0_bytes_per_step"), get(f"{s}/node", "eth0_bytes_per_step")
        if f and h:
            out.append(f"{s}: flat/hierarchical inter-node payload per node {f / h:.2f}x, "
                       f"eth0 bytes {fe / he:.2f}x (target >= 2x)" if fe and he else
                       f"{s}: flat/hierarchical inter-node payload {f / h:.2f}x")
    f, h = get("diloco/flat", "sync_s"), get("diloco/node", "sync_s")
    ha = get("diloco/node+algo", "sync_s")
    hl = get("diloco/node+leaders", "sync_s")
    if f and h:
        line = (f"DiLoCo sync time per step: flat {f:.3f} s, hierarchical {h:.3f} s: "
                f"{f / h:.2f}x")
        if hl:
            line += f"; outer sync by the leaders {hl:.3f} s: {f / hl:.2f}x"
        if ha:
            line += f"; hierarchical with the algorithm per message {ha:.3f} s: {f / ha:.2f}x"
        out.append(line + " (target >= 1.5x on the +20 ms profile)")
    errs = [(k, c["plan_error"]) for k, c in cells.items() if c.get("plan_error") is not None]
    if errs:
        out.append(f"cost model vs measured step time: {_plan_accuracy(errs)}")
    return [f"{profile}: {line}" for line in out]
