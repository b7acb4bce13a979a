"""The run summary rank 0 writes at the end (``summary.json``) and prints.

``summarize`` sets the run's settings and its evaluations before and after
beside the steady-state figures of every rank's step records
(:func:`lorasync.monitor.metrics.steady_state`); ``format_summary`` turns
them into the table printed at the end of ``lorasync train``.
"""

from __future__ import annotations

import math
import os

from lorasync.monitor.metrics import FIRST_STEP, KEEP_ALL, steady_state

__all__ = ["summarize", "format_summary"]


def summarize(per_rank, cfg, world, n_adapter, startup_bytes, eval_before, eval_after) -> dict:
    # the first step holds DDP's bucket rebuild and the allocator's warm-up;
    # a one-step run is still measured
    st = steady_state(per_rank, leave_out=FIRST_STEP, when_none_left=KEEP_ALL)
    return {
        "world_size": world, "strategy": cfg.comm.strategy, "model": cfg.model.name,
        "adapter_params": n_adapter, "steps": st.steps, "startup_broadcast_bytes": startup_bytes,
        **st.figures(),
        "eval_before": eval_before, "eval_after": eval_after,
    }


def _em(e) -> str:
    if not e or not e.get("n"):
        return "n/a"
    p = e["correct"] / e["n"]
    se = math.sqrt(p * (1 - p) / e["n"])
    return f"{100 * p:.1f}% +- {100 * se:.1f} ({e['correct']}/{e['n']})"


def format_summary(s: dict, run_dir: str) -> str:
    eb, ea = s["eval_before"], s["eval_after"]
    rows = [
        ("ranks x strategy", f"{s['world_size']} x {s['strategy']}"),
        ("adapter parameters", f"{s['adapter_params']:,}"),
        ("eval exact-match before", _em(eb)),
        ("eval exact-match after", _em(ea)),
        ("eval loss before -> after",
         f"{eb['eval_loss']:.4f} -> {ea['eval_loss']:.4f}" if eb and ea else "n/a"),
        ("train loss (last step)", f"{s['final_loss']:.4f}"),
        ("samples/s (all ranks)", f"{s['samples_per_s']:.2f}"),
        ("step time median", f"{s['step_s_median']:.3f} s"),
        ("compute vs sync per step",
         f"{s['compute_s_mean']:.3f} s vs {s['comm_s_mean']:.3f} s "
         f"({100 * s['sync_share']:.1f}% waiting on sync)"),
        ("sent per step per rank",
         f"{s['wire_bytes_per_step'] / 1e6:.3f} MB (fp32 all-reduce: "
         f"{s['fp32_bytes_per_step'] / 1e6:.3f} MB)"),
        ("start-up broadcast", f"{s['startup_broadcast_bytes'] / 1e6:.2f} MB" + (
            " (adapter only)" if s["startup_broadcast_bytes"] > 16 else
            " (adapters identical on every rank: hash checked, nothing broadcast)")),
    ]
    peaks = [p for p in s.get("peak_mem_bytes") or [] if p]
    if peaks:
        from lorasync.units import fmt_bytes

        what = "GPU allocated" if s.get("peak_mem_kind") == "cuda_allocated" else "resident"
        rows.append((f"peak memory per rank ({what})", ", ".join(fmt_bytes(p, binary=True)
                                                                for p in peaks)))
    f = s.get("faults") or {}
    if f.get("faults") or f.get("joins"):
        lost = f.get("time_lost_s") or 0.0
        joins = f", {f['joins']} node join(s)" if f.get("joins") else ""
        rows.append(("faults survived", f"{f['faults']} ({f['restarts']} automatic restart(s)"
                     f"{joins}), {f['steps_redone']} step(s) redone, {lost:.1f} s lost"))
    w = max(len(k) for k, _ in rows)
    lines = [f"\nlorasync run summary ({run_dir})", "-" * (w + 40)]
    lines += [f"{k.ljust(w)}  {v}" for k, v in rows]
    lines += ["-" * (w + 40),
              f"adapter: {os.path.join(run_dir, 'adapter')}   metrics: "
              f"{os.path.join(run_dir, 'metrics.jsonl')}"]
    return "\n".join(lines)
