"""Shared test helpers: run the CLI as a user would, in a subprocess; skip a
test that needs what this host lacks (root, network tools, TUN), saying what.

A test that builds network namespaces carries the ``netns`` marker, with the
tools it needs beyond root, ``ip`` and ``tc``, and ``tun=True`` where it needs
``/dev/net/tun``::

    pytestmark = pytest.mark.netns("nft", "wireguard-go", "wg", tun=True)

Markers on the module and on the test add up.  ``pytest_collection_modifyitems``
below turns them into a skip whose reason names everything missing."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: the Debian package that brings each tool a test may ask for
PACKAGES = {"ip": "iproute2", "tc": "iproute2", "nft": "nftables", "wireguard-go": "wireguard-go",
            "wg": "wireguard-tools", "ssh": "openssh-client", "ssh-keygen": "openssh-client",
            "sshd": "openssh-server"}
#: sshd is outside a non-root user's PATH; lorasync starts this one (overlay/sshtun.py)
SSHD = "/usr/sbin/sshd"
#: what every netns test needs besides root
NETNS_TOOLS = ("ip", "tc")


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


def missing(*tools: str, root: bool = True, tun: bool = False) -> str | None:
    """None when this host has all a test needs, else the skip reason: root,
    each missing tool with the packages that bring it, /dev/net/tun."""
    lacks = []
    if root and os.geteuid() != 0:
        lacks.append("root")
    absent = [t for t in dict.fromkeys(tools)
              if not (os.access(SSHD, os.X_OK) if t == "sshd" else shutil.which(t))]
    if absent:
        packages = dict.fromkeys(PACKAGES.get(t, t) for t in absent)
        lacks.append(f"{', '.join(absent)} (apt-get install -y {' '.join(packages)})")
    if tun and not os.path.exists("/dev/net/tun"):
        lacks.append("/dev/net/tun")
    return f"needs {'; '.join(lacks)}" if lacks else None


def netns_missing(marks) -> str | None:
    """What a test with these ``netns`` marks lacks on this host (None: nothing)."""
    tools = [*NETNS_TOOLS, *(t for m in marks for t in m.args)]
    return missing(*tools, tun=any(m.kwargs.get("tun") for m in marks))


def pytest_collection_modifyitems(config, items):
    for item in items:
        marks = list(item.iter_markers("netns"))
        why = netns_missing(marks) if marks else None
        if why:
            item.add_marker(pytest.mark.skip(reason=why))
