"""Diagnose and tune the network a job trains over: ``lorasync probe``
(links measured with collectives), ``doctor`` (host and network problems,
with fixes) and ``tune`` (reversible TCP settings), on facts read from the
host (:mod:`~lorasync.netdiag.hostinfo`)."""
