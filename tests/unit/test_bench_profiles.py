"""Link profiles: parsing ``--profiles``, round trips, time dilation."""

from __future__ import annotations

import pytest

from lorasync.bench.profiles import dilate, parse_profiles, round_trip
from lorasync.errors import ConfigError


def test_profiles_parse_rate_and_delay():
    assert parse_profiles("10mbit, 100mbit+20ms") == [
        ("10mbit", "rate=10mbit"), ("100mbit+20ms", "rate=100mbit,delay=20ms")]
    with pytest.raises(ConfigError):
        parse_profiles(" , ")


def test_round_trip_doubles_the_one_way_delay():
    assert round_trip("20ms") == "40ms"


def test_dilation_slows_the_link_and_stretches_the_delay():
    assert dilate("10mbit", "", 4.0) == ("2500000bit", "")
    assert dilate("100mbit", "20ms", 4.0) == ("25000000bit", "80.000ms")
