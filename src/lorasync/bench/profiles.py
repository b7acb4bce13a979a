"""Link profiles of the benches: ``RATE[+DELAY]`` as given to ``--profiles``.

Owns reading a ``--profiles`` list into emulated-link specs, the round-trip
time of a profile's one-way delay, and time dilation (a link slowed by the
compute slowdown of a larger emulated cluster, or the compute and sync
size of a target workload).
"""

from __future__ import annotations

from lorasync.errors import ConfigError
from lorasync.units import parse_duration, parse_rate_bps

__all__ = ["parse_profiles", "round_trip", "dilate", "rate_bps", "delay_s"]


def parse_profiles(text: str) -> list[tuple[str, str]]:
    """'10mbit,100mbit+20ms' -> [(label, emulate spec tail)]."""
    out = []
    for item in [t.strip() for t in text.split(",") if t.strip()]:
        rate, _, delay = item.partition("+")
        spec = f"rate={rate}" + (f",delay={delay}" if delay else "")
        out.append((item, spec))
    if not out:
        raise ConfigError("--profiles", text, "give at least one profile, e.g. 10mbit")
    return out


def round_trip(delay: str) -> str:
    """One-way delay of the emulated link -> round-trip time."""
    return f"{2 * delay_s(delay) * 1000:g}ms"


def dilate(rate: str, delay: str, s: float, delay_mul: float | None = None) -> tuple[str, str]:
    """``rate`` / s and ``delay`` x s (x ``delay_mul`` where given: a workload's
    links scale rate and delay apart, lorasync.bench.workloads), as --emulate values."""
    r = max(8000, int(rate_bps(rate) / s))
    m = s if delay_mul is None else delay_mul
    d = f"{delay_s(delay) * m * 1000:.3f}ms" if delay else ""
    return f"{r}bit", d


def rate_bps(rate: str) -> float:
    """A profile's rate, read as ``--emulate`` reads it (a bare number is bits/s, as in tc)."""
    return parse_rate_bps(rate, "rate", bare_bits=True)


def delay_s(delay: str) -> float:
    """A profile's one-way delay, read as ``--emulate`` reads it (a bare number is ms, as in tc)."""
    return parse_duration(delay, "delay", bare="ms")
