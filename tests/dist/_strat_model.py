"""Tiny LoRA-shaped model and regression data for the strategy tests.

Built identically on every rank from a seed: a frozen input projection, a few
frozen base Linear layers each with a trainable rank-r adapter (lora_A r x d,
lora_B d x r, B zero-initialised like PEFT), and a frozen head weight with a
trainable bias (a 1-D trainable parameter).  Inputs are (batch, length, d_in)
and are mean-pooled over length, so batch size and length can vary per rank
and per step.  Targets come from a teacher of the same shape whose adapters
are random, so the task is realisable and the loss can go to ~0.
"""

from __future__ import annotations

import time

import torch
from torch import nn

D_IN, D, R, LAYERS = 8, 32, 4, 3


class LoRALinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, r: int):
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.lora_A = nn.Parameter(torch.randn(r, d_in) / d_in ** 0.5)
        self.lora_B = nn.Parameter(torch.zeros(d_out, r))
        self.base.requires_grad_(False)

    def forward(self, x):
        return self.base(x) + (x @ self.lora_A.T) @ self.lora_B.T


class _Jitter(torch.autograd.Function):
    """Identity that sleeps in backward: makes buckets become ready at
    different times on different ranks (the timing that breaks hooks which
    issue collectives from future callbacks)."""

    @staticmethod
    def forward(ctx, x, delay):
        ctx.delay = delay
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.delay)
        return g, None


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.jitter_s: list[float] | None = None  # per-block backward delays
        self.inp = nn.Linear(D_IN, D)
        self.inp.requires_grad_(False)
        self.blocks = nn.ModuleList(LoRALinear(D, D, R) for _ in range(LAYERS))
        self.head = nn.Linear(D, 1)
        self.head.weight.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for i, b in enumerate(self.blocks):
            if self.jitter_s is not None:
                h = _Jitter.apply(h, self.jitter_s[i])
            h = h + torch.tanh(b(h))
        return self.head(h.mean(1)).squeeze(-1)


def build(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


def teacher(seed: int = 0) -> Tiny:
    t = build(seed)
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for b in t.blocks:
            b.lora_B.copy_(torch.randn(b.lora_B.shape, generator=g) * 0.5)
    return t.requires_grad_(False)


def batch(step: int, rank: int, variable: bool, teach: Tiny):
    """Deterministic batch for (step, rank); variable=True changes its shape."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    if variable:
        b = int(torch.randint(1, 9, (1,), generator=g))
        length = int(torch.randint(1, 12, (1,), generator=g))
    else:
        b, length = 8, 6
    x = torch.randn(b, length, D_IN, generator=g)
    with torch.no_grad():
        y = teach(x)
    return x, y


def jitter(step: int, rank: int) -> list[float]:
    """Backward delays (0-3 ms per block) for (step, rank)."""
    g = torch.Generator().manual_seed(77_000 * step + rank)
    return [float(d) for d in torch.rand(LAYERS, generator=g) * 0.003]


def eval_set(teach: Tiny, n: int = 256):
    g = torch.Generator().manual_seed(999)
    x = torch.randn(n, 6, D_IN, generator=g)
    with torch.no_grad():
        return x, teach(x)
