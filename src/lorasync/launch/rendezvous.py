"""Bounds on torchrun's rendezvous, and a verdict that names who did not come.

torch's c10d rendezvous waits ``join_timeout`` (600 s by default) in every
round for the nodes it needs, then raises a bare ``RendezvousTimeoutError``.
The first round waits for nodes started by hand, so it keeps that bound;
every round after it is the group coming back after a failure (each agent
stops its workers, SIGKILL after 30 s, and joins), so it gets
``RESTART_JOIN_S``.  A round that times out raises ``RendezvousStalled``:
one line naming the nodes that came and the ones that did not (a node whose
agent never left the round before: stuck stopping a worker that does not
end), exit code 75 as a worker's verdict.  Installed by the lorasync
launchers (:func:`lorasync.launch.run_torchrun` across nodes, and
:mod:`lorasync.launch.agent`).
"""

from __future__ import annotations

import time
from datetime import timedelta

from lorasync.errors import LorasyncError

__all__ = ["RESTART_JOIN_S", "RendezvousStalled", "install_rendezvous_bound",
           "rendezvous_verdict"]

#: seconds the nodes of a group get to join a rendezvous round after the first
#: (coming back after a failure: each agent stops its workers, SIGKILL after 30 s,
#: and joins).  The first round keeps torch's join timeout (600 s, or
#: ``--rdzv-conf join_timeout=S``): it waits for nodes started by hand.
RESTART_JOIN_S = 120.0

#: torch's default join timeout: a handler with another one was configured by the user
_TORCH_JOIN_S = 600.0


class RendezvousStalled(LorasyncError):
    """A rendezvous round did not complete within its bound; the message names
    the nodes that did not come.  Exit code 75, as a worker's verdict."""

    exit_code = 75  # EXIT_FAULT (launch/torchrun.py), not imported: it imports this module


def install_rendezvous_bound(label: str, restart_join_s: float = RESTART_JOIN_S) -> None:
    """Bound every rendezvous round after the first at ``restart_join_s``
    (unless the user set ``join_timeout``), and turn torch's bare
    ``RendezvousTimeoutError`` into ``RendezvousStalled`` naming the nodes
    that did not come.  Once per process."""
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    inner = DynamicRendezvousHandler.next_rendezvous
    if getattr(inner, "_lorasync_bound", False):
        return

    def next_rendezvous(self):
        before = getattr(self, "_lorasync_round", None)
        timeout = self._settings.timeout
        if before is not None and timeout.join.total_seconds() == _TORCH_JOIN_S:
            timeout._join = timedelta(seconds=restart_join_s)  # no setter; read at each round
        t0 = time.monotonic()
        try:
            info = inner(self)
        except RendezvousTimeoutError as exc:
            raise RendezvousStalled(rendezvous_verdict(
                self, label, time.monotonic() - t0, before)) from exc
        self._lorasync_round = sorted(self._state_holder.state.participants)
        return info

    next_rendezvous._lorasync_bound = True
    DynamicRendezvousHandler.next_rendezvous = next_rendezvous


def rendezvous_verdict(handler, label: str, waited_s: float, before: list | None) -> str:
    """One line: the round that timed out, who came, who did not."""
    st, settings, me = handler._state_holder.state, handler._settings, handler._this_node

    def names(nodes) -> str:
        return ", ".join(f"{n.addr} (agent pid {n.pid})" + (" [this node]" if n == me else "")
                         for n in sorted(nodes))

    bound = (f"{settings.timeout.join.total_seconds():g} s for "
             + ("a round after a failure" if before is not None else "the first round"))
    head = (f"{label}: the rendezvous {settings.run_id!r} timed out after {waited_s:.0f} s "
            f"(bound {bound})")
    if st.complete:
        # the round before still stands: a node in it never left to join the next
        waiting = set(st.wait_list) | {me}
        what = (f"{names(waiting)} waited for the next round, but {names(st.participants)} "
                "never left the round before (its agent is stuck, e.g. stopping a worker that "
                "does not end)")
    else:
        came = set(st.participants) | set(st.wait_list) | {me}
        what = f"{len(came)} of the {settings.min_nodes} node(s) it needs came ({names(came)})"
        gone = [n for n in before or [] if n not in came]
        if gone:
            what += f"; not back from the round before: {names(gone)}"
        elif before is None:
            what += (f"; {settings.min_nodes - len(came)} node(s) never joined (are they "
                     "started with the same --rdzv-endpoint, and can they reach it?)")
    return (f"{head}: {what}; the group cannot go on: start the missing node(s) again, then "
            "resume with `lorasync train --resume`")
