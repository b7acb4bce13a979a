"""Emulated clusters on one machine (``lorasync cluster``, ``--emulate``):
network namespaces joined by shaped links, with delay, loss, NAT routers and
the overlay, for tests and benches."""
