"""Target workloads of the benches: the GPU job whose links an emulated link stands for.

A GPU node computes a LoRA step in a fraction of the time this CPU host
takes, and a large model's adapter is much larger than the embedded
default's.  A bench that emulates "100 Mbit/s" next to a CPU step therefore
measures a regime no GPU user has.  A *workload* names the job the bench
stands for: a model shape with its LoRA rank and targets (so the bytes of
one fp32 gradient sync of the adapter) and the step time of that job on a
GPU.  The bench then emulates, for a user link of rate R and one-way delay
D, the link that gives this host's run the same bytes per second of
compute and the same overlap windows:

    rate here  = R x (bytes here / cpu step) / (workload bytes / gpu step)
    delay here = D x (cpu step / gpu step)

The cpu step is measured in the same invocation (the no-sync ceiling).
What this keeps: the ratio of sync to compute at every step and at every
outer sync, the share of a step a streamed sync has to hide in, the number
of round trips per step against the compute.  What it does not: kernel
launch latency, PCIe copies, the GPU's encode speed (compression costs CPU
time here, not GPU time), and the TCP stack's behaviour at the real rate.

Presets (``PRESETS``):

* ``smollm2-h200``: the embedded default (SmolLM2-135M, LoRA r=8 on
  q/k/v/o, 921,600 values = 3.69 MB fp32) at 0.18 s a step on one H200,
  batch 4 x 64 tokens, fp32 and bf16 alike: measured with
  bench/gpu_check.py (its docstring, item 1; docs/benchmarks.md).
* ``llama2-7b-r16-h100``: Llama-2-7B with LoRA r=16 on every linear layer
  of the decoder (q/k/v/o/gate/up/down: 39,976,960 values = 160 MB fp32)
  at 0.65 s an optimizer step on an H100.  Taken from a published figure,
  not measured here: NVIDIA NeMo's performance summary (NeMo 24.07
  container, DGX-H100, FP8; docs/source/performance/performance_summary.md
  in github.com/NVIDIA/NeMo) gives LoRA fine-tuning of LLAMA2-7B at 25,206
  tokens/s per GPU on 8 GPUs, global batch 32, micro-batch 1, SQuAD packed
  to 4096 tokens: 32 x 4096 tokens a step over 8 GPUs = 16,384 tokens per
  GPU per step / 25,206 = 0.650 s.  NeMo's own LoRA there adapts fewer
  layers than r=16 all-linear; the frozen base's forward and backward
  dominate a LoRA step, so the step time is taken as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from lorasync.errors import ConfigError
from lorasync.plan.costmodel import MODELS, ModelShape, lora_matrices

__all__ = ["TargetWorkload", "PRESETS", "get_workload", "Dilation", "dilation"]

#: Llama-2-7B (meta-llama/Llama-2-7b-hf config.json: hidden 4096, 32 layers,
#: 32 heads, no grouped KV, intermediate 11008, vocabulary 32000)
LLAMA2_7B = ModelShape("llama-2-7b", 4096, 32, 32, 32, 128, 11008, 32000)
ALL_LINEAR = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass(frozen=True)
class TargetWorkload:
    """A GPU job a bench's links stand for: model shape, LoRA rank and
    targets, the step time on the GPU, and where that time comes from."""

    name: str
    description: str
    shape: ModelShape
    lora_r: int
    targets: tuple[str, ...]
    gpu_step_s: float
    source: str
    measured: bool   # False: a published figure, not measured by this project

    @property
    def adapter_params(self) -> int:
        """Trainable LoRA values (A and B of every target of every layer)."""
        return sum(r * c for r, c in lora_matrices(self.shape, self.lora_r, self.targets))

    @property
    def sync_bytes(self) -> int:
        """Bytes of one fp32 gradient of the adapter: what plain DDP all-reduces a step."""
        return 4 * self.adapter_params

    def as_dict(self) -> dict:
        return {"name": self.name, "description": self.description, "model": self.shape.name,
                "lora_r": self.lora_r, "targets": list(self.targets),
                "adapter_params": self.adapter_params, "sync_bytes": self.sync_bytes,
                "gpu_step_s": self.gpu_step_s, "source": self.source,
                "measured": self.measured}


PRESETS: dict[str, TargetWorkload] = {w.name: w for w in (
    TargetWorkload(
        "smollm2-h200", "the embedded default (SmolLM2-135M, LoRA r=8 q/k/v/o) on an H200",
        MODELS["smollm2-135m"], 8, ("q", "k", "v", "o"), 0.18,
        "measured: bench/gpu_check.py step, batch 4 x 64 tokens, one H200 (docs/benchmarks.md)",
        True),
    TargetWorkload(
        "llama2-7b-r16-h100", "Llama-2-7B, LoRA r=16 on all linear layers, on an H100",
        LLAMA2_7B, 16, ALL_LINEAR, 0.65,
        "published, not measured here: NVIDIA NeMo 24.07 performance summary, LLAMA2-7B LoRA "
        "on DGX-H100 (FP8), 25,206 tokens/s/GPU at global batch 32 x 4096 packed tokens on "
        "8 GPUs = 16,384 tokens per GPU per step = 0.65 s", False),
)}


def get_workload(name: str) -> TargetWorkload:
    """The preset ``name``; ConfigError naming the presets otherwise."""
    if name not in PRESETS:
        raise ConfigError("--workload", name, "use one of " + ", ".join(PRESETS))
    return PRESETS[name]


@dataclass(frozen=True)
class Dilation:
    """How a user's link is emulated on this host for a workload: the rate is
    divided by ``rate_div``, the one-way delay multiplied by ``delay_mul``."""

    workload: TargetWorkload
    cpu_step_s: float
    sync_bytes_here: int
    rate_div: float
    delay_mul: float

    def text(self) -> str:
        """One sentence for every table: the workload, the dilation and why."""
        w = self.workload
        return (f"workload {w.name} ({w.description}: {w.sync_bytes / 1e6:.1f} MB a sync "
                f"every {w.gpu_step_s:g} s, {'measured' if w.measured else 'published figure'})"
                f"; this host: {self.sync_bytes_here / 1e6:.2f} MB every "
                f"{self.cpu_step_s:.2f} s (no-sync step measured in this invocation); "
                f"each user link is emulated at rate / {self.rate_div:.1f} and delay x "
                f"{self.delay_mul:.1f}, so sync bytes per second of compute match the workload's")

    def as_dict(self) -> dict:
        return {"workload": self.workload.as_dict(), "cpu_step_s": self.cpu_step_s,
                "sync_bytes_here": self.sync_bytes_here, "rate_div": self.rate_div,
                "delay_mul": self.delay_mul, "text": self.text()}


def dilation(workload: TargetWorkload, cpu_step_s: float, adapter_params_here: int) -> Dilation:
    """The dilation of user links for ``workload`` on a host whose no-sync step
    takes ``cpu_step_s`` with an adapter of ``adapter_params_here`` values.

    Bytes per second of compute: here ``4 * adapter_params_here / cpu_step_s``,
    the workload's ``sync_bytes / gpu_step_s``; the emulated rate is the user's
    times here / workload (``rate_div`` = workload / here), and the delay grows
    with the compute ratio alone (``delay_mul`` = cpu step / gpu step), so a
    round trip takes the same share of a step as it would on the GPU.
    """
    if cpu_step_s <= 0 or adapter_params_here <= 0:
        raise ConfigError("no-sync step", f"{cpu_step_s} s, {adapter_params_here} values",
                          "the dilation needs a measured no-sync step and adapter size")
    here = 4 * adapter_params_here / cpu_step_s
    there = workload.sync_bytes / workload.gpu_step_s
    return Dilation(workload, cpu_step_s, 4 * adapter_params_here, there / here,
                    cpu_step_s / workload.gpu_step_s)
