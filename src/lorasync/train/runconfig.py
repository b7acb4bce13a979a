"""A run's ``config.yaml``: written whole with a checksum, checked before ``--resume`` trusts it.

The file's first line says how it ends: its last line holds the SHA-256 of
every line above it.  A file cut short (a disk that filled up, a copy that
stopped) or changed by hand no longer matches, and ``--resume`` refuses it
with the field where it breaks off, instead of filling what is missing with
defaults (a cut inside ``lora.targets`` would otherwise silently train a
different adapter).  A ``config.yaml`` without that first line (written by an
earlier version, or whose checksum a user removed to keep an edit) must
still hold every section.
"""

from __future__ import annotations

import hashlib
import os
import re

from lorasync.config import SECTIONS, Config, config_to_dict, iter_fields
from lorasync.errors import LorasyncError

__all__ = ["write_run_config", "check_run_config", "FIXED_ON_RESUME"]

_HEADER = ("# lorasync run config; the last line holds the SHA-256 of the lines above it "
           "(--resume checks that the file is whole)\n")
_TRAILER = re.compile(r"# sha256: ([0-9a-f]{64})\n?")
_FIX_CUT = ("restore it from a copy, or complete it by hand and delete its first line (the "
            "checksum is then not checked); or start a new run in another --output-dir")

#: fields a resumed run cannot change: the checkpoints' adapter has their shape
FIXED_ON_RESUME = (("lora", "r"), ("lora", "targets"))


def write_run_config(cfg: Config, path: str) -> None:
    """Write ``cfg`` to ``path`` atomically, between the header and its checksum."""
    import yaml

    body = _HEADER + yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
    tmp = path + ".part"
    with open(tmp, "w") as fh:
        fh.write(body + f"# sha256: {hashlib.sha256(body.encode()).hexdigest()}\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def check_run_config(path: str) -> None:
    """Raise a ``LorasyncError`` naming the field when ``path`` is not whole."""
    with open(path, "rb") as fh:
        text = fh.read().decode("utf-8", errors="replace")
    lines = text.splitlines(keepends=True)
    if not lines or lines[0] != _HEADER:
        _check_sections(path, text)
        return
    m = _TRAILER.fullmatch(lines[-1])
    if m is None:
        missing, last = _fields_missing(text)
        where = (f"{missing[0]} and the {len(missing) - 1} field(s) after it are missing"
                 + (f", {last} (the last one there) may be incomplete" if last else "")
                 if missing else "its last line, the checksum, is cut")
        raise LorasyncError(f"{path}: cut short ({where}); {_FIX_CUT}")
    if hashlib.sha256("".join(lines[:-1]).encode()).hexdigest() != m.group(1):
        missing, _ = _fields_missing(text)
        what = (f"{missing[0]}{' and more' if len(missing) > 1 else ''} missing" if missing
                else "its SHA-256 does not match its last line")
        raise LorasyncError(
            f"{path}: changed since the run wrote it ({what}); give changes as flags with "
            "--resume instead (they override it), or, to keep a deliberate edit, delete its "
            "first and last lines (the checksum)")


def _fields_missing(text: str) -> tuple[list[str], str | None]:
    """Fields the run writes that ``text`` lacks (``section.field``, in the order
    written), and the last field present before the first missing one.  Read
    line by line: a file cut short is often no longer valid YAML."""
    present, section = set(), None
    for line in text.splitlines():
        if m := re.match(r"([A-Za-z_]\w*):", line):
            section = m.group(1)
            present.add(section)
        elif section and (m := re.match(r"  ([A-Za-z_]\w*):", line)):
            present.add(f"{section}.{m.group(1)}")
    order = [f"{s}.{f.name}" for s, f in iter_fields()]
    missing = [k for k in order if k not in present]
    before = [k for k in order[:order.index(missing[0])] if k in present] if missing else []
    return missing, before[-1] if before else None


def _check_sections(path: str, text: str) -> None:
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return  # load_config names the line
    data = data if isinstance(data, dict) else {}
    missing = [s for s in SECTIONS if not isinstance(data.get(s), dict) or not data[s]]
    if missing:
        raise LorasyncError(f"{path}: the section {missing[0]} is missing or empty (the file is "
                            f"cut short or was edited): write it back, or start a new run in "
                            "another --output-dir")
