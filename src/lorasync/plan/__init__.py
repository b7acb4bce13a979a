"""Planning: a pure cost model of gradient sync, a planner that ranks the
strategies for a network, and the policy ``auto`` re-plans with while training.

    from lorasync.plan import Net, Workload, predict, choose, Measurements
    net = Net(alpha_s=1e-3, bandwidth_Bps=1.25e6, world_size=2)     # 10 Mbit/s
    wl = Workload(adapter_params=921_600, compute_s=1.25, batch_size=4)
    predict("fp16", net, wl).efficiency
    choose(Measurements(net, wl)).strategy

Strategy names, options and byte formulas come from :mod:`lorasync.catalog`;
the strategy that runs the policy is :mod:`lorasync.comm.auto`.  Nothing here
imports torch or does I/O (the CLI reads files).
"""

from lorasync.plan.costmodel import MODELS, Net, Prediction, Workload, lora_matrices, predict
from lorasync.plan.advice import Plan, Step, plan
from lorasync.plan.net import Link, net_from_probe, what_if_net
from lorasync.plan.ranking import Measurements, Recommendation, choose, rank

__all__ = [
    "MODELS", "Net", "Workload", "Prediction", "predict", "lora_matrices",
    "Link", "Measurements", "Recommendation", "Step", "Plan",
    "rank", "choose", "plan", "what_if_net", "net_from_probe",
]
