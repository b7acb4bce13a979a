"""lorasync.hf.logging_note: what attach says about the Trainer's logging
interval (the logs are collectives across ranks)."""

from types import SimpleNamespace

import pytest

pytest.importorskip("transformers", reason="the lorasync[hf] extra is not installed")

from lorasync.hf import FREQUENT_LOGGING_STEPS, logging_note  # noqa: E402


def _args(strategy="steps", steps=5, world=2):
    from transformers.trainer_utils import IntervalStrategy

    return SimpleNamespace(logging_strategy=IntervalStrategy(strategy), logging_steps=steps,
                           world_size=world)


def test_frequent_logging_on_several_ranks_gets_a_note_naming_the_interval():
    note = logging_note(_args(steps=5))
    assert note is not None and "logging_steps=5" in note and "all-gathers" in note


@pytest.mark.parametrize("args", [
    _args(steps=FREQUENT_LOGGING_STEPS),      # often enough to matter no longer
    _args(steps=500),                         # transformers' default
    _args(steps=5, world=1),                  # one process: no collective
    _args(strategy="epoch"),
    _args(strategy="no"),
    _args(steps=0.1),                         # a share of the run's steps
])
def test_no_note_where_the_logs_cost_little_or_nothing(args):
    assert logging_note(args) is None
