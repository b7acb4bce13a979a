"""One rank's step records: built, streamed, shown.

``StepLog`` is the trainer's metrics component.  It turns what a step
measured, and the growth of the strategy's cumulative counters
(``sync.stats()``), into the record of docs/contracts.md; appends it to
``RUN/ranks/rank{R}.jsonl``; hands it to the live sinks (TensorBoard,
W&B, MLflow, Prometheus); and, on rank 0, moves the progress bar.
"""

from __future__ import annotations

import sys
import time

__all__ = ["StepLog"]


class StepLog:
    """Records of one rank; ``close()`` in ``finally``."""

    def __init__(self, run_dir: str, *, rank: int, world: int, strategy: str, run_cfg, store):
        from lorasync.monitor.metrics import RankStream
        from lorasync.monitor.sinks import open_sinks

        self.rank, self.world, self.strategy = rank, world, strategy
        self.stream = RankStream(run_dir, rank)
        self.sinks = open_sinks(run_dir, rank=rank, world_size=world,
                                report_to=run_cfg.report_to,
                                metrics_port=run_cfg.metrics_port,
                                metrics_host=run_cfg.metrics_host, store=store)
        self.bar = None
        self._ema_sps: float | None = None
        self._last: dict | None = None  # the strategy's counters after the previous step

    @property
    def records(self) -> list[dict]:
        """This rank's whole stream: every attempt's step and event records."""
        return self.stream.records

    def start(self, sync, *, start_step: int, total_steps: int, progress: bool) -> None:
        """Right before the first step: counters from now on, and rank 0's progress bar."""
        if self.rank == 0 and progress:
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                            dynamic_ncols=True, file=sys.stderr)
        self._last = sync.stats()

    def record(self, *, step: int, stats: dict, loss: float, lr: float, samples: int,
               tokens: int, grad_accum: int, step_s: float, hook_wait_s: float,
               data_s: float, grad_norm: float | None = None) -> dict:
        """The record of ``step``.  ``stats`` is ``sync.stats()`` after the step;
        ``hook_wait_s`` the time backward waited after the last bucket was ready."""
        last = self._last
        # what the backward pass could not see: waits inside after_step (periodic
        # sync) and inside hooks before the last bucket was ready (two-phase)
        exposed = hook_wait_s + stats["comm_s"] - last["comm_s"]
        rec = {"step": step, "rank": self.rank, "world_size": self.world,
               "strategy": stats.get("strategy", self.strategy),
               "loss": loss, "lr": lr, "grad_norm": grad_norm,
               "samples": samples, "tokens": tokens, "grad_accum": grad_accum,
               "compute_s": max(0.0, step_s - exposed - data_s), "comm_s": exposed,
               "step_s": step_s,
               "wire_bytes": stats["wire_bytes"] - last["wire_bytes"],
               "intra_bytes": stats["intra_bytes"] - last["intra_bytes"],
               "inter_bytes": stats["inter_bytes"] - last["inter_bytes"],
               "fp32_bytes": stats["fp32_bytes"] - last["fp32_bytes"],
               "encode_s": stats["encode_s"] - last["encode_s"],
               "time": time.time()}
        if stats.get("switches", 0) != last.get("switches", 0):
            rec["switch"] = stats.get("last_switch")  # {"from", "to", "reason"} (auto)
        if stats.get("probes", 0) != last.get("probes", 0):
            rec["probes"] = stats["probes"]   # auto timed the link during this step
        self._last = stats
        return rec

    def write(self, rec: dict) -> None:
        self.stream.write(rec)
        self.sinks.write(rec)
        if self.bar is not None:
            sps = self.world * rec["samples"] / rec["step_s"]
            self._ema_sps = sps if self._ema_sps is None else 0.8 * self._ema_sps + 0.2 * sps
            self.bar.set_postfix_str(f"loss {rec['loss']:.3f} | {self._ema_sps:.2f} samples/s | "
                                     f"sync {100 * rec['comm_s'] / rec['step_s']:.0f}% | "
                                     f"{rec['strategy']}", refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.stream.close()
        self.sinks.close()

