"""Emulated clusters on one machine (``lorasync cluster``, ``--emulate``):
network namespaces joined by shaped links, with delay, loss, NAT routers and
the overlay, for tests and benches.

spec (what to build: ``ClusterSpec``, ``parse_emulate``), netns (the host
side: namespaces, ``ip``/``tc`` commands, process trees), cluster (building,
shaping, measuring and removing one: ``Cluster``, ``down``), launch (jobs on
it: ``launch_on_cluster``, ``emulated``), overlay, nat, delaylink, cpucap,
cli."""
