"""Restarts: what a (re)started worker group knows about the attempts before it.

A run is a sequence of *attempts*: the first start, every ``--resume`` and
every restart after a failure (torchrun ``--max-restarts``).  Each rank's
stream ``RUN/ranks/rank{R}.jsonl`` keeps them all (it is never truncated):
an attempt begins with a ``start`` event, may end with an ``end`` event
(finished, or stopped by ``--stop-after``) and, when it failed, carries the
``fault`` events of the ranks that detected the failure.

From these, at start-up, every rank tells the group (one gather, together
with its checkpoint inventory: ``Checkpointer.agree``) the last attempt's
number, whether it ended cleanly, the last step it reached and its fault
events; the new attempt is numbered after the highest, and is a *recovery*
when the attempt before it did not end cleanly.  A recovery's first step
record carries a ``restart`` field: steps redone (reached before the failure,
after the checkpoint resumed from) and time lost (from the end of the
checkpointed step in the failed attempt to the start of the first new step:
the work thrown away, the detection, the restart and the reload).
``fault_summary`` counts all of it for summary.json.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["Attempt", "classify", "history", "resume_point_time", "next_action",
           "fault_summary", "describe_faults"]


@dataclass
class Attempt:
    """This start of the run, as the group sees it (the same on every rank but
    ``steps_redone`` and ``resume_point_time``, which are this rank's)."""

    number: int = 1
    """1 + the highest attempt any rank's stream holds."""
    cause: str = "new"
    """new, resume (the attempt before ended cleanly) or recover (it failed)."""
    reason: str = ""
    """The failure in words (a recovery), from the fault events recorded."""
    membership: str | None = None
    """grew / shrank when the world size differs from the attempt before."""
    reached: int = 0
    """The last step any rank reached before."""
    steps_redone: int = 0
    """This rank's steps after the checkpoint resumed from that ran before."""
    resume_point_time: float | None = None
    """When this rank's failed history reached the checkpoint resumed from."""
    restart_count: int = 0
    """torchrun's restarts of this group so far."""

    def describe(self, resumed_from: int, world: int) -> str:
        """One line for the log, for a recovery."""
        how = (f"restart {self.restart_count} of "
               f"{os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}" if self.restart_count
               else "resumed by hand")
        what = "after a failure" if self.membership != "grew" else "for a new node"
        return (f"lorasync: recovering ({how}) {what} at step {self.reached}: {self.reason}; "
                "resuming from " + (f"checkpoint step {resumed_from}" if resumed_from else
                                    "the start (no checkpoint every rank holds)")
                + f", {max(0, self.reached - resumed_from)} step(s) to redo, {world} rank(s)")


def classify(histories: list[dict], mine: dict, *, resumed_from: int, world: int,
             restart_count: int, run_dir: str, rank: int) -> Attempt:
    """Number this attempt and say why it runs, from every rank's ``history``."""
    hs = [h for h in histories if h.get("records")]
    a = Attempt(number=1 + max((h["attempt"] for h in histories), default=0),
                restart_count=restart_count)
    if not hs:
        return a
    a.cause = "recover" if restart_count > 0 or any(not h.get("clean") for h in hs) \
        else "resume"
    before = max((h.get("world_size") or 0 for h in hs), default=0)
    if before and before != world:
        a.membership = "grew" if world > before else "shrank"
    a.reached = max((h["last_step"] for h in hs), default=0)
    if a.cause != "recover":
        return a
    a.reason = describe_faults([f for h in hs for f in h.get("faults", [])])
    if a.membership == "grew":
        # torchrun restarts a running group when a node joins: not a failure
        a.reason = (f"a node joined: {before} -> {world} ranks (torchrun restarts the group "
                    "to take it in)")
    elif a.membership == "shrank":
        a.reason += f"; going on with {world} of {before} ranks"
    if mine.get("records"):
        a.steps_redone = max(0, mine["last_step"] - resumed_from)
        a.resume_point_time = resume_point_time(run_dir, rank, resumed_from)
    return a


def _stream(run_dir: str, rank: int) -> list[dict]:
    from lorasync.monitor.metrics import read_jsonl_records

    return read_jsonl_records(os.path.join(run_dir, "ranks", f"rank{rank}.jsonl"))


def history(run_dir: str, rank: int) -> dict:
    """What this rank's stream says about the latest attempt before this one."""
    from lorasync.monitor.metrics import attempts

    recs = _stream(run_dir, rank)
    if not recs:
        return {"attempt": 0, "records": False}
    parts = attempts(recs)
    start, body = parts[-1]
    steps = [r for r in body if "event" not in r]
    top = max((int(s.get("attempt", 0)) for s, _ in parts if s), default=0)
    return {"attempt": top, "records": True,
            "clean": bool(body) and body[-1].get("event") == "end",
            "last_step": max((r["step"] for r in steps), default=start.get("resumed_from", 0)
                             if start else 0),
            "faults": [r for r in body if r.get("event") == "fault"],
            "spawn": start.get("spawn") if start else None,
            "world_size": start.get("world_size") if start else None}


def resume_point_time(run_dir: str, rank: int, step: int) -> float | None:
    """When the failed history reached ``step`` (the end of that step's record in
    the latest attempt that ran it; the start of that attempt for step 0)."""
    from lorasync.monitor.metrics import attempts

    for start, body in reversed(attempts(_stream(run_dir, rank))):
        for r in reversed(body):
            if "event" not in r and r["step"] == step:
                return r.get("time")
        if start is not None and int(start.get("resumed_from", 0)) == step:
            return start.get("ready") or start.get("time")
    return None


def next_action(run_dir: str) -> tuple[str, str]:
    """What happens after a failure, from torchrun's restart counters: (word, sentence)."""
    e = os.environ
    used, most = int(e.get("TORCHELASTIC_RESTART_COUNT", 0)), int(e.get("TORCHELASTIC_MAX_RESTARTS", 0))
    if used < most:
        s = (f"restarting the group, which resumes from the newest checkpoint every rank "
             f"holds (restart {used + 1} of {most})")
        nnodes, nodes = e.get("LORASYNC_NNODES", ""), int(e.get("GROUP_WORLD_SIZE", 1))
        lo = nnodes.split(":")[0] if ":" in nnodes else ""
        if lo.isdigit() and int(lo) < nodes:
            s += (f"; a node that does not come back in time is left out and the others "
                  f"continue without it (--nnodes {nnodes})")
        return "restart", s
    return "give up", (f"no restarts left ({most} used): giving up; continue later with "
                       f"`lorasync train --resume --output-dir {run_dir}`")


def describe_faults(faults: list[dict]) -> str:
    """The previous attempt's failure in one phrase, from its fault events."""
    if not faults:
        return "a worker exited or was killed without a verdict"
    first = min(faults, key=lambda f: f.get("time") or 0)
    if first.get("what"):
        return f"rank {first.get('rank')} at step {first.get('step')}: {first['what']}"
    return first.get("message", "").removeprefix("lorasync: ")


def fault_summary(per_rank: list[list[dict]]) -> dict:
    """Faults, restarts, steps redone and time lost over a run's whole history
    (every rank's full stream); per attempt the worst rank counts.  Steps redone
    and time lost include the restarts that took in a joining node."""
    from lorasync.monitor.metrics import attempts

    by_attempt: dict[int, dict] = {}
    detections: dict[int, list[dict]] = {}
    for recs in per_rank:
        for start, body in attempts(recs):
            faults = [r for r in body if r.get("event") == "fault"]
            if faults and start is not None:
                detections.setdefault(int(start.get("attempt", 0)), []).extend(faults)
            if start is None or start.get("cause") != "recover":
                continue
            a = by_attempt.setdefault(int(start.get("attempt", 0)), {
                "attempt": int(start.get("attempt", 0)), "from_step": start.get("resumed_from"),
                "world_size": start.get("world_size"), "joined": start.get("membership") == "grew",
                "restarted": False, "steps_redone": 0, "lost_s": None,
                "reason": start.get("reason", "")})
            a["restarted"] |= int(start.get("restart_count", 0)) > 0
            a["steps_redone"] = max(a["steps_redone"], int(start.get("steps_redone") or 0))
            first = next((r for r in body if "event" not in r), None)
            t0 = start.get("resume_point_time")
            if first is not None and t0 is not None:
                lost = first["time"] - first["step_s"] - t0
                a["lost_s"] = lost if a["lost_s"] is None else max(a["lost_s"], lost)
    recov = [by_attempt[k] for k in sorted(by_attempt)]
    return {
        # a node joining restarts the group too (torchrun), but it is no failure
        "faults": sum(1 for a in recov if not a["joined"]),
        "joins": sum(1 for a in recov if a["joined"]),
        "restarts": sum(1 for a in recov if a["restarted"]),
        "steps_redone": sum(a["steps_redone"] for a in recov),
        "time_lost_s": sum(a["lost_s"] or 0.0 for a in recov),
        "detected": sum(1 for k in detections if detections[k]),
        "recoveries": recov,
    }
