"""Parsing and printing of rates, durations, sizes and counts (pure, no I/O).

The one place for the units every command accepts, so that ``--rate 100mbit``
means the same to ``plan``, ``tune``, ``doctor``, ``cluster`` and ``bench``
(the emulated cluster's tc ranges are arguments of these parsers, not parsers
of their own):

* rates (:func:`parse_rate_bps` -> bits/s, :func:`parse_rate_Bps` -> bytes/s):

  - bits: tc's ``bit kbit mbit gbit tbit`` and ``kibit mibit gibit tibit``
    (prefix in any case, ``/s`` optional: ``100Mbit/s``), and ``Kb/s Mb/s
    Gb/s Tb/s`` / ``Kbps Mbps Gbps Tbps`` with a *capital* prefix;
  - bytes: a capital ``B`` with ``/s`` or ``ps``: ``12.5MB/s``, ``1MiB/s``,
    ``125MBps``;
  - refused as ambiguous: a lower-case ``b`` after a lower-case or no prefix,
    ``mbps kbps gbps bps mb/s kb/s b/s``: tc reads ``mbps`` as megaBYTES/s,
    most people mean megabits; the error says to write ``100mbit`` or
    ``12.5MB/s``;
  - prefixes are decimal (k/K, m/M, g/G, t/T: ``m`` is mega, as in tc),
    ``Ki Mi Gi Ti`` binary; a bare number is refused unless the caller passes
    ``bare_bits=True`` (tc's convention, bits/s: ``cluster``).
* durations (:func:`parse_duration` -> seconds): ``30ms``, ``0.03s``,
  ``200us``, ``1min``, ``2h`` (unit in any case); a bare number is refused
  unless the caller names its unit with ``bare="s"`` or ``bare="ms"``
  (``cluster``'s delay keeps tc's bare milliseconds).
* sizes (:func:`parse_size` -> bytes): ``4MiB``, ``3.7MB``, ``64K``, ``65536``; prefixes
  are decimal and ``Ki Mi Gi Ti`` binary, as for rates (``4M`` is 4,000,000 bytes,
  ``4MiB`` 4,194,304).
* counts: ``921600``, ``921_600``, ``0.92M``, ``7B``-style suffixes k/M/G.
* shares (:func:`parse_fraction`): ``0.1%``, ``1%`` (packet loss).
* network addresses (:func:`parse_hostport` -> (host, port)): ``10.0.0.1:29400``,
  ``[fd00::1]:29400``, ``node0:1``; the port is optional where the caller
  gives a default (``host``, ``[fd00::1]``, and an IPv6 address without
  brackets, which cannot carry a port).

Every parser raises ``lorasync.errors.ConfigError(field, value, fix)``.

Printing: :func:`fmt_rate` is the one rate formatter (bits, bytes, both, or
tc's own spelling that the parsers read back); :func:`fmt_bytes` (decimal or
binary), :func:`fmt_duration` and :func:`fmt_count` the others.  Nothing else
in lorasync parses or prints these units.
"""

from __future__ import annotations

import math
import re

from lorasync.errors import ConfigError

__all__ = [
    "parse_rate_bps", "parse_rate_Bps", "parse_duration", "parse_size", "parse_count",
    "parse_fraction", "parse_hostport", "fmt_rate", "fmt_bytes", "fmt_duration", "fmt_count", "RATE_STYLES",
]

_NUM = r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"
_DEC = {"": 1.0, "k": 1e3, "K": 1e3, "m": 1e6, "M": 1e6, "g": 1e9, "G": 1e9, "t": 1e12, "T": 1e12}
_BIN = {"Ki": 1024.0, "Mi": 1024.0**2, "Gi": 1024.0**3, "Ti": 1024.0**4}

_RATE_FIX = "write a number and a unit, e.g. 10mbit, 1gbit, 100Mbit/s or 12.5MB/s"


def _split(text, field: str, fix: str) -> tuple[float, str]:
    s = text if isinstance(text, str) else str(text)
    m = re.fullmatch(r"\s*" + _NUM + r"\s*([A-Za-zµ/]*)\s*", s)
    if not m:
        raise ConfigError(field, text, fix)
    value = float(m.group(1))
    if not math.isfinite(value):
        raise ConfigError(field, text, fix)
    return value, m.group(2)


def _prefix_scale(prefix: str) -> float | None:
    if len(prefix) == 2 and prefix[1] in "iI":          # kibit, MiB/s: binary
        return _BIN.get(prefix[0].upper() + "i")
    return _DEC.get(prefix)


def _num(value: float) -> str:
    return f"{value:g}"


def _rate_bits(text, field: str, bare_bits: bool) -> float:
    """The one rate rule; returns bits per second."""
    if isinstance(text, bool):
        raise ConfigError(field, text, _RATE_FIX)
    if isinstance(text, (int, float)):
        if not bare_bits:
            raise ConfigError(field, text, "give a unit: " + _RATE_FIX)
        value, unit = float(text), ""
    else:
        value, unit = _split(text, field, _RATE_FIX)
    per_s = unit.endswith("/s")
    u = unit[:-2] if per_s else unit
    if not u:
        if per_s or not bare_bits:
            raise ConfigError(field, text, f"give a unit: {_num(value)}mbit for megabits/s, "
                              f"{_num(value)}MB/s for megabytes/s")
        bits, prefix = True, ""
    elif u.lower().endswith("bits"):                    # 10Mbits/s
        bits, prefix = True, u[:-4]
    elif u.lower().endswith("bit"):                     # 10mbit, 100Mbit/s, 1Gibit
        bits, prefix = True, u[:-3]
    elif u.endswith("Bps") or (per_s and u.endswith("B")):   # 12.5MB/s, 125MBps, 1MiB/s
        bits, prefix = False, u[:-3] if u.endswith("Bps") else u[:-1]
    elif u.endswith("bps") or (per_s and u.endswith("b")):   # Mbps, Gb/s; mbps is ambiguous
        bits, prefix = True, u[:-3] if u.endswith("bps") else u[:-1]
        if not prefix[:1].isupper():
            p = prefix.lower()
            mbit = f"{_num(value)}{p}bit"
            mbyte = f"{_num(value)}{p[:1].upper()}{p[1:]}B/s"
            scale = _prefix_scale(p) or 1.0
            as_bytes = _compact_Bps(value * scale / 8)
            raise ConfigError(field, text,
                              f"'{unit}' is ambiguous (tc reads it as bytes/s, most people mean "
                              f"bits/s): write {mbit} for bits/s (= {as_bytes}) or {mbyte} for "
                              f"bytes/s")
    else:
        raise ConfigError(field, text, "unknown unit " + repr(unit) + "; " + _RATE_FIX)
    scale = _prefix_scale(prefix)
    if scale is None:
        raise ConfigError(field, text, "unknown prefix " + repr(prefix) + "; " + _RATE_FIX)
    rate = value * scale * (1.0 if bits else 8.0)
    if rate <= 0:
        raise ConfigError(field, text, "a rate must be > 0, e.g. 10mbit")
    return rate


def _compact_Bps(Bps: float) -> str:
    """Bytes/s in the spelling the parsers take, exactly: ``12.5MB/s``."""
    for unit, scale in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if Bps >= scale:
            return f"{Bps / scale:g}{unit}"
    return f"{Bps:g}B/s"


def parse_rate_bps(text, field: str = "rate", *, bare_bits: bool = False,
                   within_bps: tuple[float, float] | None = None) -> float:
    """A link rate -> BITS per second (``"100mbit"`` -> 1e8).

    ``bare_bits``: a bare number (``"8000"``, or an int/float) is bits/s, as
    in tc; otherwise a unit is required.  ``within_bps``: the range the
    caller can use, inclusive (tc/htb shapes 8kbit..100gbit).
    """
    rate = _rate_bits(text, field, bare_bits)
    if within_bps is not None and not within_bps[0] <= rate <= within_bps[1]:
        lo, hi = (fmt_rate(x, "tc", unit="bit") for x in within_bps)
        raise ConfigError(field, text, f"must be between {lo} and {hi}")
    return rate


def parse_rate_Bps(text, field: str = "rate", *, bare_bits: bool = False) -> float:
    """A link rate -> BYTES per second (``"100mbit"`` -> 1.25e7); same rules as
    :func:`parse_rate_bps`."""
    return _rate_bits(text, field, bare_bits) / 8.0


_TIME = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9,
         "min": 60.0, "h": 3600.0}
_DURATION_FIX = "write a number and a unit, e.g. 30ms, 0.03s or 200us"


def parse_duration(text, field: str = "time", bare_seconds: bool = False,
                   allow_zero: bool = True, *, bare: str | None = None,
                   maximum_s: float | None = None) -> float:
    """A duration -> seconds.

    A bare number (or an int/float) is refused unless the caller says what it
    is: ``bare="s"`` (or the older ``bare_seconds=True``) or ``bare="ms"``
    (tc's convention).  Negative durations are refused, zero unless
    ``allow_zero``, and more than ``maximum_s``.
    """
    if bare_seconds:
        bare = bare or "s"
    if bare is not None and bare not in _TIME:
        raise ValueError(f"bare={bare!r}: not a time unit")
    if isinstance(text, bool):
        raise ConfigError(field, text, _DURATION_FIX)
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
        if not math.isfinite(value):
            raise ConfigError(field, text, _DURATION_FIX)
    else:
        value, unit = _split(text, field, _DURATION_FIX)
    if not unit:
        if bare is None:
            raise ConfigError(field, text, f"give a unit: {_num(value)}ms or {_num(value)}s")
        seconds = value * _TIME[bare]
    else:
        u = unit if unit in _TIME else unit.lower()
        if u not in _TIME:
            raise ConfigError(field, text, "unknown unit " + repr(unit) + "; " + _DURATION_FIX)
        seconds = value * _TIME[u]
    if seconds < 0 or (seconds == 0 and not allow_zero):
        raise ConfigError(field, text, "must be > 0" if not allow_zero else "must be >= 0")
    if maximum_s is not None and seconds > maximum_s:
        raise ConfigError(field, text, f"must be between 0 and {maximum_s:g}s")
    return seconds


def parse_fraction(text, field: str = "share", *, below: float = 1.0) -> float:
    """A share written as a percentage (``"0.1%"`` -> 0.001; ``"0"`` is none),
    or, from code, an int/float that is the share itself; at least 0 and
    below ``below``."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        s = str(text).strip()
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)%", s)
        if m:
            value = float(m.group(1)) / 100
        elif re.fullmatch(r"0*\.?0*", s) and s:
            value = 0.0
        else:
            raise ConfigError(field, text, "write a percentage such as 0.1% or 1%")
    if not 0 <= value < below:
        raise ConfigError(field, text, f"must be at least 0% and below {below * 100:g}%")
    return value


def parse_size(text, field: str = "size", *, minimum: int = 1) -> int:
    """A size -> whole bytes: ``4MiB``, ``3.7MB``, ``64K``, ``512k``, ``65536``.

    Prefixes as for rates: ``k/K M G T`` decimal, ``Ki Mi Gi Ti`` binary; a
    trailing ``B`` is optional (``4M`` = ``4MB`` = 4,000,000).  Below
    ``minimum`` bytes is refused.
    """
    fix = "write bytes with an optional unit, e.g. 4MiB, 3.7MB, 64K or 65536"
    if isinstance(text, bool):
        raise ConfigError(field, text, fix)
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        value, unit = _split(text, field, fix)
    u = unit[:-1] if unit.endswith("B") else unit
    scale = _prefix_scale(u) if u else 1.0
    if scale is None:
        raise ConfigError(field, text, fix)
    size = int(round(value * scale))
    if size < minimum:
        raise ConfigError(field, text, f"must be at least {minimum} bytes" if minimum > 1
                          else fix)
    return size


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


def parse_hostport(text, field: str = "address", *, default_port: int | None = None,
                   example: str = "10.0.0.1:29400 or [fd00::1]:29400") -> tuple[str, int]:
    """``"10.0.0.1:29400"``, ``"[fd00::1]:29400"``, ``"node0:1"`` -> (host, port).

    An IPv6 address with a port is written in brackets; without them, text
    with more than one colon is an IPv6 address and names no port.  Text that
    names no port gets ``default_port``; with ``default_port=None`` a port is
    required.  A port is 1-65535 in ASCII digits; a host has no white space
    and none of ``[]/``.  ``example`` is what the fix of an error shows.
    """
    form = "HOST:PORT" if default_port is None else "HOST[:PORT]"
    bad_form = ConfigError(field, text, f"give {form}, e.g. {example}")
    s = str(text).strip()
    port: str | None = None
    if s.startswith("["):
        host, closed, rest = s[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            raise bad_form
        port = rest[1:] if rest else None
    elif s.count(":") == 1:
        host, port = s.split(":")
    else:
        host = s
    if not host or any(c.isspace() or c in "[]/" for c in host):
        raise bad_form
    if port is None:
        if default_port is None:
            raise bad_form
        return host, default_port
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ConfigError(field, text, "the port must be a number between 1 and 65535, "
                          f"e.g. {example}")
    return host, int(port)


#: spellings :func:`fmt_rate` prints
RATE_STYLES = ("bits", "bytes", "both", "tc")


def fmt_rate(rate: float | None, style: str = "bits", *, unit: str = "B") -> str:
    """A rate, in bytes/s (``unit="B"``) or bits/s (``unit="bit"``), printed in
    one of ``RATE_STYLES``:

    * ``bits``: a network rate, ``10 Mbit/s`` (3 significant digits);
    * ``bytes``: ``1.25 MB/s``;
    * ``both``: ``1.25 MB/s (10 Mbit/s)``;
    * ``tc``: tc's spelling that :func:`parse_rate_bps` reads back, ``10mbit``
      (exact to 1/1000 of the unit, else 3 decimals).

    ``None`` (unknown, unshaped) prints as ``-``, in the tc style ``unshaped``.
    """
    if style not in RATE_STYLES:
        raise ValueError(f"style: {style!r} is not one of {', '.join(RATE_STYLES)}")
    if unit not in ("B", "bit"):
        raise ValueError(f"unit: {unit!r} is not B or bit")
    if rate is None:
        return "unshaped" if style == "tc" else "-"
    bytes_per_s = rate / 8 if unit == "bit" else rate
    bits = bytes_per_s * 8
    if style == "tc":
        for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
            if bits >= scale:
                v = bits / scale
                return f"{v:g}{unit}" if abs(v - round(v, 3)) < 1e-9 else f"{v:.3f}{unit}"
        return f"{int(bits)}bit"
    if style == "bytes":
        for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
            if bytes_per_s >= scale:
                return f"{bytes_per_s / scale:.3g} {unit}"
        return f"{bytes_per_s:.3g} B/s"
    if style == "both":
        return f"{bytes_per_s / 1e6:.3g} MB/s ({fmt_rate(bytes_per_s)})"
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.3g} {unit}"
    return f"{bits:.3g} bit/s"


def fmt_bytes(n: float, *, binary: bool = False) -> str:
    """A size, 3 significant digits: decimal (``3.69 MB``, what wire and
    payload figures use) or ``binary`` (``4 MiB``, what buffer and message
    sizes are given in)."""
    units = ((("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)) if binary
             else (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)))
    for unit, scale in units:
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_duration(s: float | None) -> str:
    """``1.5 s``, ``12 ms``, ``250 us`` (3 significant digits); None (not
    measured) prints as ``-``."""
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    if s > 0:
        return f"{s * 1e6:.3g} us"
    return "0"


def fmt_count(n: int) -> str:
    return f"{n:,}"
