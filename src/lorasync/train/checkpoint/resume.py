"""Which checkpoint a (re)started group resumes from, agreed by every rank.

Every rank lists what its own disk holds (``inventory``), the lists are
gathered, and the group takes the newest step that every rank with any
checkpoint holds and that some rank holds intact (``choose``).  A rank loads
its own state file when it verifies; a rank whose own file is damaged or
absent (a node that joins later, a node-local disk that was lost) and, after
a change of world size, every rank, takes the replicated state (adapter,
optimizer, schedule, data position) from the lowest rank that holds an
intact file.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lorasync.train.checkpoint.format import _rank_files, _steps, read_meta, verified

__all__ = ["inventory", "ResumePlan", "choose"]


def inventory(run_dir: str) -> dict[int, dict]:
    """What this disk holds: ``{step: {"world_size": n, "ranks": [intact rank files],
    "damaged": [rank files that exist but fail verification]}}`` for every complete
    checkpoint folder with at least one state file (intact or not: a rank whose own
    file is damaged still holds the step and may take a peer's state)."""
    out = {}
    for step, path in _steps(run_dir):
        try:
            world = int(read_meta(path)["world_size"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        ranks, damaged = [], []
        for r in _rank_files(path):
            (ranks if verified(path, r) else damaged).append(r)
        if ranks or damaged:
            out[step] = {"world_size": world, "ranks": ranks, "damaged": damaged}
    return out


@dataclass
class ResumePlan:
    """The agreed way a (re)started group continues; the same on every rank."""

    step: int = 0
    """Checkpoint step to resume from (0: start from the beginning)."""
    own: list = field(default_factory=list)
    """Ranks that load their own state file of that checkpoint."""
    peer: list = field(default_factory=list)
    """Ranks that take the replicated state from ``source`` (and start their
    rank-local state afresh)."""
    source: int | None = None
    """The lowest rank holding an intact file of the checkpoint; it sends the
    replicated state."""
    note: str = ""
    """Why, in words (shown on restart)."""


def _ranks_text(ranks) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def choose(held: list[dict[int, dict]], world: int) -> ResumePlan:
    """The checkpoint a group of ``world`` ranks resumes from, given each rank's
    ``inventory`` (``held[r]``, with string or int step keys).  Pure.

    The newest step that every rank with any checkpoint holds (its disk has
    the complete folder) and of which some rank holds an intact file: a
    checkpoint only some of them finalized (a crash while saving, on
    node-local disks) or of which no file verifies is never chosen.  A rank
    loads its own file when it verifies and the checkpoint was written by a
    group of the same size; every other rank (its own file damaged or not on
    its disk, or the group's size changed) takes the replicated state from
    the lowest rank that holds an intact file.
    """
    held = [{int(k): v for k, v in h.items()} for h in held]
    with_history = [r for r, h in enumerate(held) if h]
    if not with_history:
        return ResumePlan(note="no checkpoint on any rank")

    def holders(step: int) -> list[int]:
        return [r for r in with_history if held[r].get(step, {}).get("ranks")]

    common = set.intersection(*(set(held[r]) for r in with_history))
    usable = [s for s in common if holders(s)]
    if not usable:
        newest = {r: max(held[r]) for r in with_history}
        return ResumePlan(note=f"no checkpoint held by every rank with an intact file "
                               f"(newest per rank: "
                               f"{', '.join(f'rank {r}: step {s}' for r, s in newest.items())})")
    step = max(usable)
    own, peer = [], []
    for r in range(world):
        entry = held[r].get(step)
        if entry and entry["world_size"] == world and r in entry["ranks"]:
            own.append(r)
        else:
            peer.append(r)
    source = min(holders(step))
    why = f"step {step}, the newest checkpoint every rank with one holds"
    if peer:
        sizes = {held[r][step]["world_size"] for r in with_history}
        joined = [r for r in peer if not held[r]]
        damaged = [r for r in peer if held[r] and r in held[r][step].get("damaged", ())]
        absent = [r for r in peer if r not in joined and r not in damaged]
        if sizes != {world}:
            why += (f"; written by {'/'.join(map(str, sorted(sizes)))} ranks, now {world}: "
                    f"every rank takes rank {source}'s replicated state")
        else:
            if joined:
                why += f"; {_ranks_text(joined)} hold none and take rank {source}'s"
            if damaged:
                why += (f"; {_ranks_text(damaged)}: own file damaged (size or SHA-256 does not "
                        f"match its record), taking rank {source}'s replicated state")
            if absent:
                why += f"; {_ranks_text(absent)} take rank {source}'s state"
    return ResumePlan(step=step, own=own, peer=peer, source=source if peer else None,
                      note=why)
