"""The one table of rate and duration spellings (lorasync.units), and the
check that every command that takes a rate or a time reads it the same way:
``cluster`` (bits/s, tc's 8kbit..100gbit, bare numbers = bits and ms),
``tune``/``doctor`` (--rate/--rtt) and ``plan`` (bytes/s), each through the
one parser with its own range.  The callers' own tests check only their
ranges and conventions."""

from __future__ import annotations

import pytest

from lorasync.errors import ConfigError
from lorasync.emulate.spec import ClusterSpec
from lorasync.netdiag import tune
from lorasync.netdiag.hostinfo import HostInfo
from lorasync import units
from lorasync.units import parse_duration, parse_fraction, parse_rate_Bps, parse_rate_bps

# text -> bits per second
RATES = [
    ("100mbit", 1e8), ("100Mbit", 1e8), ("100MBIT", 1e8), ("100Mbit/s", 1e8), ("100Mbits/s", 1e8),
    ("100Mb/s", 1e8), ("100Mbps", 1e8), ("1Gbps", 1e9), ("1Gb/s", 1e9), ("10Kbps", 1e4),
    ("10gbit", 1e10), ("1.5gbit", 1.5e9), ("500kbit", 5e5), ("10kbit", 1e4), ("8000bit", 8000),
    ("1tbit", 1e12), ("100gbit", 1e11), ("1kibit", 1024), ("1mibit", 2**20), ("1Gibit", 2**30),
    ("12.5MB/s", 1e8), ("125MB/s", 1e9), ("125MBps", 1e9), ("1MiB/s", 8 * 2**20), ("10kB/s", 8e4),
    (" 2 gbit ", 2e9), ("20 mbit", 2e7), ("1e9bit", 1e9),
]

# text -> a piece of the fix; bare numbers are in BARE_RATES (cluster reads them as bits)
BAD_RATES = [
    ("100mbps", "ambiguous"), ("12.5mbps", "ambiguous"), ("100kbps", "ambiguous"),
    ("1gbps", "ambiguous"), ("100bps", "ambiguous"), ("100mb/s", "ambiguous"),
    ("100kb/s", "ambiguous"), ("mbit", "10mbit"), ("fast", "10mbit"), ("", "10mbit"),
    ("100 furlongs", "unit"), ("-5mbit", "10mbit"), ("0mbit", "> 0"), ("100m", "unit"),
    ("12.5MB", "unit"), ("1Xbit", "prefix"), ("100Mbit/h", "unit"),
]
BARE_RATES = ["100", "8000", "1e6"]

# text -> seconds
DURATIONS = [
    ("30ms", 0.03), ("0.03s", 0.03), ("200us", 2e-4), ("200µs", 2e-4), ("100ns", 1e-7),
    ("1sec", 1.0), ("1.5s", 1.5), ("1min", 60.0), ("2h", 7200.0), ("0ms", 0.0), ("20MS", 0.02),
    ("250 us", 250e-6), ("5s", 5.0),
]
BAD_DURATIONS = [("ms", "30ms"), ("20 parsecs", "unit"), ("-1ms", "30ms"), ("", "30ms"),
                 ("1 fortnight", "unit")]
BARE_DURATIONS = ["30", "0.5"]


# --------------------------------------------------------------------------- rates

@pytest.mark.parametrize("text, bps", RATES)
def test_rate_in_bits_and_bytes(text, bps):
    assert parse_rate_bps(text) == pytest.approx(bps)
    assert parse_rate_Bps(text) == pytest.approx(bps / 8)


@pytest.mark.parametrize("text, hint", BAD_RATES)
def test_rate_refused_names_field_value_and_fix(text, hint):
    for parse in (parse_rate_bps, parse_rate_Bps):
        with pytest.raises(ConfigError) as e:
            parse(text, "--rate")
        assert e.value.field == "--rate" and e.value.value == text and hint in e.value.fix
        assert str(e.value).startswith("--rate: ")


def test_mbps_fix_says_what_to_write():
    with pytest.raises(ConfigError) as e:
        parse_rate_bps("100mbps", "--rate")
    assert "100mbit" in e.value.fix and "12.5MB/s" in e.value.fix and "100MB/s" in e.value.fix
    with pytest.raises(ConfigError) as e:
        parse_rate_bps("1gbps")
    assert "1gbit" in e.value.fix and "125MB/s" in e.value.fix


@pytest.mark.parametrize("text", BARE_RATES + [8000, 1.5e6])
def test_bare_rate_needs_the_callers_word(text):
    with pytest.raises(ConfigError, match="unit"):
        parse_rate_bps(text)
    assert parse_rate_bps(text, bare_bits=True) == pytest.approx(float(text))
    assert parse_rate_Bps(text, bare_bits=True) == pytest.approx(float(text) / 8)


@pytest.mark.parametrize("text", ["100mbps", "100mb/s", "fast", True])
def test_bare_bits_does_not_loosen_anything_else(text):
    with pytest.raises(ConfigError):
        parse_rate_bps(text, bare_bits=True)


# --------------------------------------------------------------------------- durations

@pytest.mark.parametrize("text, s", DURATIONS)
def test_duration(text, s):
    assert parse_duration(text) == pytest.approx(s)


@pytest.mark.parametrize("text, hint", BAD_DURATIONS)
def test_duration_refused_names_field_value_and_fix(text, hint):
    with pytest.raises(ConfigError) as e:
        parse_duration(text, "--rtt")
    assert e.value.field == "--rtt" and e.value.value == text and hint in e.value.fix


@pytest.mark.parametrize("text", BARE_DURATIONS + [30, 0.5])
def test_bare_duration_needs_the_callers_unit(text):
    with pytest.raises(ConfigError) as e:
        parse_duration(text, "--rtt")
    assert "ms" in e.value.fix and "s" in e.value.fix
    assert parse_duration(text, bare="s") == pytest.approx(float(text))
    assert parse_duration(text, bare_seconds=True) == pytest.approx(float(text))
    assert parse_duration(text, bare="ms") == pytest.approx(float(text) / 1000)


def test_duration_zero_and_sign():
    assert parse_duration("1.25", "--compute-s", bare_seconds=True) == 1.25
    with pytest.raises(ConfigError, match="> 0"):
        parse_duration("0", "--compute-s", bare_seconds=True, allow_zero=False)
    with pytest.raises(ConfigError, match=">= 0"):
        parse_duration(-1.0, bare="s")
    with pytest.raises(ConfigError):
        parse_duration(True, bare="s")
    with pytest.raises(ValueError):
        parse_duration("1", bare="parsecs")


# --------------------------------------------------------------------------- every caller agrees

def _tune_rate(text):
    return tune.link_from_options(HostInfo(), text, "1ms", None).rate_bps


def _tune_rtt(text):
    return tune.link_from_options(HostInfo(), "1gbit", text, None).rtt_s


def _cluster_rate(text):
    return ClusterSpec(nodes=2, rate_bps=text).rate_bps


def _cluster_delay(text):
    return ClusterSpec(nodes=2, delay_s=text).delay_s


def _plan_rate(text):
    return parse_rate_Bps(text, "rate") * 8


@pytest.mark.parametrize("text, bps", RATES)
def test_callers_read_a_rate_the_same(text, bps):
    assert _tune_rate(text) == pytest.approx(bps)
    assert _plan_rate(text) == pytest.approx(bps)
    if 8000 <= bps <= 100e9:
        assert _cluster_rate(text) == int(bps)
    else:
        with pytest.raises(ConfigError, match="between"):
            _cluster_rate(text)


@pytest.mark.parametrize("text, hint", BAD_RATES)
def test_callers_refuse_a_rate_the_same(text, hint):
    for parse, field in ((_tune_rate, "--rate"), (_cluster_rate, "rate"), (_plan_rate, "rate")):
        with pytest.raises(ConfigError) as e:
            parse(text)
        assert e.value.field == field and hint in e.value.fix


@pytest.mark.parametrize("text, s", DURATIONS)
def test_callers_read_a_duration_the_same(text, s):
    assert _tune_rtt(text) == pytest.approx(s)
    if s <= 5:
        assert _cluster_delay(text) == pytest.approx(s)
    else:
        with pytest.raises(ConfigError, match="between"):
            _cluster_delay(text)


@pytest.mark.parametrize("text, hint", BAD_DURATIONS)
def test_callers_refuse_a_duration_the_same(text, hint):
    for parse, field in ((_tune_rtt, "--rtt"), (_cluster_delay, "delay")):
        with pytest.raises(ConfigError) as e:
            parse(text)
        assert e.value.field == field and hint in e.value.fix


@pytest.mark.parametrize("text, share", [("0.1%", 0.001), ("1%", 0.01), ("0", 0.0), ("0%", 0.0),
                                         (0.02, 0.02)])
def test_fraction(text, share):
    assert parse_fraction(text, "loss", below=0.5) == pytest.approx(share)


@pytest.mark.parametrize("text, hint", [("0.1", "percentage"), ("60%", "below 50%"),
                                        ("lots", "percentage"), ("-1%", "percentage")])
def test_fraction_refused(text, hint):
    with pytest.raises(ConfigError) as e:
        parse_fraction(text, "loss", below=0.5)
    assert e.value.field == "loss" and hint in e.value.fix


def test_rate_range_names_both_ends():
    with pytest.raises(ConfigError, match="between 8kbit and 100gbit"):
        parse_rate_bps("1kbit", within_bps=(8000, 100e9))
    with pytest.raises(ConfigError, match="between 0 and 5s"):
        parse_duration("6s", "delay", maximum_s=5.0)


@pytest.mark.parametrize("text,value", [
    ("65536", 65536), ("64K", 64_000), ("64k", 64_000), ("64KiB", 65536), ("4M", 4_000_000),
    ("4MB", 4_000_000), ("64MiB", 64 << 20), ("1G", 10**9), ("1GiB", 1 << 30), ("4 k", 4000),
    ("3.7MB", 3_700_000), (128, 128),
])
def test_parse_size(text, value):
    """One size rule for every command: prefixes decimal, Ki/Mi/Gi binary, as for rates."""
    assert units.parse_size(text) == value


@pytest.mark.parametrize("text", ["", "4X", "-1", "4Mb", "abc", "0", True])
def test_parse_size_rejects(text):
    with pytest.raises(ConfigError, match="--max-bytes"):
        units.parse_size(text, "--max-bytes")


def test_parse_size_minimum():
    assert units.parse_size("4", minimum=4) == 4
    with pytest.raises(ConfigError, match="at least 4 bytes"):
        units.parse_size("1", "--max-bytes", minimum=4)


@pytest.mark.parametrize("Bps,style,text", [
    (1.25e6, "bits", "10 Mbit/s"), (1.25e6, "bytes", "1.25 MB/s"),
    (1.25e6, "both", "1.25 MB/s (10 Mbit/s)"), (1.25e6, "tc", "10mbit"),
    (1.5e6 / 8, "tc", "1.5mbit"), (125e9 / 8, "bits", "125 Gbit/s"), (500, "bytes", "500 B/s"),
    (None, "bytes", "-"), (None, "tc", "unshaped"),
])
def test_fmt_rate(Bps, style, text):
    assert units.fmt_rate(Bps, style) == text


@pytest.mark.parametrize("text", ["8kbit", "1500kbit", "10mbit", "1.5mbit", "100gbit", "123.457mbit"])
def test_fmt_rate_tc_reads_back(text):
    """What the tc style prints, the parsers read back (cluster state, tune advice)."""
    bps = units.parse_rate_bps(text)
    assert units.parse_rate_bps(units.fmt_rate(bps / 8, "tc")) == pytest.approx(bps, rel=1e-6)


# HOST:PORT -> (host, port) with no default port; None: refused, with a piece of the fix
HOSTPORTS = [
    ("10.0.0.1:29400", ("10.0.0.1", 29400)), (" 10.0.0.1:29400 ", ("10.0.0.1", 29400)),
    ("[fd00::1]:29400", ("fd00::1", 29400)), ("[1.2.3.4]:80", ("1.2.3.4", 80)),
    ("node0:1", ("node0", 1)), ("hub.example.org:65535", ("hub.example.org", 65535)),
    # missing port
    ("node0", "give HOST:PORT"), ("[fd00::1]", "give HOST:PORT"), ("fd00::1", "give HOST:PORT"),
    ("fd00::1:29400", "give HOST:PORT"),
    # bad port
    ("node0:", "between 1 and 65535"), ("node0:x", "between 1 and 65535"),
    ("node0: 80", "between 1 and 65535"), ("node0:２９４００", "between 1 and 65535"),
    ("[fd00::1]:", "between 1 and 65535"), ("[fd00::1]:1:2", "between 1 and 65535"),
    # out of range
    ("node0:0", "between 1 and 65535"), ("node0:65536", "between 1 and 65535"),
    ("node0:99999", "between 1 and 65535"),
    # no host, or not one
    (":29400", "give HOST:PORT"), ("", "give HOST:PORT"), ("[]:80", "give HOST:PORT"),
    ("a b:1", "give HOST:PORT"), ("a/b:1", "give HOST:PORT"), ("[fd00::1]x:80", "give HOST:PORT"),
    ("[fd00::1:80", "give HOST:PORT"), ("a[b:80", "give HOST:PORT"),
]


@pytest.mark.parametrize("text, want", HOSTPORTS)
def test_hostport(text, want):
    if isinstance(want, tuple):
        assert units.parse_hostport(text, "--rdzv-endpoint") == want
        return
    with pytest.raises(ConfigError) as e:
        units.parse_hostport(text, "--rdzv-endpoint")
    assert (e.value.field, e.value.value) == ("--rdzv-endpoint", text)
    assert want in e.value.fix and "e.g. 10.0.0.1:29400" in e.value.fix


@pytest.mark.parametrize("text, want", [
    ("node0", ("node0", 51820)), ("[fd00::1]", ("fd00::1", 51820)),
    ("fd00::1", ("fd00::1", 51820)), ("2001:db8::1", ("2001:db8::1", 51820)),
    ("node0:1", ("node0", 1)), ("[fd00::1]:7", ("fd00::1", 7)),
])
def test_hostport_default_port(text, want):
    assert units.parse_hostport(text, default_port=51820) == want


def test_hostport_fix_names_the_form_and_the_callers_example():
    with pytest.raises(ConfigError, match=r"give HOST\[:PORT\], e.g. 203.0.113.5:51820"):
        units.parse_hostport("a b", "endpoint", default_port=51820, example="203.0.113.5:51820")
    with pytest.raises(ConfigError, match="between 1 and 65535, e.g. 203.0.113.5:51820"):
        units.parse_hostport("a:0", "endpoint", default_port=51820, example="203.0.113.5:51820")


def test_callers_read_hostport_the_same():
    """config's rendezvous, the overlay's endpoints and doctor's rendezvous check
    all read HOST:PORT through units.parse_hostport, each with its own default."""
    from lorasync.config import parse_endpoint
    from lorasync.netdiag.doctor import _rendezvous
    from lorasync.overlay.config import split_endpoint

    assert parse_endpoint("[fd00::1]:29400") == ("fd00::1", 29400)
    assert split_endpoint("[fd00::1]") == ("fd00::1", 51820)
    assert _rendezvous({}, "[fd00::1]") == ("[fd00::1]", "fd00::1", 29400)
    assert _rendezvous({"MASTER_ADDR": "10.0.0.1"}, None) == ("10.0.0.1:29500", "10.0.0.1", 29500)
    for call in (lambda: parse_endpoint("h:0", "run.rdzv_endpoint"),
                 lambda: split_endpoint("h:0", "peers[0].endpoint"),
                 lambda: _rendezvous({}, "h:0"), lambda: _rendezvous({"MASTER_ADDR": "h",
                                                                     "MASTER_PORT": "0"}, None)):
        with pytest.raises(ConfigError, match="between 1 and 65535"):
            call()
    with pytest.raises(ConfigError) as e:
        _rendezvous({"MASTER_ADDR": "h", "MASTER_PORT": "x"}, None)
    assert e.value.field == "MASTER_ADDR/MASTER_PORT"
