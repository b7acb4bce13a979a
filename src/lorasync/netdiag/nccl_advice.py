"""``lorasync doctor --nccl``: NCCL_ALGO advice from the cost model.

NCCL picks its all-reduce algorithm (ring, tree) and protocol by its own
tuning model; lorasync can only advise.  The advice is the planner's
(:func:`lorasync.plan.advice.nccl_advice`): for the job's sync (fp32
all-reduce of the embedded default adapter, 1 MB buckets, unless told
otherwise) on the described link, Tree is advised only where the alpha-beta
model predicts it at least 1% faster than the ring, and the finding says
by how much.  NCCL_PROTO is never advised (the model has no protocol term).
"""

from __future__ import annotations

from lorasync.netdiag.doctor import Finding
from lorasync.units import fmt_duration, fmt_rate

__all__ = ["nccl_findings"]


def nccl_findings(*, nnodes: int, ranks_per_node: int, rate_bps: float, rtt_s: float,
                  compute_s: float = 1.25, strategy: str = "allreduce") -> list[Finding]:
    """One finding on NCCL_ALGO for ``nnodes`` x ``ranks_per_node`` GPUs on a
    link of ``rate_bps`` bits/s and ``rtt_s`` round trip."""
    from lorasync.plan.costmodel import MODELS, MiB, Workload, head_share, lora_matrices
    from lorasync.plan.advice import nccl_advice
    from lorasync.plan.net import RDMA_ALPHA_S, what_if_net

    n = max(1, nnodes) * max(1, ranks_per_node)
    if n < 2:
        return [Finding("nccl-algo", "ok", "one GPU: no all-reduce to tune")]
    shape = MODELS["smollm2-135m"]
    mats = lora_matrices(shape)
    wl = Workload(adapter_params=sum(a * b for a, b in mats), compute_s=compute_s,
                  head_share=head_share(shape), bucket_bytes=1 * MiB, matrices=mats)
    net = what_if_net(n, rate_bps / 8, rtt_s)
    # NCCL over RDMA where the host has it; the latency per message is NCCL's
    net = net.__class__(**{**net.__dict__, "alpha_s": max(RDMA_ALPHA_S, net.alpha_s)})
    step = nccl_advice(net, wl, strategy)
    if step is None:
        return []
    where = (f"{nnodes} node(s) x {ranks_per_node} GPU(s), {fmt_rate(rate_bps, unit='bit')}, "
             f"RTT {fmt_duration(rtt_s)}")
    gain = f"{100 * step.gain:+.1f}% predicted" if step.gain is not None else "gain unknown"
    if step.worthwhile:
        return [Finding("nccl-algo", "info", f"{where}: tree all-reduce {gain} over the ring",
                        "the ring's 2(n-1) steps each pay the link's latency; a tree pays "
                        "2 log2(n)", f"export NCCL_ALGO=Tree  # {step.detail}")]
    return [Finding("nccl-algo", "ok", f"{where}: ring and tree within 1% ({gain}): leave "
                    "NCCL_ALGO unset", step.detail)]
