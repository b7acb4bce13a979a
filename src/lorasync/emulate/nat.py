"""The NAT router of an emulated node behind NAT: its nftables ruleset.

A node behind NAT sits in a LAN of its own; a router namespace between that
LAN and the cluster masquerades what the node sends (its packets leave with
the router's cluster address as source) and lets in only what answers them
(conntrack: established, related).  Nothing can open a connection to the
node, and nothing reaches the router itself from outside: the home-router
case.  The table lives in the router's namespace and goes with it.
"""

from __future__ import annotations

__all__ = ["TABLE", "ruleset"]

TABLE = "lsync_nat"


def ruleset(lan: str, wan: str) -> str:
    """nft ruleset (for ``nft -f -``) of a masquerading router from ``lan`` to ``wan``."""
    return f"""table ip {TABLE} {{
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    oifname "{wan}" masquerade
  }}
  chain forward {{
    type filter hook forward priority filter; policy drop;
    iifname "{lan}" oifname "{wan}" accept
    iifname "{wan}" oifname "{lan}" ct state established,related accept
  }}
  chain input {{
    type filter hook input priority filter; policy drop;
    iifname "lo" accept
    ct state established,related accept
    iifname "{lan}" accept
  }}
}}
"""
