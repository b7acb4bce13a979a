"""Parsing and printing of rates, durations, sizes and counts (pure, no I/O).

One place for the units the planner accepts, so that ``--rate 10mbit`` means
the same everywhere:

* rates: ``10mbit``, ``1gbit``, ``100Mbit/s``, ``1Gbps``, ``12.5MB/s``,
  ``1MiB/s``.  ``bit`` and ``bps`` (with a capital or ``k`` prefix) are bits,
  ``B`` is bytes; prefixes are decimal (k, M, G, T), ``Ki``/``Mi``/``Gi`` are
  binary.  Lower-case ``mbps``/``gbps`` are refused: ``tc`` reads them as
  *bytes* per second and most people mean bits, so the user must say which.
* durations: ``30ms``, ``0.03s``, ``200us``, ``1min``; a bare number is
  refused for latencies (``--rtt 30`` is almost always a mistake).
* sizes: ``4MiB``, ``3.7MB``, ``65536``.
* counts: ``921600``, ``921_600``, ``0.92M``, ``7B``-style suffixes k/M/G.

Every parser raises ``lorasync.errors.ConfigError`` naming the field.
"""

from __future__ import annotations

import math
import re

from lorasync.errors import ConfigError

__all__ = [
    "parse_rate", "parse_duration", "parse_size", "parse_count",
    "fmt_rate", "fmt_bytes", "fmt_duration", "fmt_count",
]

_NUM = r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"
_DEC = {"": 1.0, "k": 1e3, "K": 1e3, "m": 1e6, "M": 1e6, "g": 1e9, "G": 1e9, "t": 1e12, "T": 1e12}
_BIN = {"Ki": 1024.0, "Mi": 1024.0**2, "Gi": 1024.0**3, "Ti": 1024.0**4}

_RATE_FIX = "write a number and a unit, e.g. 10mbit, 1gbit, 100Mbit/s, 1Gbps or 12.5MB/s"


def _split(text: str, field: str, fix: str) -> tuple[float, str]:
    if not isinstance(text, str):
        text = str(text)
    m = re.fullmatch(r"\s*" + _NUM + r"\s*([A-Za-zµ/]*)\s*", text)
    if not m:
        raise ConfigError(field, text, fix)
    value = float(m.group(1))
    if not math.isfinite(value):
        raise ConfigError(field, text, fix)
    return value, m.group(2)


def parse_rate(text: str, field: str = "rate") -> float:
    """A link rate -> bytes per second."""
    value, unit = _split(text, field, _RATE_FIX)
    u = unit[:-2] if unit.endswith("/s") else unit
    if not u:
        raise ConfigError(field, text, "give a unit: " + _RATE_FIX)
    bits: bool
    if u.lower().endswith("bit"):                       # 10mbit, 100Mbit/s, 1Gibit
        bits, prefix = True, u[:-3]
    elif u.endswith("bps") and u[:-3] in ("", "k", "K", "M", "G", "T"):   # 1Gbps (bits)
        bits, prefix = True, u[:-3]
    elif u.endswith("bps"):                             # mbps / gbps: tc says bytes
        raise ConfigError(field, text, "ambiguous (tc reads 'mbps' as bytes/s): write "
                          "10mbit or 10Mbit/s for bits, 1.25MB/s for bytes")
    elif u.endswith("Bps") or u.endswith("B"):          # 12.5MB/s, 12.5MBps, 1MiB/s
        bits, prefix = False, u[:-3] if u.endswith("Bps") else u[:-1]
    else:
        raise ConfigError(field, text, _RATE_FIX)
    scale = _BIN.get(prefix) or _BIN.get(prefix[:1].upper() + prefix[1:]) or _DEC.get(prefix)
    if scale is None:
        raise ConfigError(field, text, "unknown prefix " + repr(prefix) + "; " + _RATE_FIX)
    bps = value * scale / (8.0 if bits else 1.0)
    if bps <= 0:
        raise ConfigError(field, text, "a rate must be > 0")
    return bps


_TIME = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9,
         "min": 60.0, "h": 3600.0}


def parse_duration(text, field: str = "time", bare_seconds: bool = False,
                   allow_zero: bool = True) -> float:
    """A duration -> seconds.  A bare number is seconds only if ``bare_seconds``."""
    fix = "write a number and a unit, e.g. 30ms, 0.03s or 200us"
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        value, unit = _split(text, field, fix)
    if not unit:
        if not bare_seconds:
            raise ConfigError(field, text, "give a unit: " + fix)
        seconds = value
    elif unit in _TIME:
        seconds = value * _TIME[unit]
    else:
        raise ConfigError(field, text, fix)
    if seconds < 0 or (seconds == 0 and not allow_zero):
        raise ConfigError(field, text, "must be > 0" if not allow_zero else "must be >= 0")
    return seconds


def parse_size(text, field: str = "size") -> float:
    """A size in bytes: ``4MiB``, ``3.7MB``, ``512k``, ``65536``."""
    fix = "write bytes with an optional unit, e.g. 4MiB, 3.7MB or 65536"
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        value, unit = _split(text, field, fix)
    u = unit[:-1] if unit.endswith("B") else unit
    scale = _BIN.get(u) or _DEC.get(u)
    if scale is None or value <= 0:
        raise ConfigError(field, text, fix)
    return value * scale


def parse_count(text, field: str = "count") -> int:
    """A positive integer count: ``921600``, ``921_600``, ``0.92M``, ``7B`` (billions)."""
    fix = "write a positive whole number, e.g. 921600 or 0.92M"
    if isinstance(text, int) and not isinstance(text, bool):
        value = float(text)
    else:
        s = str(text).replace("_", "").replace(",", "").strip()
        mult = {"k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "B": 1e9}.get(s[-1:], None)
        if mult is not None:
            s = s[:-1]
        try:
            value = float(s) * (mult or 1.0)
        except ValueError:
            raise ConfigError(field, text, fix) from None
    if not math.isfinite(value) or value < 1:
        raise ConfigError(field, text, fix)
    return int(round(value))


def fmt_rate(bytes_per_s: float) -> str:
    """Bytes/s as a network rate in bits: '10 Mbit/s'."""
    bits = bytes_per_s * 8
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.3g} {unit}"
    return f"{bits:.3g} bit/s"


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_duration(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    if s > 0:
        return f"{s * 1e6:.3g} us"
    return "0"


def fmt_count(n: int) -> str:
    return f"{n:,}"
