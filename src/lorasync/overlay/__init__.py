"""The supervised WireGuard overlay (``lorasync tunnel``): nodes in
different networks, behind NAT, train over one private subnet."""
