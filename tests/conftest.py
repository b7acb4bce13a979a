"""Shared test helpers: run the CLI as a user would, in a subprocess."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli_env(**extra):
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"})
    env.update(extra)
    return env


def run_cli(*args, timeout=240, cwd=None, **env):
    """Run ``python -m lorasync ARGS``; returns CompletedProcess (text)."""
    return subprocess.run([sys.executable, "-m", "lorasync", *map(str, args)], cwd=cwd,
                          env=cli_env(**env), capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def lorasync_cli():
    return run_cli
