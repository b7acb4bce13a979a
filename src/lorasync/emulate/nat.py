"""nftables rulesets of an emulated cluster: NAT routers and the hub's conditions.

NAT (``nat=node2``).  A node behind NAT sits in a LAN of its own; a router
namespace between that LAN and the cluster masquerades what the node sends
(its packets leave with the router's cluster address as source) and lets in
only what answers them (conntrack: established, related).  Nothing can open
a connection to the node, and nothing reaches the router itself from
outside: the home-router case.  The table lives in the router's namespace
and goes with it.

Symmetric NAT (``symmetric_nat=node2``).  Plain masquerade keeps a
connection's source port when it is free, so one local socket shows the same
outside port to every destination ("endpoint-independent mapping"): a peer
that learns the port from a rendezvous server can reach the node on it, which
is what hole punching relies on.  ``masquerade fully-random`` picks a new
random port for every new conntrack entry; a conntrack entry is one
(source, destination) 5-tuple, so one local socket gets a different outside
port for each destination ("endpoint-dependent mapping", the symmetric NAT of
RFC 4787 and of carrier-grade NAT and many corporate firewalls): the port one
peer saw is useless to another, and hole punching between two such nodes fails.

Conditions in the hub (:func:`conditions_ruleset`).  The hub routes every
packet between nodes, so one table there carries the conditions that act on a
node's path:

- ``block_udp=node1``: UDP forwarded out of node1 (and to the hub itself) is
  dropped; TCP and ICMP pass.  Nothing the emulation runs uses UDP (links,
  delay forwarder and measurements are TCP or TUN), so the rule has no
  exceptions.
- ``mtu_blackhole=node1``: the hub's routes to and from node1 carry a
  smaller MTU (:data:`BLACKHOLE_MTU`, set by ``cluster``), so a larger packet
  with DF set is dropped there, and the ICMP "fragmentation needed" the hub
  would send back is dropped too: the sender never learns the path MTU, large
  packets vanish and small ones pass (a PMTU black hole, as behind a
  firewall that filters all ICMP).
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["BLACKHOLE_MTU", "CONDITIONS_TABLE", "TABLE", "conditions_ruleset", "ruleset"]

TABLE = "lsync_nat"
CONDITIONS_TABLE = "lsync_cond"
#: the path MTU of a black-holed node: what a tunnel in the path often leaves; low enough
#: to lose every full-size packet, high enough that a WireGuard overlay (60 bytes of
#: overhead) still fits above the 1280 its interface needs
BLACKHOLE_MTU = 1400


def ruleset(lan: str, wan: str, symmetric: bool = False) -> str:
    """nft ruleset (for ``nft -f -``) of a masquerading router from ``lan`` to
    ``wan``; ``symmetric``: a new random outside port per destination."""
    mapping = " fully-random" if symmetric else ""
    return f"""table ip {TABLE} {{
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    oifname "{wan}" masquerade{mapping}
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


def conditions_ruleset(block_udp: Sequence[str], blackhole: bool) -> str | None:
    """nft ruleset of the hub: UDP dropped from the hub ports in ``block_udp``
    (``["p1"]``), and with ``blackhole`` no "fragmentation needed" leaves the
    hub.  None when there is nothing to do."""
    rules_fwd, rules_in, rules_out = [], [], []
    if block_udp:
        ports = ", ".join(f'"{p}"' for p in block_udp)
        rules_fwd.append(f"iifname {{ {ports} }} meta l4proto udp drop")
        rules_in.append(f"iifname {{ {ports} }} meta l4proto udp drop")
    if blackhole:
        # the hub's own ICMP errors leave through output; forward catches any it relays
        frag = "icmp type destination-unreachable icmp code frag-needed drop"
        rules_out.append(frag)
        rules_fwd.append(frag)
    if not (rules_fwd or rules_in or rules_out):
        return None
    chains = []
    for chain, hook, rules in (("forward", "forward", rules_fwd), ("input", "input", rules_in),
                               ("output", "output", rules_out)):
        if rules:
            body = "\n".join(f"    {r}" for r in rules)
            chains.append(f"  chain {chain} {{\n    type filter hook {hook} priority filter; "
                          f"policy accept;\n{body}\n  }}")
    return f"table ip {CONDITIONS_TABLE} {{\n" + "\n".join(chains) + "\n}\n"
