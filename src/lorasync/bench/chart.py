"""The chart of the progressive bench: scaling efficiency of every row on every link.

Owns drawing a results.json's cells (by profile) as horizontal bars, with
matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

__all__ = ["efficiency_chart"]


def efficiency_chart(results: dict, path: str) -> None:
    """Bars of every row's scaling efficiency, one colour per link profile, as a PNG
    at ``path``; ``results``: the progressive bench's cells by profile."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    profiles = list(results)
    # rows by key (labels name the compressor picked, which differs by link)
    keys: dict[str, str] = {}
    for prof in profiles:
        for c in results[prof]:
            k = c.get("key") or c["row"]
            if k in ("ceiling", "ceiling_end", "RDMA"):
                continue  # the reference itself (100% by definition) and a status line
            if k not in keys:
                keys[k] = c["row"] if k not in ("best", "overlap") else \
                    c["row"].split(" (")[0] + (" (1 MB buckets)" if k == "overlap" else "")
    labels = list(keys.values())
    fig = Figure(figsize=(11, 0.6 + 0.45 * len(labels) * len(profiles) / 2 + 2))
    ax = fig.subplots()
    h = 0.8 / len(profiles)
    for i, prof in enumerate(profiles):
        by = {(c.get("key") or c["row"]): c for c in results[prof]}
        vals = [(by.get(k) or {}).get("efficiency") or 0 for k in keys]
        ax.barh([j + i * h for j in range(len(labels))], [100 * v for v in vals], height=h,
                label=prof)
    ax.set_yticks([j + 0.4 - h / 2 for j in range(len(labels))], labels)
    ax.invert_yaxis()
    ax.set_xlabel("scaling efficiency (% of the fastest no-sync run of the bench)")
    ax.axvline(100, color="grey", lw=0.8, ls="--")
    ax.legend(title="link", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("lorasync bench: 2 emulated nodes, SmolLM2-135M + LoRA r=8")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
