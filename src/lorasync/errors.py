"""The one exception family of lorasync.

Every error a user can cause (bad config, bad data, missing model, missing
privilege) is a ``LorasyncError``; ``cli.py`` turns it into a one-line
message and exit code 2.  Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

__all__ = [
    "LorasyncError",
    "ConfigError",
    "UnknownKey",
    "DataError",
    "ModelError",
    "EnvironmentProblem",
    "CheckpointError",
]


class LorasyncError(Exception):
    """Base class: a problem the user can fix. ``str()`` is the whole message."""

    exit_code = 2


class ConfigError(LorasyncError, ValueError):
    """An option has a wrong name, type or value.

    The message names the field, the value that was given and the fix.
    """

    def __init__(self, field: str, value, fix: str):
        self.field, self.value, self.fix = field, value, fix
        super().__init__(f"{field}: invalid value {value!r}: {fix}")


class UnknownKey(ConfigError):
    """A name that is not among the known ones (a config key, a strategy option).

    The message names where, the key, and the closest known name or the list.
    """

    def __init__(self, where: str, key: str, known, what: str = "key", field: str | None = None):
        import difflib

        known = list(known)
        close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.5)
        hint = (f"did you mean {close[0]!r}?" if close else
                f"known {what}s: {', '.join(known)}" if known else f"it takes no {what}s")
        self.field, self.value, self.fix = field or where, key, hint
        LorasyncError.__init__(self, f"{where}: unknown {what} {key!r}; {hint}")


class DataError(LorasyncError):
    """A data file (or line of one) cannot be used; names file and line."""


class ModelError(LorasyncError):
    """The model cannot be found or loaded."""


class EnvironmentProblem(LorasyncError):
    """The host lacks something needed (root, iproute2, a kernel feature)."""


class CheckpointError(LorasyncError):
    """A checkpoint is missing, incomplete or does not fit this run."""
