"""Fake WireGuard keys for the overlay's unit tests (no wireguard-tools needed).

Each private key is distinct, and its public key is derived from the key
file the way ``wg pubkey`` would be asked to: so a test can tell every key
apart, find a private key's bytes in any file, and check a config against
the key on its node.
"""

from __future__ import annotations

import base64
from pathlib import Path

from lorasync.overlay import enroll


def public_of(private: str) -> str:
    return base64.b64encode(b"PUBL" + base64.b64decode(private)[4:]).decode()


def fake_wg():
    """(keygen, public_key_of) for :func:`lorasync.overlay.enroll.join_overlay`."""
    n = [0]

    def keygen():
        n[0] += 1
        private = base64.b64encode(b"PRIV" + n[0].to_bytes(4, "big") + bytes(24)).decode()
        return private, public_of(private)

    def public_key_of(path):
        return public_of(Path(path).read_text().strip())
    return keygen, public_key_of


def enrolled(out, specs, hub, **kw) -> list[Path]:
    """init, join on every node, assemble (one machine plays every node):
    the NODE.tunnel.json paths in ``specs`` order."""
    keygen, public_key_of = fake_wg()
    return enroll.enroll_locally(out, [enroll.parse_node_spec(s) for s in specs], hub,
                                 keygen=keygen, public_key_of=public_key_of, **kw)
